"""The torch int8 variant, `int8`: torch.ao.quantization.quantize_dynamic of nn.Linear, traced to
TorchScript (pipeline/build/variants/int8/shared.py says what it shares with the ONNX ones).

The sensitivity search (pipeline/build/variants/int8/sensitivity.py) runs over `Attempts`: each attempt
quantizes a copy of the eager module with some Linears kept fp32; the rankings fake-quantize one
Linear at a time in the eager module itself (no copy).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pipeline.core.params import Params
from pipeline.build.variants.base import (Artifact, BuildContext, default_input_dtypes, forget_jit_types,
                                          module_copy, register)
from pipeline.build.variants.int8.shared import GPU_INT8, Int8Mixin, Int8Options
from pipeline.build.variants.int8.sensitivity import RANKING_BATCHES, Calibration
from pipeline.build.variants.torchscript import TorchScriptConverter


@register
class TorchInt8Converter(Int8Mixin, TorchScriptConverter):
    name = "int8"
    family = "torch"
    methods = ("trace-freeze", "trace")

    Options = Int8Options

    @classmethod
    def from_params(cls, params: Params):
        return cls(cls.int8_options(params))

    def _trace(self, ctx: BuildContext):
        if ctx.device != "cpu":
            raise RuntimeError(f"torch dynamic int8 runs on CPU only (asked: {ctx.device}); " + GPU_INT8)
        module = self._quantized(ctx)
        with torch.no_grad():
            return torch.jit.trace(module, ctx.example_inputs(1, "cpu"), check_trace=False)

    def _save(self, ctx: BuildContext, module) -> Artifact:
        module.save(str(ctx.out_dir / self.artifact))
        forget_jit_types()
        return Artifact(self.artifact, "torchscript", default_input_dtypes(ctx.loaded),
                        extra={"traced_batch_size": 1, "quantization": self._record})

    def _quantized(self, ctx: BuildContext):
        """Quantized once per build; the methods (frozen, plain trace) share it."""
        if getattr(self, "_module", None) is not None:
            return self._module
        from pipeline.model.golden import run_reference
        engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "qnnpack"
        torch.backends.quantized.engine = engine
        ctx.module()                  # loaded again if an earlier method's verification released it
        loaded = ctx.loaded
        cal = self.calibration(ctx, lambda f: run_reference(loaded, f))
        candidates = [n for n, m in loaded.module.named_modules() if isinstance(m, torch.nn.Linear)]
        attempts = Attempts(loaded, candidates, cal, self._q().per_channel)
        self._module, record = self.run_search(candidates, attempts.quantize, attempts.run, cal,
                                               attempts.op_errors, attempts.local_errors)
        self._record = {"scheme": "dynamic", "engine": engine, "weight_type": "int8", "op_types": ["Linear"],
                        "per_channel": self._q().per_channel, **record}
        return self._module


@dataclass
class Attempts:
    """What the sensitivity search calls for one torch int8 build."""
    loaded: Any                    # the eager model (pipeline.model.checkpoint's loaded model)
    candidates: list[str]          # its nn.Linear modules, by name
    cal: Calibration
    per_channel: bool
    # Linear name -> what quantize_dynamic makes of it: every attempt quantizes the same fp32 weights
    # (only the kept set differs), so each Linear is quantized once per build, not once per attempt.
    quantized: dict = dataclasses.field(default_factory=dict)

    def quantize(self, exclude: list[str], only: Optional[list[str]]):
        from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig, quantize_dynamic
        qconfig = per_channel_dynamic_qconfig if self.per_channel else default_dynamic_qconfig
        names = set(only or self.candidates) - set(exclude)
        module = module_copy(self.loaded.module)           # shares the fp32 weights, never copies them
        originals = dict(self.loaded.module.named_modules())
        for name in sorted(names):
            if name not in self.quantized:
                # quantize_dynamic's own path on this Linear alone: the module it would have put there
                # (a Linear of a type it does not quantize comes back as it was)
                alone = torch.nn.Sequential(module_copy(originals[name]))
                self.quantized[name] = quantize_dynamic(alone, qconfig_spec={"0": qconfig}, dtype=torch.qint8,
                                                        inplace=True)[0]
            parent, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attr, self.quantized[name])
        return module

    def run(self, module, on: Calibration):
        from pipeline.model.golden import run_reference
        return [run_reference(dataclasses.replace(self.loaded, module=module), f) for f in on.feeds]

    def op_errors(self, ops: list[str], deadline: float = math.inf) -> dict[str, float]:
        return torch_op_errors(self.loaded, ops, self.cal, self.per_channel, deadline)

    def local_errors(self, ops: list[str]) -> dict[str, float]:
        from pipeline.model.golden import run_reference
        return torch_local_errors(self.loaded.module, ops, lambda f: run_reference(self.loaded, f),
                                  self.cal.feeds[:RANKING_BATCHES], self.per_channel)


def torch_op_errors(loaded, ops: list[str], cal: Calibration, per_channel: bool,
                    deadline: float = math.inf) -> dict[str, float]:
    """Each Linear's effect on the outputs when only it is int8 (input u8 per call, weight s8,
    fake-quantized in the eager model): one forward pass per op, no copy of the model."""
    from pipeline.build.variants.int8.sensitivity import fake_quant_activation, fake_quant_weight, output_error
    from pipeline.model.golden import run_reference
    few = cal.feeds[:RANKING_BATCHES]
    mods = dict(loaded.module.named_modules())
    axis = 0 if per_channel else None
    errors = {}
    for n in ops:
        if time.perf_counter() > deadline:
            break       # the ops not reached keep their graph order
        m = mods[n]
        fp32_weight = m.weight.data
        hook = m.register_forward_pre_hook(
            lambda _, a: (fake_quant_activation(a[0], float(a[0].min()), float(a[0].max()), False),) + a[1:])
        try:
            m.weight.data = fake_quant_weight(fp32_weight, axis, False)
            errors[n] = output_error([run_reference(loaded, f) for f in few], cal.reference[:RANKING_BATCHES])
        finally:
            m.weight.data = fp32_weight
            hook.remove()
    return errors


def torch_local_errors(module: torch.nn.Module, ops: list[str], run_batch, feeds: list, per_channel: bool
                       ) -> dict[str, float]:
    """Each Linear's own output error when it alone is int8 (input u8 per call, weight s8 per output
    channel), from ONE forward per batch: a hook recomputes the layer fake-quantized beside its output."""
    import torch.nn.functional as F

    from pipeline.build.variants.int8.sensitivity import LocalErrors, fake_quant_activation, fake_quant_weight
    errors = LocalErrors()
    mods = dict(module.named_modules())

    def hook(name):
        def fn(m, args, out):
            x = args[0]
            wq = fake_quant_weight(m.weight, 0 if per_channel else None, False)
            errors.add(name, out, F.linear(fake_quant_activation(x, float(x.min()), float(x.max()), False),
                                           wq, m.bias))
        return fn

    handles = [mods[n].register_forward_hook(hook(n)) for n in ops]
    try:
        with torch.no_grad():
            for f in feeds:
                run_batch(f)
    finally:
        for h in handles:
            h.remove()
    return errors.result()
