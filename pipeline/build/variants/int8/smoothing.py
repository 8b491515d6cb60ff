"""Activation smoothing before int8 (SmoothQuant, Xiao et al. 2023) for the ONNX int8 variants.

Dynamic int8 quantizes each MatMul's input per tensor, per call: one u8 scale for the whole
activation. Transformers carry a few input channels far larger than the rest (MiniLM's residual
stream reaches 223 where most channels stay under 5), so that one scale leaves the other channels a
handful of levels. Smoothing divides each input channel j by s_j and multiplies row j of the weight
by s_j — the same product in exact arithmetic — with s_j = max|x_j|^α / max|w_j|^(1-α): part of the
activation's range moves into the weight, which is quantized per output channel and copes better.

The division is a Mul by 1/s inserted after the input's producer, one per distinct input (Q, K and
V share theirs, so they share s, with max|w_j| taken over all three). It is not folded into the
preceding LayerNorm: in a post-LN transformer that output also feeds the residual stream.

α is chosen by measurement, cheaply: one forward pass captures every quantizable MatMul's fp32
input on the calibration set (per-channel maxima over all of it; the inputs themselves on the
ranking batches), then for each α in ALPHAS each op's own output error with input and weight
fake-quantized (sensitivity.LocalErrors) is computed in torch — no graph is built until the choice.
Each input gets its own α: the one under which its ops' worst error is least, or none when no α
lowers it (MiniLM's FFN output wants 0.8, its attention output none).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from pipeline.build.variants.int8.sensitivity import LocalErrors, fake_quant_activation, fake_quant_weight

log = logging.getLogger(__name__)

ALPHAS = (0.5, 0.6, 0.7, 0.8)       # migration strengths tried by "auto" (SmoothQuant uses 0.5–0.85)
SCALE_CLIP = (1e-3, 1e3)            # keeps s finite for dead channels (max |x| = 0) and tiny weights
EPS = 1e-5


@dataclass
class SmoothGroup:
    """The MatMuls reading one input tensor: they share one scale vector."""
    input: str
    nodes: list                      # onnx NodeProto, MatMul with a constant 2-D weight [K, N]
    act_max: np.ndarray              # per input channel, over the calibration set
    weight_max: np.ndarray           # per input channel (row of W), over all the group's weights
    alpha: Optional[float] = None    # chosen migration strength (None: not smoothed)

    def scales(self, alpha: float) -> np.ndarray:
        # A channel quieter in calibration than the group's median counts as the median: one that was
        # (nearly) silent there would otherwise be multiplied up by 1/s and become the outlier when a
        # request does excite it (a ReLU channel dead on 32 calibration samples did, on the golden set).
        act = np.maximum(self.act_max, max(float(np.median(self.act_max)), EPS))
        s = act ** alpha / np.maximum(self.weight_max, EPS) ** (1.0 - alpha)
        return np.clip(s, *SCALE_CLIP).astype(np.float32)


def capture(path: Path, tensors: list[str], feeds: list[dict], reduce=None) -> list[dict[str, np.ndarray]]:
    """Run the fp32 graph at `path` once per feed, returning the named intermediate `tensors`
    (graph optimisations off, so every tensor keeps its name). `reduce(batch_index, values)` may
    consume a batch instead; it returns what to keep of it (None: nothing)."""
    import onnx
    import onnxruntime as ort
    from onnx import helper
    model = onnx.load(str(path), load_external_data=False)
    known = {o.name for o in model.graph.output}
    for x in tensors:
        if x not in known:
            model.graph.output.append(helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None))
    probe = path.with_name(f"probe_{path.stem}.onnx")     # beside `path`: its external data still resolves
    onnx.save(model, str(probe))
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(probe), sess_options=so, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        kept = []
        for b, f in enumerate(feeds):
            values = dict(zip(tensors, session.run(tensors, {k: f[k] for k in names})))
            kept.append(values if reduce is None else reduce(b, values))
        return kept
    finally:
        probe.unlink(missing_ok=True)


def groups_of(path: Path, ops: list[str]) -> tuple[list[SmoothGroup], dict]:
    """The smoothable groups among `ops` (MatMuls with a constant 2-D weight), without act_max yet,
    and the graph's initializers by name (weights read lazily from external data)."""
    import onnx
    from onnx import numpy_helper
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    wanted = set(ops)
    by_input: dict[str, list] = {}
    for n in model.graph.node:
        if n.op_type == "MatMul" and n.name in wanted and n.input[1] in inits and len(inits[n.input[1]].dims) == 2:
            by_input.setdefault(n.input[0], []).append(n)
    groups = []
    for x, nodes in by_input.items():
        wmax = np.max([np.abs(numpy_helper.to_array(inits[n.input[1]], base_dir=str(path.parent))).max(axis=1)
                       for n in nodes], axis=0)
        groups.append(SmoothGroup(x, nodes, np.zeros_like(wmax), wmax))
    return groups, inits


