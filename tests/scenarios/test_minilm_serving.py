"""The real default model end to end in a real TorchServe: MiniLM from its PyPI folder → golden set →
ONNX variant (converted and verified by the pipeline) → .mar (archive stage library, generated
model-config.yaml) → TorchServe answers the golden texts with the reference embeddings, and a bad
request gets its own 4xx while the worker keeps serving."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.serve.archive import build_archive
from pipeline.model.checkpoint import load_model
from pipeline.model.golden import write_golden
from pipeline.core.params import load_params, parse_params
from pipeline.decide.properties import write_model_config
from pipeline.build.variants.base import get_converter
from pipeline.build.builder import build_variant
from pipeline.accuracy.verify import tolerance_for

pytestmark = [pytest.mark.slow, pytest.mark.torchserve]


@pytest.fixture(scope="module")
def minilm_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm")
    base = load_params()                                  # the repo's default: MiniLM, hf source
    data = {"model": {"name": "minilm", "source": base.model.source, "checkpoint": base.model.checkpoint,
                      "task": base.model.task},
            "variants": ["eager", "onnx"], "benchmark": {"batch_sizes": [1, 4]},
            "conversion": {"golden_batches": 2}}
    params = parse_params(data)
    loaded = load_model(params)
    golden = write_golden(params, loaded, root / "golden")
    converter = get_converter("onnx").from_params(params)
    record = build_variant(converter, loaded, golden, root / "variants" / "onnx", "cpu",
                           tolerance_for(params, converter.dtype), params.conversion.min_topk_agreement)
    assert record["status"] == "converted", record["reason"]

    serve = root / "serve"
    serve.mkdir()
    write_model_config(serve / "model-config.yaml", {        # as the configure stage derives them
        "workers": 1, "threads_per_worker": 1, "batch_size": 4, "max_batch_delay_ms": 5,
        "response_timeout_s": 30, "startup_timeout_s": 60, "job_queue_size": 32, "device": "cpu",
        "max_request_bytes": 65536})
    (serve / "derivation.json").write_text("{}")
    (root / "selection.json").write_text(json.dumps({"winner": "onnx", "objective": "throughput",
                                                     "slo_met": True, "message": "test", "variants": {}}))
    (root / "env.json").write_text(json.dumps({"device": "cpu"}))
    store = root / "store"
    build_archive(params, selection_path=root / "selection.json", variants_dir=root / "variants",
                  serve_dir=serve, env_path=root / "env.json", export_dir=store)
    return store, golden


def test_torchserve_serves_minilm_with_reference_embeddings(tmp_path, minilm_store):
    from pipeline.serve.server.torchserve import TorchServe
    store, golden = minilm_store
    cases = golden.http_cases[:6]
    with TorchServe(None, store, "minilm", models="minilm=minilm.mar", workdir=tmp_path / "ts") as server:
        for case in cases:
            body = case["body"].encode() if isinstance(case["body"], str) else json.dumps(case["body"]).encode()
            r = server.api.predict(body, case["content_type"])
            assert r.status == 200, r.body[:300]
            got = np.asarray(r.json()["embedding"])
            want = np.asarray(case["expected"]["embedding"])
            assert got.shape == want.shape == (384,)
            assert float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want))) > 0.9999
        empty = server.api.predict(b"", "text/plain")
        assert 400 <= empty.status < 500 and "error" in empty.json()
        guitar = server.api.predict(json.dumps({"text": "A man is playing a guitar."}).encode(), "application/json")
        strum = server.api.predict(b"Someone is strumming a guitar.", "text/plain")
        a, b = (np.asarray(x.json()["embedding"]) for x in (guitar, strum))
        assert abs(float(a @ b) - 0.72) < 0.02          # stack.md's sanity figure, through HTTP
