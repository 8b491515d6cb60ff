"""Today's embedding and rerank architectures in a REAL TorchServe, built by the pipeline's own steps,
against sentence-transformers (weights no other test uses): a ModernBERT embedder past its sliding
window; a Qwen3-style decoder reranker, scores equal to `CrossEncoder.predict` within 0.01 in the same
order; a Qwen3-Embedding-shaped folder (scripts/make_decoder_model.py): under 8 concurrent clients, documents of mixed
lengths and `prompt_name` queries share batches (left-padded), and every served vector equals
`SentenceTransformer(folder).encode` in fp32 (cosine >= 0.999, unit norm within 1e-3); an unknown
prompt name, an over-long text and a misspelt option get a 4xx naming the problem, their batch-mates
are answered, the worker stays up. Both eager and the ONNX export."""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from scripts.make_decoder_model import build
from tests.model.test_decoder_embedding import TEXTS, sentence_transformer

pytestmark = [pytest.mark.torchserve,
              pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")]

MORE = ["the market fell sharply today", "a small red bird sings in the morning while the old farmer walks "
        "slowly across the garden", "why", "where is the train station near the forest and the ocean"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("served_qwen3") / "model", seed=11)


@pytest.mark.parametrize("variant", ["eager", "onnx"])
def test_served_vectors_equal_sentence_transformers_under_concurrent_load(tmp_path, folder, variant):
    from pipeline.core.params import parse_params
    from pipeline.serve.variant_server import serve_variant
    params = parse_params({"model": {"name": "tiny-qwen3-embedding", "source": "hf", "checkpoint": str(folder),
                                     "task": "text-embedding", "text": {"max_length": 96, "max_texts": 8}},
                           "variants": sorted({"eager", variant}), "benchmark": {"batch_sizes": [1, 4]},
                           "conversion": {"golden_batches": 2}})
    served = serve_variant(params, tmp_path, variant=variant,
                           settings={"batch_size": 8, "max_batch_delay_ms": 100})
    st = sentence_transformer(folder)
    texts = TEXTS + MORE
    want = {("doc", t): v for t, v in zip(texts, st.encode(texts, batch_size=1))}
    want.update({("query", t): v for t, v in zip(texts, st.encode(texts, batch_size=1, prompt_name="query"))})
    good = [(("doc", t), {"text": t}) for t in texts] + [(("query", t), {"text": t, "prompt_name": "query"})
                                                         for t in texts]
    bad = [({"text": "a", "prompt_name": "passage"}, 400, "document, query"),
           ({"text": " ".join(["river"] * 200)}, 413, "limit of 96"),
           ({"text": "a", "truncation": True}, 400, "truncation")]
    requests = [body for _, body in good[:6]] + [b for b, _, _ in bad] + [body for _, body in good[6:]]

    def post(body):
        r = ts.api.predict(json.dumps(body).encode(), "application/json")
        return r.status, r.json()

    with served.ts as ts:
        with ThreadPoolExecutor(8) as clients:
            answers = list(clients.map(post, requests * 2))
        many = ts.api.predict(json.dumps({"inputs": texts[:8]}).encode(), "application/json").json()
        alive = ts.api.predict(b"still alive", "text/plain").status
    n_bad = len(bad)
    for k in range(2):
        batch = answers[k * len(requests):(k + 1) * len(requests)]
        got_bad = batch[6:6 + n_bad]
        got_good = batch[:6] + batch[6 + n_bad:]
        for (status, body), (_, want_status, words) in zip(got_bad, bad):
            assert status == want_status and words in body["error"], (status, body)
        for (status, body), (key, _) in zip(got_good, good):
            assert status == 200, body
            vector = np.asarray(body["embedding"])
            assert abs(np.linalg.norm(vector) - 1.0) <= 1e-3
            assert float(vector @ want[key]) >= 0.999, (variant, key)
    for vector, t in zip(many, texts[:8]):
        assert float(np.asarray(vector) @ want[("doc", t)]) >= 0.999
    assert alive == 200


def _serve(tmp_path, folder, task: str, name: str, text: dict):
    from pipeline.core.params import parse_params
    from pipeline.serve.variant_server import serve_variant
    params = parse_params({"model": {"name": name, "source": "hf", "checkpoint": str(folder), "task": task,
                                     "text": text}, "variants": ["eager"], "benchmark": {"batch_sizes": [1, 4]},
                           "conversion": {"golden_batches": 2}})
    return serve_variant(params, tmp_path, settings={"batch_size": 8, "max_batch_delay_ms": 100})


def _post_all(ts, bodies: list) -> list:
    def post(body):
        r = ts.api.predict(json.dumps(body).encode(), "application/json")
        return r.status, r.json()
    with ThreadPoolExecutor(8) as clients:
        return list(clients.map(post, bodies))


def test_served_modernbert_equals_sentence_transformers_past_its_window(tmp_path):
    from scripts.make_modernbert_model import build as build_modernbert
    from tests.model.test_decoder_embedding import MODERN_TEXTS
    folder = build_modernbert(tmp_path / "model", seed=12)
    st = sentence_transformer(folder)
    want = st.encode(MODERN_TEXTS, batch_size=1)
    served = _serve(tmp_path, folder, "text-embedding", "tiny-modernbert", {"max_length": 128})
    with served.ts as ts:
        answers = _post_all(ts, [{"text": t} for t in MODERN_TEXTS] * 2)
    for (status, body), w in zip(answers, list(want) * 2):
        assert status == 200 and float(np.asarray(body["embedding"]) @ w) >= 0.999


def test_served_decoder_reranker_equals_cross_encoder(tmp_path):
    import torch
    from sentence_transformers import CrossEncoder
    from scripts.make_decoder_model import build_reranker
    from tests.model.test_decoder_embedding import DOCUMENTS, QUERY
    folder = build_reranker(tmp_path / "model", seed=13)
    ce = CrossEncoder(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    queries = [QUERY, "what happened on the market today"]
    want = {q: ce.predict([(q, d) for d in DOCUMENTS], batch_size=1) for q in queries}
    served = _serve(tmp_path, folder, "rerank", "tiny-qwen3-reranker", {"max_length": 64, "max_texts": 8})
    with served.ts as ts:
        answers = _post_all(ts, [{"query": q, "texts": DOCUMENTS} for q in queries] * 3)
    for (status, body), q in zip(answers, queries * 3):
        assert status == 200, body
        assert [b["index"] for b in body] == list(np.argsort(-want[q], kind="stable"))
        assert max(abs(b["score"] - float(want[q][b["index"]])) for b in body) < 0.01


def test_served_include_prompt_false_equals_sentence_transformers_through_onnx(tmp_path, folder):
    """An INSTRUCTOR-style folder (mean pooling, include_prompt false): the exported graph takes the
    pooling mask as its third input; prompted and plain texts batched together, left-padded."""
    from pipeline.core.params import parse_params
    from pipeline.serve.variant_server import serve_variant
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                 "pooling_mode_mean_tokens": True,
                                                                 "include_prompt": False}))
    params = parse_params({"model": {"name": "tiny-instructor", "source": "hf", "checkpoint": str(copy),
                                     "task": "text-embedding", "text": {"max_length": 96, "max_texts": 8}},
                           "variants": ["eager", "onnx"], "benchmark": {"batch_sizes": [1, 4]},
                           "conversion": {"golden_batches": 2}})
    served = serve_variant(params, tmp_path / "work", variant="onnx",
                           settings={"batch_size": 8, "max_batch_delay_ms": 100})
    st = sentence_transformer(copy)
    texts = TEXTS + MORE
    bodies = [{"text": t, "prompt_name": "query"} for t in texts] + [{"text": t} for t in texts]
    want = [*st.encode(texts, batch_size=1, prompt_name="query"), *st.encode(texts, batch_size=1)]
    with served.ts as ts:
        answers = _post_all(ts, bodies * 2)
    for (status, body), w in zip(answers, want * 2):
        assert status == 200, body
        assert float(np.asarray(body["embedding"]) @ w) >= 0.999
