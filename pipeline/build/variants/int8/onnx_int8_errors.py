"""How much each op of an fp32 ONNX graph errs when it alone is int8: the sensitivity search's two
rankings (pipeline/build/variants/int8/sensitivity.py) for the ONNX int8 variants.

- `onnx_op_errors`: the model's output error, from ONE session: the graph gets a switch per op
  (x + on·(QDQ(x) − x)) and its weights become overridable inputs, so each op costs one run over the
  ranking batches instead of a quantizer pass and a new session.
- `onnx_local_errors`: each op's own output error, from ONE run of the fp32 graph that returns every
  op's input; the op is recomputed from it in torch, fp32 and fake-quantized.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.build.variants.int8 import smoothing
from pipeline.build.variants.int8.sensitivity import RANKING_BATCHES, Calibration


@dataclass
class _Switch:
    """One op's switchable input QDQ in the probe graph; its tensors are named `prefix` + ...:
    "on" (the switch), "s"/"z" (the static scale and zero point), "x" (the op's switched input)."""
    prefix: str
    weight_axis: int               # the weight's output-channel axis

    @property
    def on(self) -> str:
        return self.prefix + "on"


def onnx_op_errors(path: Path, ops: list[str], cal: Calibration, reduce_range: bool,
                   per_channel: bool, static: bool, deadline: float = math.inf) -> dict[str, float]:
    """Each op's effect on the model's outputs when only it is int8 (fake-quantized: its input through
    u8 QDQ — DynamicQuantizeLinear, or for `static` QuantizeLinear over the input's min/max on the
    ranking batches — and its weight s8 per channel), from ONE session (the module docstring)."""
    import onnx
    from onnx import numpy_helper
    from pipeline.build.variants.int8.sensitivity import fake_quant_weight, output_error
    # The graph only: external tensors stay in their data file beside `path` (the probe is written
    # beside it, so its references still resolve); the weights ranked are read one at a time.
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    nodes = [n for n in g.node if n.name in set(ops) and n.input[1] in inits]
    outputs = [o.name for o in g.output]
    switches = _add_switches(g, nodes, inits, static)
    session = _probe_session(model, path.with_name("probe.onnx"))
    defaults = {i.name for i in model.graph.initializer}
    names = [i.name for i in session.get_inputs() if i.name not in defaults]
    feeds = [{k: f[k] for k in names} for f in cal.feeds[:RANKING_BATCHES]]
    qparams = (_static_qparams(session, nodes, switches, feeds, reduce_range) if static
               else {n.name: {} for n in nodes})
    errors: dict[str, float] = {}
    for n in nodes:
        if time.perf_counter() > deadline:
            break           # the ops not reached keep their graph order (pipeline/build/variants/int8/sensitivity.py)
        w = torch.from_numpy(numpy_helper.to_array(inits[n.input[1]], base_dir=str(path.parent)).astype(np.float32))
        wq = fake_quant_weight(w, switches[n.name].weight_axis if per_channel else None, reduce_range).numpy()
        on = {**qparams[n.name], n.input[1]: wq, switches[n.name].on: np.ones((), np.float32)}
        got = [[np.asarray(o, np.float32) for o in session.run(outputs, {**f, **on})] for f in feeds]
        errors[n.name] = output_error(got, cal.reference[:RANKING_BATCHES])
    return errors


def _add_switches(g, nodes: list, inits: dict, static: bool) -> dict[str, _Switch]:
    """Rewrites `g` in place: each of `nodes` reads its input through a QDQ switched off by default;
    the switches, the static scales/zero points and the nodes' weights become graph inputs with
    defaults (ONNX "overridable initializers"); for `static`, each switched input is also an output,
    to measure its range. `inits`: `g`'s initializers before the rewrite."""
    import onnx
    from onnx import helper
    switches: dict[str, _Switch] = {}
    before, overridable = {}, []
    for i, n in enumerate(nodes):
        t = f"_sens{i}_"
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        w = inits[n.input[1]]
        switches[n.name] = _Switch(t, 0 if n.op_type == "Conv" or (n.op_type == "Gemm" and attrs.get("transB"))
                                   else len(w.dims) - 1)
        before[n.name], node_overridable = _switched_input(g, n.input[0], t, static)
        overridable += node_overridable
        n.input[0] = t + "x"
    overridable += [(s.on, onnx.TensorProto.FLOAT) for s in switches.values()]
    for name, elem in overridable + [(w, onnx.TensorProto.FLOAT) for w in sorted({n.input[1] for n in nodes})]:
        i = inits.get(name)
        g.input.append(helper.make_tensor_value_info(name, elem, list(i.dims) if i else []))
    if static:          # each op's fp32 input, to measure its range
        g.output.extend(helper.make_tensor_value_info(n.input[0], onnx.TensorProto.FLOAT, None) for n in nodes)
    order = list(g.node)
    del g.node[:]
    g.node.extend(m for n in order for m in before.get(n.name, []) + [n])   # still topologically sorted
    return switches


def _switched_input(g, x: str, t: str, static: bool) -> tuple[list, list]:
    """The nodes computing `t`x = x + on·(QDQ(x) − x), their default initializers added to `g`, and
    the (name, type) of those a run may override beyond the switch."""
    import onnx
    from onnx import helper, numpy_helper
    overridable = []
    g.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), t + "on"))
    if static:      # the scale/zero point are fed per run, from the ranges measured first
        g.initializer.extend([numpy_helper.from_array(np.ones((), np.float32), t + "s"),
                              numpy_helper.from_array(np.zeros((), np.uint8), t + "z")])
        overridable += [(t + "s", onnx.TensorProto.FLOAT), (t + "z", onnx.TensorProto.UINT8)]
        qdq_in = [helper.make_node("QuantizeLinear", [x, t + "s", t + "z"], [t + "q"])]
    else:
        qdq_in = [helper.make_node("DynamicQuantizeLinear", [x], [t + "q", t + "s", t + "z"])]
    return qdq_in + [
        helper.make_node("DequantizeLinear", [t + "q", t + "s", t + "z"], [t + "dq"]),
        helper.make_node("Sub", [t + "dq", x], [t + "d"]),
        helper.make_node("Mul", [t + "d", t + "on"], [t + "dm"]),
        helper.make_node("Add", [x, t + "dm"], [t + "x"])], overridable


