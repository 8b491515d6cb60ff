"""The ONNX int8 variants, `onnx-int8-dynamic` and `onnx-int8-static` (pipeline/build/variants/int8/shared.py
says what they are and what they share with the torch one).

The `onnx` build (export → fused → ORT-optimised), with its optimisation step replaced by the int8
steps, each a method of `_OnnxInt8`:
  1. the fp32 graph optimised at ORT's BASIC level (what the quantizer reads),
  2. the calibration set and its reference outputs from that graph,
  3. smoothing (pipeline/build/variants/int8/smoothing.py), measured, applied or not,
  4. the sensitivity search (pipeline/build/variants/int8/sensitivity.py) over `Attempts`: each attempt
     quantizes the (smoothed) graph with ORT's quantizer, some ops kept fp32,
  5. the chosen graph optimised at the configured level, so ORT fuses the integer kernels.
"""
from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from pipeline.core.params import Params
from pipeline.build.variants.int8 import smoothing
from pipeline.build.variants.base import Artifact, BuildContext, register
from pipeline.build.variants.int8.shared import Int8Mixin, Int8Options
from pipeline.build.variants.onnx import OnnxConverter, onnx_bytes
from pipeline.build.variants.int8.onnx_int8_errors import onnx_local_errors, onnx_op_errors
from pipeline.build.variants.int8.ort_quantizer import PerChannelWeightCache, calibrate_to_cache, one_model_copy
from pipeline.build.variants.int8.sensitivity import RANKING_BATCHES, Calibration

QUANTIZABLE_OPS = ("MatMul", "Gemm", "Conv")
# The optimised graph holds contrib ops (BiasGelu, FusedMatMul) that ONNX shape inference cannot type.
UNTYPED_AS_FLOAT = {"DefaultTensorType": 1}   # onnx.TensorProto.FLOAT


class _OnnxInt8(Int8Mixin, OnnxConverter):
    """The `onnx` build (export → ORT-optimised fp32 graph), quantized, then re-optimised."""
    methods = ("dynamo", "legacy")
    scheme = ""

    @dataclass(frozen=True)
    class Options(OnnxConverter.Options, Int8Options):
        pass

    @classmethod
    def from_params(cls, params: Params):
        fields = {}
        for part in (OnnxConverter.from_params(params).options, cls.int8_options(params)):
            fields.update({f.name: getattr(part, f.name) for f in dataclasses.fields(part)})
        return cls(cls.Options(**fields))

    def _build(self, ctx: BuildContext, dynamo: bool) -> Artifact:
        self._record: dict = {}
        artifact = super()._build(ctx, dynamo)
        artifact.extra["quantization"] = self._record
        return artifact

    def _optimize(self, ctx: BuildContext, raw: Path, final: Path, external: Optional[bool] = None) -> bool:
        with tempfile.TemporaryDirectory(prefix="int8-", dir=ctx.out_dir) as tmp:
            tmp = Path(tmp)
            fp32 = tmp / "fp32.onnx"
            fp32_external = self._optimize_basic(ctx, raw, fp32)
            cal = self.calibration(ctx, _OrtRunner(fp32).run)
            candidates = weight_nodes(fp32)
            # Smoothing (measured, or off) rewrites the fp32 graph once; every attempt quantizes that
            # graph, judged against the unsmoothed graph's reference outputs (`cal`).
            fp32, smooth_record = self._smoothed(fp32, fp32_external, candidates, cal, tmp)
            attempts = Attempts(self, fp32, fp32_external, candidates, cal, tmp)
            chosen, record = self.run_search(candidates, attempts.quantize, attempts.run, cal,
                                             attempts.op_errors, attempts.local_errors)
            self._record.update(scheme=self.scheme, per_channel=self._q().per_channel,
                                reduce_range=self._reduce_range(),
                                reduce_range_reason=getattr(self, "reduce_range_reason", "set in params.yaml"),
                                weight_type="int8", op_types=list(QUANTIZABLE_OPS), smoothing=smooth_record,
                                **self._scheme_record(), **record)
            return self._optimize_quantized(ctx, chosen, final, fp32_external)

    def _optimize_basic(self, ctx: BuildContext, raw: Path, fp32: Path) -> bool:
        """`raw` optimised at the BASIC level into `fp32` (with its data file where the export has
        one); returns whether it has one. BASIC: constants folded, no contrib fusions such as FusedGemm
        or BiasGelu, which would hide MatMul/Gemm from the quantizer and from shape inference."""
        configured = self.options
        self.options = dataclasses.replace(configured, graph_optimization="basic")
        try:
            return super()._optimize(ctx, raw, fp32)
        finally:
            self.options = configured

    def _smoothed(self, fp32: Path, external: bool, candidates: list[str], cal: Calibration,
                  tmp: Path) -> tuple[Path, dict]:
        """(the graph to quantize: `fp32`, or its smoothed copy in `tmp`; the smoothing record)."""
        q = self._q()
        groups, smooth_record = smoothing.choose(fp32, candidates, cal.feeds, q.smoothing_alpha,
                                                 self._reduce_range(), q.per_channel, self.scheme != "dynamic",
                                                 RANKING_BATCHES)
        if not groups:
            return fp32, smooth_record
        smoothed = tmp / "smoothed.onnx"
        smoothing.apply(fp32, smoothed, groups, external=external)
        return smoothed, smooth_record

    def _optimize_quantized(self, ctx: BuildContext, chosen: Path, final: Path, fp32_external: bool) -> bool:
        """The chosen int8 graph optimised at the configured level into `final` (the integer kernels
        fused). int8 weights are ~4x smaller than the fp32 ones the export was sized by: the artifact's
        form follows its own size (a 2.5 GB fp32 model's int8 artifact can be one file again)."""
        int8_bytes = onnx_bytes(chosen)
        external = int8_bytes >= self.options.external_data_min_bytes
        self._record.update(source_external_data=fp32_external, quantized_bytes=int8_bytes,
                            external_data=external)
        return super()._optimize(ctx, chosen, final, external)

    def _quantize(self, src: Path, dst: Path, cal: Calibration, tmp: Path, nodes, exclude, external: bool) -> None:
        raise NotImplementedError

    def _scheme_record(self) -> dict:
        return {}


