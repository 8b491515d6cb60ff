"""`torchscript` (fp32), `fp16`, `bf16`: torch.jit.trace of the (converted) module.

Traced with the golden batch-1 inputs on the target device (HF code creates tensors on the
input's device, which a trace bakes in). Tracing bakes Python control flow and ints taken from
shapes, which is why verification runs every golden batch size. The frozen + optimised form is
tried first and kept only if it verifies; else the plain trace. Half-precision variants take their
floating inputs in the variant's dtype; the runtime casts float32 in and out.
"""
from __future__ import annotations

from typing import Optional

import torch

from pipeline.build.plan import emulated_dtype_note
from pipeline.build.variants.base import (Artifact, BuildContext, Converter, default_input_dtypes, forget_jit_types,
                                    module_copy, register)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@register
class TorchScriptConverter(Converter):
    name = "torchscript"
    family = "torch"
    dtype = "float32"
    methods = ("trace-freeze", "trace")
    artifact = "model.pt"

    @classmethod
    def host_unsuitable(cls, env: dict) -> Optional[str]:
        return emulated_dtype_note(cls.dtype, env)     # fp16 / bf16 without native instructions

    def _trace(self, ctx: BuildContext):
        dtype = TORCH_DTYPES[self.dtype]
        module = module_copy(ctx.module(), ctx.device, dtype)
        if self.releases_module:
            ctx.loaded.release_module()      # the copy holds converted tensors of its own
        args = ctx.example_inputs(1, ctx.device, float_dtype=dtype)
        with torch.no_grad():
            # check_trace=False: the golden-set verification is the (stricter) check.
            return torch.jit.trace(module, args, check_trace=False)

    def _save(self, ctx: BuildContext, module) -> Artifact:
        module.save(str(ctx.out_dir / self.artifact))
        forget_jit_types()
        return Artifact(self.artifact, "torchscript", default_input_dtypes(ctx.loaded, self.dtype),
                        extra={"traced_batch_size": 1})

    def build_trace_freeze(self, ctx: BuildContext) -> Artifact:
        frozen = torch.jit.freeze(self._trace(ctx).eval())
        if ctx.device == "cpu":
            # CPU-specific rewrites (MKLDNN, conv-bn folding); a CUDA build keeps the frozen graph.
            frozen = torch.jit.optimize_for_inference(frozen)
        return self._save(ctx, frozen)

    def build_trace(self, ctx: BuildContext) -> Artifact:
        return self._save(ctx, self._trace(ctx))


@register
class Float16Converter(TorchScriptConverter):
    name = "fp16"
    dtype = "float16"
    # The half-precision copy holds its own tensors: the fp32 module goes (a GPU build's host RAM too).
    releases_module = True


@register
class BFloat16Converter(TorchScriptConverter):
    name = "bf16"
    dtype = "bfloat16"
    releases_module = True