def _probe_session(model, probe: Path):
    """`model` saved as `probe` and opened unoptimised: its weights are overridden per run, so
    nothing may be folded into constants."""
    import onnx
    import onnxruntime as ort
    onnx.save(model, str(probe))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(probe), sess_options=so, providers=["CPUExecutionProvider"])


def _static_qparams(session, nodes: list, switches: dict[str, _Switch], feeds: list[dict],
                    reduce_range: bool) -> dict[str, dict]:
    """Each op's u8 input scale/zero point from its input's min/max over `feeds` (as ORT's MinMax
    calibration), as the probe's inputs."""
    runs = [session.run([n.input[0] for n in nodes], f) for f in feeds]
    levels = 127 if reduce_range else 255
    qparams: dict[str, dict] = {}
    for j, n in enumerate(nodes):
        lo = min(0.0, min(float(r[j].min()) for r in runs))
        hi = max(0.0, max(float(r[j].max()) for r in runs))
        scale = (hi - lo) / levels or 1.0
        t = switches[n.name].prefix
        qparams[n.name] = {t + "s": np.asarray(scale, np.float32),
                           t + "z": np.asarray(min(levels, max(0, round(-lo / scale))), np.uint8)}
    return qparams


def onnx_local_errors(path: Path, ops: list[str], cal: Calibration, reduce_range: bool, per_channel: bool,
                      static: bool) -> dict[str, float]:
    """Each op's own output error when it alone is int8 (sensitivity.LocalErrors), from ONE run of the
    fp32 graph that returns every op's input: the op is then recomputed from that input in torch, fp32
    and fake-quantized (input u8 — per call, or for `static` over its range on the ranking batches —
    weight s8 per channel). Weights are read one at a time from the data file."""
    import onnx
    from onnx import helper, numpy_helper

    from pipeline.build.variants.int8.sensitivity import LocalErrors, fake_quant_activation, fake_quant_weight
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
        apply = _recomputed(n.op_type, attrs, w)
        if apply is None:
            continue                                   # not recomputed here: ranked after the measured ops
        lo_hi = (min(float(x.min()) for x in xs), max(float(x.max()) for x in xs)) if static else None
        for x in xs:
            lo, hi = lo_hi or (float(x.min()), float(x.max()))
            errors.add(n.name, apply(x, w), apply(fake_quant_activation(x, lo, hi, levels_reduced), wq))
    return errors.result()


def _recomputed(op_type: str, attrs: dict, w: torch.Tensor):
    """The op as `f(x, weight)` in torch: MatMul/Gemm a matmul, Conv with explicit pads a 1-D/2-D conv;
    None for a Conv it does not recompute (auto_pad, or 3-D)."""
    import torch.nn.functional as F
    if op_type != "Conv":
        return torch.matmul
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or w.dim() not in (3, 4):
        return None
    k = w.dim() - 2
    pads = list(attrs.get("pads", [0] * 2 * k))
    pad = [p for d in reversed(range(k)) for p in (pads[d], pads[d + k])]
    conv = F.conv1d if k == 1 else F.conv2d
    return lambda x, ww: conv(F.pad(x, pad), ww, stride=attrs.get("strides", 1),
                              dilation=attrs.get("dilations", 1), groups=attrs.get("group", 1))
