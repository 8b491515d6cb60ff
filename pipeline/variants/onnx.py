"""`onnx` (fp32) and `onnx-fp16`: one self-contained .onnx file, optimised at build time.

Export: the dynamo exporter first (torch.export underneath, dynamic batch/sequence), the legacy
TorchScript-based exporter as the fallback; both with `external_data=False` semantics (one file).
The graph is then optimised by ONNX Runtime itself at the EXTENDED level (operator fusions; not the
ALL level, whose NCHWc layout rewrites tie the file to one CPU's instruction set) for the target
device's execution provider, and that optimised graph is the artifact: sessions load it with
optimisation off (faster start, measured.md). fp16: onnxruntime's float16 converter with
`keep_io_types=True`, so the artifact still takes and returns float32.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from handlers.runtime_onnx import check_providers_active, choose_providers
from pipeline.params import Params
from pipeline.variants.base import Artifact, BuildContext, Converter, register

log = logging.getLogger(__name__)
ARTIFACT = "model.onnx"
# The dynamo exporter's passes log every step at INFO; keep the conversion log readable.
for _name in ("onnx_ir", "onnxscript", "torch.onnx"):
    logging.getLogger(_name).setLevel(logging.WARNING)


@register
class OnnxConverter(Converter):
    name = "onnx"
    family = "onnx"
    dtype = "float32"
    methods = ("dynamo", "legacy")

    @dataclass(frozen=True)
    class Options:
        opset: int = 18                        # conversion.onnx_opset
        graph_optimization: str = "extended"   # ORT level baked into the artifact: basic | extended

    @classmethod
    def from_params(cls, params: Params) -> "OnnxConverter":
        return cls(cls.Options(opset=params.conversion.onnx_opset))

    def build_dynamo(self, ctx: BuildContext) -> Artifact:
        return self._build(ctx, dynamo=True)

    def build_legacy(self, ctx: BuildContext) -> Artifact:
        return self._build(ctx, dynamo=False)

    # ------------------------------------------------------------------ steps
    def _build(self, ctx: BuildContext, dynamo: bool) -> Artifact:
        raw = ctx.out_dir / "raw.onnx"
        final = ctx.out_dir / ARTIFACT
        try:
            self._export(ctx, raw, dynamo)
            self._transform(raw)
            self._optimize(ctx, raw, final)
        finally:
            for p in (raw, raw.with_name(raw.name + ".data")):
                p.unlink(missing_ok=True)
        inputs = {s.name: s.dtype for s in ctx.loaded.inputs}   # float32 stays float32 at the boundary
        return Artifact(ARTIFACT, "onnx", inputs,
                        extra={"graph_optimized": True, "graph_optimization": self.options.graph_optimization,
                               "opset": self.options.opset, "exporter": "dynamo" if dynamo else "legacy"})

    def _export(self, ctx: BuildContext, path: Path, dynamo: bool) -> None:
        loaded = ctx.loaded
        args = ctx.example_inputs()
        names_in = [s.name for s in loaded.inputs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if dynamo:
                torch.onnx.export(loaded.module, args, str(path), dynamo=True, external_data=False,
                                  input_names=names_in, output_names=list(loaded.outputs),
                                  dynamic_shapes=ctx.dynamic_shapes(), opset_version=self.options.opset,
                                  verbose=False)
            else:
                axes = {s.name: {int(a): n for a, n in s.dynamic_axes.items()} for s in loaded.inputs}
                axes.update({o: {0: "batch"} for o in loaded.outputs})
                torch.onnx.export(loaded.module, args, str(path), dynamo=False, input_names=names_in,
                                  output_names=list(loaded.outputs), dynamic_axes=axes,
                                  opset_version=self.options.opset)
        if path.with_name(path.name + ".data").exists():
            raise RuntimeError(f"the exporter wrote external data beside {path.name}; the variant must be one file")

    def _transform(self, path: Path) -> None:
        """Hook for subclasses (fp16); the fp32 variant keeps the exported graph."""

    def _optimize(self, ctx: BuildContext, raw: Path, final: Path) -> None:
        import onnxruntime as ort
        levels = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED}
        so = ort.SessionOptions()
        so.graph_optimization_level = levels[self.options.graph_optimization]
        so.optimized_model_filepath = str(final)
        so.log_severity_level = 3
        providers = choose_providers(ctx.device, ort.get_available_providers())
        session = ort.InferenceSession(str(raw), sess_options=so, providers=providers)
        check_providers_active(ctx.device, providers, session.get_providers())
        del session
        if not final.is_file():
            raise RuntimeError(f"ONNX Runtime did not write the optimised model {final}")


@register
class OnnxFloat16Converter(OnnxConverter):
    name = "onnx-fp16"
    dtype = "float16"

    def _transform(self, path: Path) -> None:
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16
        model = onnx.load(str(path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # it warns for every constant clamped to the fp16 range
            model = convert_float_to_float16(model, keep_io_types=True)
        onnx.save(model, str(path))
