"""Attention fusion (pipeline/build/variants/fusion.py): the dynamo export of a BERT gets ORT's MultiHeadAttention,
kept only when the fused graph computes what the export does; the ONNX variants build on it."""
from __future__ import annotations

import collections
import hashlib
import json

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from pipeline.model.checkpoint import load_model
from pipeline.model.golden import write_golden
from pipeline.build.variants.base import BuildContext
from pipeline.build.variants.fusion import check_feeds, fuse_attention
from pipeline.build.variants.onnx import OnnxConverter, data_file
from tests.build.test_variants import assert_converted, convert, tensor_case


def _export(loaded, golden, folder, external=False):
    """The export the ONNX variants start from (the converter's own export step)."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = folder / "raw.onnx"
    OnnxConverter()._export(BuildContext(loaded, golden, folder, "cpu"), raw, dynamo=True, external=external)
    return raw


def _ops(path):
    return collections.Counter((n.domain or "ai.onnx", n.op_type)
                               for n in onnx.load(str(path), load_external_data=False).graph.node)


def _run(path, feeds):
    import onnxruntime as ort
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return [session.run(None, {k: v for k, v in f.items() if k in names})[0] for f in feeds]


def _digest(*paths):
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


@pytest.fixture(scope="module")
def text_case(tmp_path_factory, make_params, tiny_text_model_dir):
    params = make_params({"name": "tiny-text", "source": "hf", "checkpoint": str(tiny_text_model_dir),
                          "task": "text-embedding", "text": {"max_length": 32}})
    loaded = load_model(params)
    golden = write_golden(params, loaded, tmp_path_factory.mktemp("golden"))
    return params, loaded, golden


@pytest.mark.parametrize("external", [False, True])
def test_attention_is_fused_and_computes_what_the_export_does(external, text_case, tmp_path):
    _, loaded, golden = text_case
    raw = _export(loaded, golden, tmp_path / "export", external=external)
    assert data_file(raw).exists() == external
    feeds = check_feeds(golden)
    assert (feeds[0]["attention_mask"] == 0).any()       # padded rows: the mask goes through the fused op
    before, ops_before = _run(raw, feeds), _ops(raw)
    assert ("com.microsoft", "MultiHeadAttention") not in ops_before

    record = fuse_attention(raw, data_file(raw).name if external else None, feeds)
    assert record["applied"], record
    ops = _ops(raw)
    assert ops[("com.microsoft", "MultiHeadAttention")] == 2            # one per layer
    assert ops[("ai.onnx", "Softmax")] == 0 and ops[("ai.onnx", "MatMul")] == 2 * 6   # Q, K, V, out, FFN ×2
    assert record["nodes"][1] < record["nodes"][0] / 1.5
    assert sorted(p.name for p in raw.parent.iterdir()) == sorted([raw.name] + ([raw.name + ".data"] if external else []))
    for want, got in zip(before, _run(raw, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_a_fused_graph_that_differs_keeps_the_export_and_says_why(text_case, tmp_path):
    _, loaded, golden = text_case
    raw = _export(loaded, golden, tmp_path / "export", external=True)
    files = [raw, data_file(raw)]
    digests = _digest(*files)
    # A negative tolerance no output can meet: the check's verdict, not the rules, decides.
    record = fuse_attention(raw, data_file(raw).name, check_feeds(golden), atol=-1.0, rtol=0.0)
    assert not record["applied"]
    assert "outputs differ from the export's" in record["reason"] and "max |difference|" in record["reason"]
    assert _digest(*files) == digests
    assert sorted(p.name for p in raw.parent.iterdir()) == sorted(f.name for f in files)


def test_a_model_without_attention_is_left_as_exported(tmp_path):
    torch.manual_seed(0)
    loaded, golden = tensor_case(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), 8)
    raw = _export(loaded, golden, tmp_path / "export")
    digest = _digest(raw)
    record = fuse_attention(raw, None, check_feeds(golden))
    assert not record["applied"] and "no attention" in record["reason"]
    assert _digest(raw) == digest


@pytest.mark.parametrize("variant", ["onnx", "onnx-int8-dynamic"])
def test_onnx_variants_build_on_the_fused_graph_unless_switched_off(variant, text_case, make_params, tmp_path):
    params, loaded, golden = text_case
    record = convert(variant, params, loaded, golden, tmp_path / "on")
    assert_converted(record, tmp_path / "on", golden)
    meta = json.loads((tmp_path / "on" / "variant.json").read_text())
    assert meta["fusion"]["applied"], meta["fusion"]
    ops = _ops(tmp_path / "on" / "model.onnx")
    assert ops[("com.microsoft", "MultiHeadAttention")] == 2
    if variant == "onnx-int8-dynamic":
        # the Q/K/V projections stay MatMuls, so every weight MatMul is still quantized
        integer = ops[("com.microsoft", "DynamicQuantizeMatMul")] + ops[("com.microsoft", "MatMulIntegerToFloat")]
        assert integer == 12 - len(meta["quantization"].get("fp32_ops") or [])

    off = make_params({"name": "tiny-text", "source": "hf", "checkpoint": params.model.checkpoint,
                       "task": "text-embedding", "text": {"max_length": 32}}, conversion={"onnx_fusions": False})
    record = convert(variant, off, loaded, golden, tmp_path / "off")
    assert_converted(record, tmp_path / "off", golden)
    meta = json.loads((tmp_path / "off" / "variant.json").read_text())
    assert meta["fusion"] == {"applied": False, "reason": "conversion.onnx_fusions is off"}
    assert ("com.microsoft", "MultiHeadAttention") not in _ops(tmp_path / "off" / "model.onnx")


def test_a_later_onnx_variant_reuses_the_fused_export_without_fusing_again(text_case, tmp_path, monkeypatch):
    """Issue 30: the fusion took ~14 s in each of a 2 GB model's four ONNX variants. The export cache
    keeps the export fused, with the fusion's record: a later variant neither exports nor fuses."""
    params, loaded, golden = text_case
    convert("onnx", params, loaded, golden, tmp_path / "first")

    def must_not_fuse(*_a, **_k):
        raise AssertionError("the fused export was in the cache")
    monkeypatch.setattr(OnnxConverter, "_fuse", must_not_fuse)
    record = convert("onnx-fp16", params, loaded, golden, tmp_path / "later")
    assert_converted(record, tmp_path / "later", golden)
    meta = json.loads((tmp_path / "later" / "variant.json").read_text())
    assert meta["export"]["reused"] and meta["fusion"]["applied"] and meta["fusion"]["reused"]
    assert _ops(tmp_path / "later" / "model.onnx")[("com.microsoft", "MultiHeadAttention")] == 2