def local_errors(groups: list[SmoothGroup], inputs: list[dict], weights: dict[str, torch.Tensor],
                 alpha: Optional[float], reduce_range: bool, per_channel: bool, static: bool) -> dict[str, float]:
    """Each grouped op's own output error (u8 input — per call, or for `static` over its range on
    these batches, as int8.onnx_local_errors — and s8 weight) after smoothing with `alpha` (None: as it is)."""
    return local_errors_by_alpha(groups, inputs, weights, (alpha,), reduce_range, per_channel, static)[alpha]


def local_errors_by_alpha(groups: list[SmoothGroup], inputs: list[dict], weights: dict[str, torch.Tensor],
                          alphas, reduce_range: bool, per_channel: bool, static: bool) -> dict:
    """{α: `local_errors` under α} for each of `alphas`, op by op: an op's fp32 product x @ w, the
    same under every α, is computed once (a 2 GB model's smoothing choice spent ~40% of its time
    recomputing it for each α)."""
    errors = {a: LocalErrors() for a in alphas}
    for g in groups:
        scales = {a: torch.from_numpy(g.scales(a)) if a is not None else None for a in alphas}
        xs = [torch.from_numpy(np.asarray(b[g.input], np.float32)) for b in inputs]
        for n in g.nodes:
            w = weights[n.input[1]]
            refs = [x @ w for x in xs]
            for a in alphas:
                s = scales[a]
                ws = w * s[:, None] if s is not None else w
                wq = fake_quant_weight(ws, 1 if per_channel else None, reduce_range)
                smoothed = [x / s if s is not None else x for x in xs]
                lo_hi = (min(float(x.min()) for x in smoothed), max(float(x.max()) for x in smoothed)) if static else None
                for ref, x_s in zip(refs, smoothed):
                    lo, hi = lo_hi or (float(x_s.min()), float(x_s.max()))
                    errors[a].add(n.name, ref, fake_quant_activation(x_s, lo, hi, static and reduce_range) @ wq)
    return {a: e.result() for a, e in errors.items()}


def choose(path: Path, ops: list[str], feeds: list[dict], setting, reduce_range: bool, per_channel: bool,
           static: bool, ranking_batches: int) -> tuple[list[SmoothGroup], dict]:
    """→ (the groups to smooth, each with its activation maxima and α; the record for variant.json).
    `setting`: "auto" (measure ALPHAS and none per input), a number (that α everywhere), or None (off)."""
    from onnx import numpy_helper
    t0 = time.perf_counter()
    if setting in (None, False):
        return [], {"applied": False, "why": "conversion.int8.smoothing_alpha is off"}
    if setting == "auto" and static:
        # Static QDQ clips each smoothed input to its calibrated range, and the channels smoothing
        # amplifies are exactly those the calibration saw quiet: a plain MLP that passed whole-model
        # static int8 fell to golden cosine 0.983 once smoothed. Set a number to smooth anyway.
        return [], {"applied": False, "why": "auto smooths dynamic int8 only (static ranges clip amplified channels)"}
    groups, inits = groups_of(path, ops)
    if not groups:
        return [], {"applied": False, "why": "no MatMul with a constant 2-D weight to smooth"}
    names = [g.input for g in groups]
    act = {x: None for x in names}

    def reduce(b, values):
        for x, v in values.items():
            m = np.abs(v).reshape(-1, v.shape[-1]).max(axis=0)
            act[x] = m if act[x] is None else np.maximum(act[x], m)
        return values if b < ranking_batches else None

    inputs = [v for v in capture(path, names, feeds, reduce) if v is not None]
    for g in groups:
        g.act_max = act[g.input].astype(np.float32)
    if setting != "auto":
        for g in groups:
            g.alpha = float(setting)
        return groups, {"applied": True, "alpha": float(setting), "why": "set in params.yaml",
                               "groups": len(groups), "ops": sum(len(g.nodes) for g in groups),
                               "choose_s": round(time.perf_counter() - t0, 2)}
    weights = {n.input[1]: torch.from_numpy(numpy_helper.to_array(inits[n.input[1]], base_dir=str(path.parent))
                                            .astype(np.float32)) for g in groups for n in g.nodes}
    errors = local_errors_by_alpha(groups, inputs, weights, (None, *ALPHAS), reduce_range, per_channel, static)
    # Each group its own α (Q/K/V, attention output, FFN in and out differ: MiniLM's FFN output wants
    # 0.8, its attention output none): the one whose worst op errs least, none unless one is lower.
    for g in groups:
        worst = {a: max(errors[a][n.name] for n in g.nodes) for a in errors}
        best = min(ALPHAS, key=lambda a: worst[a])
        g.alpha = best if worst[best] < worst[None] else None
    chosen = {n.name: errors[g.alpha][n.name] for g in groups for n in g.nodes}
    before = errors[None]
    smoothed = [g for g in groups if g.alpha is not None]
    record = {"applied": bool(smoothed),
              "alpha_per_group": {str(a): sum(1 for g in groups if g.alpha == a) for a in (None, *ALPHAS)},
              "why": (f"{len(smoothed)} of {len(groups)} inputs smoothed: the worst op's own int8 error "
                      f"{max(before.values()):.4f} → {max(chosen.values()):.4f}, mean "
                      f"{np.mean(list(before.values())):.4f} → {np.mean(list(chosen.values())):.4f}"
                      if smoothed else "no α lowers any op's own int8 error: kept as it is"),
              "by": "each op's own output error (input u8, weight s8) on the ranking batches, per input and α",
              "worst_op_error": {"before": round(max(before.values()), 6), "after": round(max(chosen.values()), 6)},
              "mean_op_error": {"before": round(float(np.mean(list(before.values()))), 6),
                                "after": round(float(np.mean(list(chosen.values()))), 6)},
              "groups": len(groups), "ops": sum(len(g.nodes) for g in groups),
              "choose_s": round(time.perf_counter() - t0, 2)}
    log.info("int8 smoothing: %s (%.1f s)", record["why"], record["choose_s"])
    return smoothed, record


