"""Attention fusion on the exported ONNX graph, before ONNX Runtime optimises it (`conversion.onnx_fusions`).

ORT's session optimiser fuses LayerNorm, SkipLayerNorm and BiasGelu on our dynamo-exported graphs but
not attention: its attention patterns are the TorchScript exporter's. Left unfused, each layer's
attention is ~25 nodes (Reshape/Transpose per head split, MatMul, scale, mask Add, Softmax, MatMul,
Transpose/Reshape back). onnxscript, the dynamo exporter's own library, carries rewrite rules for the
dynamo graph's forms; this module applies the ones that end in ORT's MultiHeadAttention contrib op:
erf-Gelu → Gelu, scaled-dot-product attention → SDPA → MultiHeadAttention with the Q/K/V biases; a
decoder's RMSNorm → SimplifiedLayerNormalization, its rotary embedding and grouped-query attention.
A graph with a third of the nodes: less for ORT to set up when a session is created, and one fused
kernel per layer's attention instead of its chain of small ops.

The Q/K/V projections stay three MatMuls (ORT's packed-QKV `Attention` op is not formed): int8
smoothing and quantization then see exactly the MatMuls they see without fusion.

Every rewrite is checked, not trusted: the fused graph must give the unfused graph's outputs on golden
batches (the largest and the smallest, so a batch dimension fixed by a rule shows) within
ATOL/RTOL, or the export is kept as it was and the record says why. The variant's own verification
then judges the artifact as for any build.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np

log = logging.getLogger(__name__)

ATOL, RTOL = 1e-4, 1e-3        # fp32 graph against fp32 graph: a reordered softmax differs by ~1e-7
FUSED_OPS = ("MultiHeadAttention", "GroupQueryAttention", "Gelu", "RotaryEmbedding", "SimplifiedLayerNormalization",
             "SkipSimplifiedLayerNormalization")


def _rules():
    """(name, function, kwargs) in the order onnxscript's own fuse_xformers applies them, without its
    packed-QKV `Attention` (the int8 builds must see the three projections' MatMuls) and without the
    LayerNorm fusions ORT's session optimiser makes itself. A decoder backbone's RMSNorm, rotary
    embedding and grouped-query SDPA (Qwen3, Llama) and an encoder's SDPA that no MHA pattern took
    (ModernBERT's rotary layers) end in ORT's contrib ops too."""
    from onnxscript.rewriter.ort_fusions.cos_sin_cache import fuse_cos_sin_cache
    from onnxscript.rewriter.ort_fusions.erfgelu import fuse_erfgelu
    from onnxscript.rewriter.ort_fusions.gqa import fuse_gqa
    from onnxscript.rewriter.ort_fusions.mha import fuse_mha1, fuse_mha2
    from onnxscript.rewriter.ort_fusions.mha_bias import fuse_mha_bias
    from onnxscript.rewriter.ort_fusions.mha_scale import fuse_mha_scale
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.rotary_embedding import fuse_partial_rotary_embedding, fuse_rotary_embedding
    from onnxscript.rewriter.ort_fusions.sdpa import fuse_sdpa
    from onnxscript.rewriter.ort_fusions.sdpa_via_mha import replace_sdpa_by_mha
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization
    return (("erf_gelu", fuse_erfgelu, {}),
            ("rms_normalization", fuse_rms_normalization, {}),
            ("skip_rms_normalization", fuse_skip_rms_normalization, {}),
            ("rotary_embedding", fuse_rotary_embedding, {}),
            ("cos_sin_cache", fuse_cos_sin_cache, {}),
            ("partial_rotary_embedding", fuse_partial_rotary_embedding, {}),
            ("sdpa", fuse_sdpa, {"apply_shape_inference": True}),   # its rules add nodes shape inference types
            ("gqa", fuse_gqa, {}),
            ("mha1", fuse_mha1, {}), ("mha2", fuse_mha2, {}), ("mha_scale", fuse_mha_scale, {}),
            ("mha_bias", fuse_mha_bias, {}),
            ("sdpa_via_mha", replace_sdpa_by_mha, {}))


def _fused_model(path: Path):
    """The graph at `path` with the rules applied (weights stay in their file, read lazily) and
    the count of each rule's rewrites."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter.ort_fusions import shape_optimization

    model = ir.load(str(path))
    before = sum(1 for _ in model.graph)
    # onnxscript's pre-pass: shapes typed and constant shape arithmetic folded, so the patterns see
    # the dynamo graph's attention as one form whatever the model's sizes.
    common_passes.ShapeInferencePass()(model)
    optimize(model)
    shape_optimization.rules.apply_to_model(model)
    optimize(model)
    counts = {name: int(rule(model, **kwargs)) for name, rule, kwargs in _rules()}
    optimize(model)       # intermediate functions the later rules did not consume are inlined again
    return model, counts, before


def _outputs(path: Path, feeds: list[dict]) -> list[list[np.ndarray]]:
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.add_session_config_entry("session.disable_prepacking", "1")   # a few calls: no packed copy of the weights
    session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return [session.run(None, {k: v for k, v in f.items() if k in names}) for f in feeds]


def _mismatch(ref: list[list[np.ndarray]], got: list[list[np.ndarray]], atol: float, rtol: float) -> Optional[str]:
    for b, (r_outs, g_outs) in enumerate(zip(ref, got)):
        for o, (r, g) in enumerate(zip(r_outs, g_outs)):
            if r.shape != g.shape:
                return f"batch {b} output {o}: shape {g.shape} where the unfused graph gives {r.shape}"
            if not np.allclose(g, r, atol=atol, rtol=rtol):
                return (f"batch {b} output {o}: max |difference| {float(np.max(np.abs(g - r))):.3g} "
                        f"beyond atol {atol:g} + rtol {rtol:g}")
    return None


def check_feeds(golden) -> list[dict]:
    """The golden batches the fused graph is checked on: the largest and the smallest (a batch
    dimension a rule fixed shows at one of them)."""
    batches = sorted(golden.batches, key=lambda b: b.batch_size)
    return [b.feeds for b in ([batches[-1]] if len(batches) == 1 else [batches[-1], batches[0]])]


def fuse_attention(raw: Path, data_name: Optional[str], feeds: list[dict],
                   atol: float = ATOL, rtol: float = RTOL) -> dict:
    """Rewrite the export `raw` (its tensors in `data_name` beside it, or inside) with the fused
    attention when the rules match and the outputs hold; → variant.json's "fusion" record."""
    t0 = time.perf_counter()
    record: dict = {"applied": False}
    work = raw.parent / "fused"            # the same names as the export's, so references stay valid
    work.mkdir(exist_ok=True)
    fused = work / raw.name
    try:
        try:
            model, counts, before = _fused_model(raw)
        except Exception as e:      # a rule that fails on an unusual graph must not cost the variant
            record["reason"] = f"onnxscript's rewrite failed: {type(e).__name__}: {e}"
            return record
        record["rewrites"] = {k: v for k, v in counts.items() if v}
        if not any(n.op_type in FUSED_OPS and n.domain == "com.microsoft" for n in model.graph):
            record["reason"] = "no attention, normalization or Gelu pattern of the dynamo exporter's in this graph"
            return record
        import onnx_ir as ir
        record["nodes"] = [before, sum(1 for _ in model.graph)]
        ir.save(model, str(fused), external_data=data_name)
        del model
        expected = _outputs(raw, feeds)
        try:
            why = _mismatch(expected, _outputs(fused, feeds), atol, rtol)
            why = why and f"the fused graph's outputs differ from the export's ({why})"
        except Exception as e:    # e.g. a fused op this ORT build has no kernel for
            why = f"ONNX Runtime cannot run the fused graph ({type(e).__name__}: {str(e)[:300]})"
        if why:
            record["reason"] = why + "; the export is kept"
            log.warning("attention fusion not applied: %s", record["reason"])
            return record
        if data_name:
            os.replace(work / data_name, raw.with_name(data_name))
        os.replace(fused, raw)
        record["applied"] = True
        return record
    finally:
        shutil.rmtree(work, ignore_errors=True)
        record["seconds"] = round(time.perf_counter() - t0, 2)
        if record["applied"]:
            log.info("attention fused: %s, %d → %d nodes, in %.1f s", record["rewrites"], *record["nodes"],
                     record["seconds"])

