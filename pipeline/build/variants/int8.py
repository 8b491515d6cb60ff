"""int8 variants: `onnx-int8-dynamic`, `onnx-int8-static` (QDQ, calibrated) and `int8` (torch).

All three are judged by `conversion.tolerances.int8` (dtype "int8"; `gate: task` — the task's own
figures, pipeline/accuracy/task_gate.py) and share the fallback of pipeline/build/variants/sensitivity.py: when the
whole-model quantization misses the gate on the calibration set, the most sensitive ops stay fp32.

Calibration set: `conversion.int8.calibration_samples` requests from the task adapter's example
distribution (handlers/tasks.py — for text the 5–15-word sentences of the serving load, for images
the golden-style pictures, for tensors the golden inputs' distribution), drawn with their own seed
so they are disjoint from the golden set that verifies the result. Reference outputs on it come from
the fp32 graph being quantized (ONNX) or the eager module (torch).

- onnx-int8-dynamic: the exported fp32 graph optimised by ORT at the BASIC level (ORT's own
  quantization pre-processing; the `onnx` variant's EXTENDED fusions would hide ops), its weight-
  bearing MatMul/Gemm/Conv quantized by onnxruntime.quantization.quantize_dynamic (int8 weights,
  per-channel where `per_channel`, activations quantized per call), then re-optimised by ORT so the
  artifact holds the fused integer kernels (MatMulIntegerToFloat / DynamicQuantizeMatMul).
- onnx-int8-static: the same graph with QDQ pairs from quantize_static; activation ranges from the
  calibration set (`conversion.int8.calibration`: minmax | entropy | percentile), u8 activations,
  s8 weights; ORT fuses the QDQ groups into integer kernels when it optimises the artifact.
- int8 (torch family): torch.ao.quantization.quantize_dynamic of nn.Linear (x86/fbgemm engine, CPU),
  traced to TorchScript like the `torchscript` variant, so the torch handler serves it unchanged.
  torch 2.13 still ships torch.ao.quantization's eager dynamic path; torchao is not installed here.

Host suitability: int8 pays where the CPU has integer dot-product instructions — AVX-512 VNNI,
AVX-VNNI, AMX-INT8, or at least AVX2, or Arm NEON/ASIMD. Without VNNI, x86 u8s8 kernels multiply
with vpmaddubsw, whose int16 pair sums saturate (255·127·2 > 32767): the same MiniLM int8 graph
measured min cosine 0.9990 with AVX-512 VNNI kernels and 0.9949 with AVX2 ones on the same golden
set. `reduce_range: auto` therefore quantizes weights to 7 bits exactly there (env.json's usable ISA).
GPU int8 is TensorRT's path (a calibrated TensorRT engine), which this pipeline does not build.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from pipeline.core.params import Int8Params, Params, Tolerance, _default_tolerances
from pipeline.build.variants import smoothing
from pipeline.build.variants.base import (Artifact, BuildContext, Converter, default_input_dtypes, forget_jit_types,
                                    module_copy, register)
from pipeline.build.variants.onnx import OnnxConverter, onnx_bytes
from pipeline.build.variants.ort_quantizer import PerChannelWeightCache, calibrate_to_cache, one_model_copy
from pipeline.build.variants.sensitivity import RANKING_BATCHES, Calibration, search
from pipeline.build.variants.torchscript import TorchScriptConverter

log = logging.getLogger(__name__)

QUANTIZABLE_OPS = ("MatMul", "Gemm", "Conv")
CALIBRATION_SEED_OFFSET = 7919     # calibration requests never repeat the golden set's
CALIBRATION_BATCH = 8
GPU_INT8 = ("int8 on a GPU is TensorRT's path (a calibrated TensorRT engine), which this pipeline does not "
            "build; int8 variants are CPU variants")
# The optimised graph holds contrib ops (BiasGelu, FusedMatMul) that ONNX shape inference cannot type.
UNTYPED_AS_FLOAT = {"DefaultTensorType": 1}   # onnx.TensorProto.FLOAT
INT8_ISA = ("amx_int8", "avx512_vnni", "avx_vnni", "avx2", "asimd", "neon")
VNNI_ISA = ("amx_int8", "avx512_vnni", "avx_vnni")     # integer dot products that do not saturate


def resolve_reduce_range(setting, env: dict) -> tuple[bool, str]:
    """`conversion.int8.reduce_range` for this host: (value, why)."""
    if setting != "auto":
        return bool(setting), "set in params.yaml"
    cpu = env.get("cpu") or {}
    isa = cpu.get("isa") or {}
    if (env.get("device") or "cpu") == "cpu" and cpu.get("arch") in ("x86_64", "AMD64") and isa \
            and not any(isa.get(k) for k in VNNI_ISA):
        return True, ("auto: this x86 CPU has no VNNI/AMX-INT8, so u8s8 kernels use vpmaddubsw, which "
                      "saturates 8-bit weights; 7-bit weights avoid it")
    return False, "auto: " + ("the CPU has VNNI/AMX-INT8 (no saturation)" if isa else "no ISA flags known (env.json)")


@dataclass(frozen=True)
class Int8Options:
    quantization: Int8Params = field(default_factory=Int8Params)
    tolerance: Tolerance = field(default_factory=lambda: _default_tolerances()["int8"])
    min_topk_agreement: float = 0.99


class Int8Mixin:
    """What the three int8 converters share: options from params, host suitability, calibration."""
    dtype = "int8"
    # Their second method is a fallback for a model the first cannot build (dynamo → legacy
    # exporter; frozen → plain trace of the same quantized module). A quantized model the gate
    # rejected comes back from it with the same ops and weights: trying it is only another draw of
    # the same accuracy (bert-large onnx-int8-static: 3.3 more minutes, recall@3 0.956 after 0.933).
    retry_rejected = False

    @classmethod
    def int8_options(cls, params: Params) -> Int8Options:
        return Int8Options(quantization=params.conversion.int8, tolerance=params.conversion.tolerances["int8"],
                           min_topk_agreement=params.conversion.min_topk_agreement)

    @classmethod
    def host_unsuitable(cls, env: dict) -> Optional[str]:
        """Why int8 is not worth building on this host (artifacts/env.json), or None."""
        if (env.get("device") or "cpu") == "cuda":
            return GPU_INT8
        isa = (env.get("cpu") or {}).get("isa") or {}
        if isa and not any(isa.get(k) for k in INT8_ISA):
            return ("the CPU has no integer dot-product instructions (no AVX2, AVX-512 VNNI, AVX-VNNI, AMX-INT8 "
                    "or NEON): int8 kernels would not beat fp32")
        return None

    def for_host(self, env: dict):
        q = self.options.quantization
        value, why = resolve_reduce_range(q.reduce_range, env)
        resolved = type(self)(dataclasses.replace(self.options, quantization=dataclasses.replace(q, reduce_range=value)))
        resolved.reduce_range_reason = why
        return resolved

    def _q(self) -> Int8Params:
        return self.options.quantization

    def _reduce_range(self) -> bool:
        """The resolved setting ("auto" counts as off when no host was given)."""
        return self._q().reduce_range is True

    def calibration(self, ctx: BuildContext, reference) -> Calibration:
        """The calibration feeds and `reference(feeds)` → outputs on each batch."""
        adapter = ctx.golden.adapter()
        seed = int(ctx.golden.manifest.get("seed", 0)) + CALIBRATION_SEED_OFFSET
        requests = adapter.example_requests(self._q().calibration_samples, seed=seed)
        feeds = [adapter.collate([adapter.decode(body, ct) for body, ct in requests[i:i + CALIBRATION_BATCH]])
                 for i in range(0, len(requests), CALIBRATION_BATCH)]
        kind = ctx.golden.task.get("kind")
        return Calibration(feeds, [reference(f) for f in feeds], list(ctx.golden.outputs), kind,
                           classification=kind == "image-classification")

    def run_search(self, candidates, quantize, run, cal: Calibration, op_errors=None, local_errors=None):
        o, q = self.options, self._q()
        # Kept on the converter: a second build method reuses the ranking and shares the budget.
        state = self.__dict__.setdefault("_search_state", {})
        return search(candidates, quantize, run, cal, o.tolerance, o.min_topk_agreement,
                      q.sensitivity_budget_s, q.max_fp32_share, op_errors=op_errors, state=state,
                      local_errors=local_errors)


# --------------------------------------------------------------------------- ONNX
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
            # Quantized: the BASIC graph (constants folded, no contrib fusions such as FusedGemm or
            # BiasGelu, which would hide MatMul/Gemm from the quantizer and from shape inference);
            # the artifact is then optimised at the configured level with the integer kernels fused.
            configured = self.options
            self.options = dataclasses.replace(configured, graph_optimization="basic")
            try:
                fp32_external = super()._optimize(ctx, raw, fp32)   # fp32.onnx(.data): as the export
            finally:
                self.options = configured
            cal = self.calibration(ctx, _OrtRunner(fp32).run)
            candidates = weight_nodes(fp32)
            q = self._q()
            static = self.scheme != "dynamic"
            # Smoothing (measured, or off) rewrites the fp32 graph once; every attempt quantizes that
            # graph, judged against the unsmoothed graph's reference outputs (`cal`).
            groups, smooth_record = smoothing.choose(fp32, candidates, cal.feeds, q.smoothing_alpha,
                                                     self._reduce_range(), q.per_channel, static, RANKING_BATCHES)
            if groups:
                smoothed = tmp / "smoothed.onnx"
                smoothing.apply(fp32, smoothed, groups, external=fp32_external)
                fp32 = smoothed
            counter = [0]

            def quantize(exclude: list[str], only: Optional[list[str]]) -> Path:
                counter[0] += 1
                out = tmp / f"q{counter[0]}.onnx"
                self._quantize(fp32, out, cal, tmp, nodes=only or candidates, exclude=exclude,
                               external=fp32_external)
                return out

            def run(path: Path, on: Calibration):
                runner = _OrtRunner(path)
                return [runner.run(f) for f in on.feeds]

            def op_errors(ops: list[str], deadline: float) -> dict[str, float]:
                return onnx_op_errors(fp32, ops, cal, self._reduce_range(), q.per_channel,
                                      static=static, deadline=deadline)

            def local_errors(ops: list[str]) -> dict[str, float]:
                return onnx_local_errors(fp32, ops, cal, self._reduce_range(), q.per_channel, static=static)

            chosen, record = self.run_search(candidates, quantize, run, cal, op_errors, local_errors)
            self._record.update(scheme=self.scheme, per_channel=q.per_channel, reduce_range=self._reduce_range(),
                                reduce_range_reason=getattr(self, "reduce_range_reason", "set in params.yaml"),
                                weight_type="int8", op_types=list(QUANTIZABLE_OPS), smoothing=smooth_record,
                                **self._scheme_record(), **record)
            # int8 weights are ~4x smaller than the fp32 ones the export was sized by: the artifact's form
            # follows its own size (a 2.5 GB fp32 model's int8 artifact can be one file again).
            int8_bytes = onnx_bytes(chosen)
            external = int8_bytes >= self.options.external_data_min_bytes
            self._record.update(source_external_data=fp32_external, quantized_bytes=int8_bytes,
                                external_data=external)
            return super()._optimize(ctx, chosen, final, external)

    def _scheme_record(self) -> dict:
        return {}


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
                         reduce_range=self._reduce_range(), weight_type=QuantType.QInt8, nodes_to_quantize=list(nodes),
                             nodes_to_exclude=list(exclude), use_external_data_format=external,
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


def onnx_op_errors(path: Path, ops: list[str], cal: Calibration, reduce_range: bool,
                   per_channel: bool, static: bool, deadline: float = math.inf) -> dict[str, float]:
    """Each op's effect on the model's outputs when only it is int8 (fake-quantized: its input through
    u8 QDQ — DynamicQuantizeLinear, or for `static` QuantizeLinear over the input's min/max on the
    ranking batches — and its weight s8 per channel), from ONE session: the graph gets a switch per op
    (x + on·(QDQ(x) − x)) and its weights become overridable inputs, so each op costs one run over the
    ranking batches instead of a quantizer pass and a new session."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper
    from pipeline.build.variants.sensitivity import fake_quant_weight, output_error
    # The graph only: external tensors stay in their data file beside `path` (the probe is written
    # beside it, so its references still resolve); the weights ranked are read one at a time.
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    nodes = [n for n in g.node if n.name in set(ops) and n.input[1] in inits]
    before, switch, weight_axis, overridable = {}, {}, {}, []
    outputs = [o.name for o in g.output]
    for i, n in enumerate(nodes):
        x, t = n.input[0], f"_sens{i}_"
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        w = inits[n.input[1]]
        weight_axis[n.name] = (0 if n.op_type == "Conv" or (n.op_type == "Gemm" and attrs.get("transB"))
                               else len(w.dims) - 1)
        switch[n.name] = t + "on"
        g.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), t + "on"))
        if static:      # the scale/zero point are fed per run, from the ranges measured first
            g.initializer.extend([numpy_helper.from_array(np.ones((), np.float32), t + "s"),
                                  numpy_helper.from_array(np.zeros((), np.uint8), t + "z")])
            overridable += [(t + "s", onnx.TensorProto.FLOAT), (t + "z", onnx.TensorProto.UINT8)]
            qdq_in = [helper.make_node("QuantizeLinear", [x, t + "s", t + "z"], [t + "q"])]
        else:
            qdq_in = [helper.make_node("DynamicQuantizeLinear", [x], [t + "q", t + "s", t + "z"])]
        before[n.name] = qdq_in + [
            helper.make_node("DequantizeLinear", [t + "q", t + "s", t + "z"], [t + "dq"]),
            helper.make_node("Sub", [t + "dq", x], [t + "d"]),
            helper.make_node("Mul", [t + "d", t + "on"], [t + "dm"]),
            helper.make_node("Add", [x, t + "dm"], [t + "x"])]
        n.input[0] = t + "x"
    # The switches and weights become graph inputs with defaults (ONNX "overridable initializers").
    overridable += [(name, onnx.TensorProto.FLOAT) for name in switch.values()]
    for name, elem in overridable + [(w, onnx.TensorProto.FLOAT) for w in sorted({n.input[1] for n in nodes})]:
        i = inits.get(name)
        g.input.append(helper.make_tensor_value_info(name, elem, list(i.dims) if i else []))
    if static:          # each op's fp32 input, to measure its range
        g.output.extend(helper.make_tensor_value_info(n.input[0], onnx.TensorProto.FLOAT, None) for n in nodes)
    order = list(g.node)
    del g.node[:]
    g.node.extend(m for n in order for m in before.get(n.name, []) + [n])   # still topologically sorted
    probe = path.with_name("probe.onnx")
    onnx.save(model, str(probe))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL   # overridden weights: fold nothing
    session = ort.InferenceSession(str(probe), sess_options=so, providers=["CPUExecutionProvider"])
    defaults = {i.name for i in model.graph.initializer}
    names = [i.name for i in session.get_inputs() if i.name not in defaults]
    feeds = [{k: f[k] for k in names} for f in cal.feeds[:RANKING_BATCHES]]
    qparams: dict[str, dict] = {n.name: {} for n in nodes}
    if static:          # minmax ranges → u8 scale/zero point (as ORT's MinMax calibration)
        runs = [session.run([n.input[0] for n in nodes], f) for f in feeds]
        levels = 127 if reduce_range else 255
        for j, n in enumerate(nodes):
            lo = min(0.0, min(float(r[j].min()) for r in runs))
            hi = max(0.0, max(float(r[j].max()) for r in runs))
            scale = (hi - lo) / levels or 1.0
            t = switch[n.name][:-2]
            qparams[n.name] = {t + "s": np.asarray(scale, np.float32),
                               t + "z": np.asarray(min(levels, max(0, round(-lo / scale))), np.uint8)}
    errors: dict[str, float] = {}
    for n in nodes:
        if time.perf_counter() > deadline:
            break           # the ops not reached keep their graph order (pipeline/build/variants/sensitivity.py)
        w = torch.from_numpy(numpy_helper.to_array(inits[n.input[1]], base_dir=str(path.parent)).astype(np.float32))
        wq = fake_quant_weight(w, weight_axis[n.name] if per_channel else None, reduce_range).numpy()
        got = [[np.asarray(o, np.float32) for o in session.run(outputs, {**f, **qparams[n.name], n.input[1]: wq,
                                                                         switch[n.name]: np.ones((), np.float32)})]
               for f in feeds]
        errors[n.name] = output_error(got, cal.reference[:RANKING_BATCHES])
    return errors