def apply(src: Path, dst: Path, groups: list[SmoothGroup], external: bool) -> None:
    """Write `src` smoothed to `dst` (+ its data file when `external`): a Mul by 1/s on each group's
    input, each weight's rows times s (s from the group's α). Same outputs as `src` up to rounding."""
    import onnx
    from onnx import helper, numpy_helper
    from pipeline.build.variants.onnx import data_file
    # The graph only: an external source's weights are streamed to dst's data file one at a time.
    model = onnx.load(str(src), load_external_data=not external)
    g = model.graph
    consumers = {n.name for grp in groups for n in grp.nodes}
    inserted: dict[str, onnx.NodeProto] = {}     # group input → its Mul
    row_scales: dict[str, np.ndarray] = {}       # weight → its rows' s
    for k, grp in enumerate(groups):
        s = grp.scales(grp.alpha)
        inv, out = f"smooth{k}_inv_s", f"smooth{k}_{grp.input}"
        g.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inv))
        inserted[grp.input] = helper.make_node("Mul", [grp.input, inv], [out], name=f"smooth{k}_mul")
        row_scales.update({n.input[1]: s for n in grp.nodes})
    renamed = {grp.input: inserted[grp.input].output[0] for grp in groups}
    order = []
    produced_here = set()
    for n in g.node:
        if n.name in consumers:
            n.input[0] = renamed[n.input[0]]
        order.append(n)
        for o in n.output:            # the Mul right after its input's producer: still topologically sorted
            if o in inserted:
                order.append(inserted[o])
                produced_here.add(o)
    # Inputs produced by no node (graph inputs) get their Mul first.
    order = [inserted[x] for x in inserted if x not in produced_here] + order
    del g.node[:]
    g.node.extend(order)
    from onnx.external_data_helper import uses_external_data
    for t in g.initializer:          # weights held in the graph itself (all of them, or the small ones)
        if t.name in row_scales and not uses_external_data(t):
            w = numpy_helper.to_array(t).astype(np.float32)
            t.CopyFrom(numpy_helper.from_array(w * row_scales[t.name][:, None], t.name))
    if external:
        _stream_weights(g, src.parent, data_file(dst), row_scales)
    onnx.save(model, str(dst))


def _stream_weights(g, src_dir: Path, data_path: Path, row_scales: dict[str, np.ndarray]) -> None:
    """Write every external weight of graph `g` (read from `src_dir`) to `data_path`, rows scaled
    where `row_scales` says, and point `g` at it. One weight in memory at a time: a weight rewritten
    inside the loaded model would stay in protobuf's arena beside its replacement."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data
    with open(data_path, "wb") as out:
        for t in g.initializer:
            if not uses_external_data(t):
                continue
            w = numpy_helper.to_array(t, base_dir=str(src_dir))
            if t.name in row_scales:
                w = w.astype(np.float32) * row_scales[t.name][:, None]
            offset = out.tell()
            out.write(np.ascontiguousarray(w).astype(w.dtype.newbyteorder("<"), copy=False).tobytes())
            del t.external_data[:]
            for key, value in (("location", data_path.name), ("offset", offset), ("length", out.tell() - offset)):
                t.external_data.add(key=key, value=str(value))
            t.data_location = onnx.TensorProto.EXTERNAL