@pytest.mark.parametrize("family", ["decoder", "modernbert"])
def test_decoder_and_modernbert_graphs_fuse_and_compute_what_the_export_does(family, make_params, tmp_path):
    """A Qwen3-style decoder (RMSNorm, rotary, grouped-query SDPA under a causal + left-padding mask)
    and ModernBERT (rotary, global + sliding-window SDPA, GeGLU): ORT's contrib ops, the outputs held."""
    if family == "decoder":
        from scripts.make_decoder_model import build
        want_ops = {"MultiHeadAttention", "SkipSimplifiedLayerNormalization"}
    else:
        from scripts.make_modernbert_model import build
        want_ops = {"MultiHeadAttention", "Gelu"}
    folder = build(tmp_path / "model", seed=4)
    params = make_params({"name": f"tiny-{family}", "source": "hf", "checkpoint": str(folder),
                          "task": "text-embedding", "text": {"max_length": 48}})
    loaded = load_model(params)
    golden = write_golden(params, loaded, tmp_path / "golden")
    raw = _export(loaded, golden, tmp_path / "export")
    feeds = check_feeds(golden)
    assert (feeds[0]["attention_mask"] == 0).any()
    before = _run(raw, feeds)
    record = fuse_attention(raw, None, feeds)
    assert record["applied"], record
    ops = {op for domain, op in _ops(raw) if domain == "com.microsoft"}
    assert want_ops <= ops, ops
    for want, got in zip(before, _run(raw, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