def onnx_local_errors(path: Path, ops: list[str], cal: Calibration, reduce_range: bool, per_channel: bool,
                      static: bool) -> dict[str, float]:
    """Each op's own output error when it alone is int8 (sensitivity.LocalErrors), from ONE run of the
    fp32 graph that returns every op's input: the op is then recomputed from that input in torch, fp32
    and fake-quantized (input u8 — per call, or for `static` over its range on the ranking batches —
    weight s8 per channel). Weights are read one at a time from the data file."""
    import onnx
    import torch.nn.functional as F
    from onnx import helper, numpy_helper

    from pipeline.build.variants.sensitivity import LocalErrors, fake_quant_activation, fake_quant_weight
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    nodes = [n for n in g.node if n.name in set(ops) and len(n.input) > 1 and n.input[1] in inits]
    inputs = smoothing.capture(path, list(dict.fromkeys(n.input[0] for n in nodes)), cal.feeds[:RANKING_BATCHES])
    levels_reduced = static and reduce_range              # as onnx_op_errors: 7-bit activations only for static
    errors = LocalErrors()
    for n in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        w = torch.from_numpy(numpy_helper.to_array(inits[n.input[1]], base_dir=str(path.parent)).astype(np.float32))
        if n.op_type == "Gemm" and attrs.get("transB"):
            w = w.t()
        axis = (0 if n.op_type == "Conv" else w.dim() - 1) if per_channel else None
        wq = fake_quant_weight(w, axis, reduce_range)
        xs = [torch.from_numpy(np.asarray(b[n.input[0]], np.float32)) for b in inputs]
        if n.op_type == "Gemm" and attrs.get("transA"):
            xs = [x.t() for x in xs]
        if n.op_type == "Conv":
            if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or w.dim() not in (3, 4):
                continue                                   # not recomputed here: ranked after the measured ops
            k = w.dim() - 2
            pads = list(attrs.get("pads", [0] * 2 * k))
            pad = [p for d in reversed(range(k)) for p in (pads[d], pads[d + k])]
            conv = F.conv1d if k == 1 else F.conv2d
            apply = lambda x, ww: conv(F.pad(x, pad), ww, stride=attrs.get("strides", 1),  # noqa: E731
                                       dilation=attrs.get("dilations", 1), groups=attrs.get("group", 1))
        else:
            apply = torch.matmul
        lo_hi = (min(float(x.min()) for x in xs), max(float(x.max()) for x in xs)) if static else None
        for x in xs:
            lo, hi = lo_hi or (float(x.min()), float(x.max()))
            errors.add(n.name, apply(x, w), apply(fake_quant_activation(x, lo, hi, levels_reduced), wq))
    return errors.result()