@dataclass
class Attempts:
    """What the sensitivity search calls for one ONNX int8 build: every attempt quantizes the same
    fp32 graph (`fp32`, smoothed where smoothing was chosen) with a different set of ops kept fp32."""
    converter: _OnnxInt8
    fp32: Path
    external: bool                 # `fp32` keeps its weights in a data file
    candidates: list[str]          # the weight-bearing ops (weight_nodes)
    cal: Calibration               # reference outputs: the unsmoothed graph's
    tmp: Path                      # this build's scratch folder; attempt i is written to q<i>.onnx
    count: int = 0

    @property
    def static(self) -> bool:
        return self.converter.scheme != "dynamic"

    def quantize(self, exclude: list[str], only: Optional[list[str]]) -> Path:
        self.count += 1
        out = self.tmp / f"q{self.count}.onnx"
        self.converter._quantize(self.fp32, out, self.cal, self.tmp, nodes=only or self.candidates, exclude=exclude,
                                 external=self.external)
        return out

    def run(self, path: Path, on: Calibration):
        runner = _OrtRunner(path)
        return [runner.run(f) for f in on.feeds]

    def op_errors(self, ops: list[str], deadline: float) -> dict[str, float]:
        return onnx_op_errors(self.fp32, ops, self.cal, self.converter._reduce_range(),
                              self.converter._q().per_channel, static=self.static, deadline=deadline)

    def local_errors(self, ops: list[str]) -> dict[str, float]:
        return onnx_local_errors(self.fp32, ops, self.cal, self.converter._reduce_range(),
                                 self.converter._q().per_channel, static=self.static)


@register
class OnnxInt8DynamicConverter(_OnnxInt8):
    name = "onnx-int8-dynamic"
    scheme = "dynamic"

    def _quantize(self, src, dst, cal, tmp, nodes, exclude, external):
        from onnxruntime.quantization import QuantType, quantize_dynamic
        q = self._q()
        # Every sensitivity attempt quantizes the same fp32 weights (only the kept set differs): the
        # per-channel results are reused (keyed to this build's `tmp`, so to one fp32 graph).
        # ORT's dynamic quantizer would hold three copies of the weights while it refreshes shapes.
        cache = self.__dict__.setdefault("_weight_cache", PerChannelWeightCache())
        with cache.active(scope=str(tmp)), one_model_copy():
            quantize_dynamic(str(src), str(dst), op_types_to_quantize=list(QUANTIZABLE_OPS), per_channel=q.per_channel,
                             reduce_range=self._reduce_range(), weight_type=QuantType.QInt8,
                             nodes_to_quantize=list(nodes), nodes_to_exclude=list(exclude),
                             use_external_data_format=external,
                             extra_options={"MatMulConstBOnly": True, **UNTYPED_AS_FLOAT})


@register
class OnnxInt8StaticConverter(_OnnxInt8):
    name = "onnx-int8-static"
    scheme = "static-qdq"
    METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}

    def _scheme_record(self) -> dict:
        return {"calibration": self._q().calibration, "calibration_samples": self._q().calibration_samples,
                "activation_type": "uint8"}

    def _quantize(self, src, dst, cal, tmp, nodes, exclude, external):
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
        q = self._q()
        # The ranges are measured once (the first call), holding one copy of the weights, and reused
        # by every sensitivity attempt through quantize_static's calibration cache.
        method = getattr(CalibrationMethod, self.METHODS[q.calibration])
        cache = tmp / "calibration.json"
        if not cache.exists():
            calibrate_to_cache(src, _FeedsReader(cal.feeds), list(QUANTIZABLE_OPS), method, cache)
        quantize_static(str(src), str(dst), _FeedsReader(cal.feeds), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=list(QUANTIZABLE_OPS), per_channel=q.per_channel,
                        reduce_range=self._reduce_range(), activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        nodes_to_quantize=list(nodes), nodes_to_exclude=list(exclude),
                        calibrate_method=method, calibration_cache_path=cache, use_external_data_format=external,
                        extra_options={"MatMulConstBOnly": True, "WeightSymmetric": True,
                                       "ActivationSymmetric": False, **UNTYPED_AS_FLOAT,
                                       # A MatMul weight is (in, out): its output channels are axis 1.
                                       "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1}})


def weight_nodes(path: Path) -> list[str]:
    """Names of the MatMul/Gemm/Conv nodes whose weight is a constant: what int8 quantizes (an
    activation × activation MatMul, e.g. attention scores, stays fp32)."""
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    consts = {i.name for i in model.graph.initializer}
    consts |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in model.graph.node
            if n.op_type in QUANTIZABLE_OPS and len(n.input) > 1 and n.input[1] in consts and n.name]


class _OrtRunner:
    def __init__(self, path: Path):
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]

    def run(self, feeds: dict) -> list[np.ndarray]:
        return [np.asarray(o, np.float32) for o in self.session.run(None, {n: feeds[n] for n in self.names})]


class _FeedsReader:
    """onnxruntime.quantization.CalibrationDataReader over the calibration feeds."""

    def __init__(self, feeds: list[dict]):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)