def torch_local_errors(module: torch.nn.Module, ops: list[str], run_batch, feeds: list, per_channel: bool
                       ) -> dict[str, float]:
    """Each Linear's own output error when it alone is int8 (input u8 per call, weight s8 per output
    channel), from ONE forward per batch: a hook recomputes the layer fake-quantized beside its output."""
    import torch.nn.functional as F

    from pipeline.build.variants.sensitivity import LocalErrors, fake_quant_activation, fake_quant_weight
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


# --------------------------------------------------------------------------- torch
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
        from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig, quantize_dynamic

        from pipeline.model.golden import run_reference
        engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "qnnpack"
        torch.backends.quantized.engine = engine
        ctx.module()                  # loaded again if an earlier method's verification released it
        loaded = ctx.loaded
        cal = self.calibration(ctx, lambda f: run_reference(loaded, f))
        candidates = [n for n, m in loaded.module.named_modules() if isinstance(m, torch.nn.Linear)]

        qconfig = per_channel_dynamic_qconfig if self._q().per_channel else default_dynamic_qconfig

        def quantize(exclude: list[str], only: Optional[list[str]]):
            names = set(only or candidates) - set(exclude)
            # inplace on our own copy: quantize_dynamic would otherwise deep-copy the fp32 weights again
            return quantize_dynamic(module_copy(loaded.module), qconfig_spec={n: qconfig for n in names},
                                    dtype=torch.qint8, inplace=True)

        def run(module, on: Calibration):
            return [run_reference(dataclasses.replace(loaded, module=module), f) for f in on.feeds]

        def op_errors(ops: list[str], deadline: float = math.inf) -> dict[str, float]:
            """Each Linear's effect on the outputs when only it is int8 (input u8 per call, weight s8,
            fake-quantized in the eager model): one forward pass per op, no copy of the model."""
            from pipeline.build.variants.sensitivity import fake_quant_activation, fake_quant_weight, output_error
            few = cal.feeds[:RANKING_BATCHES]
            mods = dict(loaded.module.named_modules())
            axis = 0 if self._q().per_channel else None
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

        def local_errors(ops: list[str]) -> dict[str, float]:
            return torch_local_errors(loaded.module, ops, lambda f: run_reference(loaded, f),
                                      cal.feeds[:RANKING_BATCHES], self._q().per_channel)

        self._module, record = self.run_search(candidates, quantize, run, cal, op_errors, local_errors)
        self._record = {"scheme": "dynamic", "engine": engine, "weight_type": "int8", "op_types": ["Linear"],
                        "per_channel": self._q().per_channel, **record}
        return self._module
