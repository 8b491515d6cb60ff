"""The packed model in a REAL Ray Serve (`serve run` of the Serve config the archive stage writes, a local Ray on
loopback, always stopped), reached through the clients' own SDKs, unchanged: `openai.OpenAI(...).embeddings.create`
(float and base64), `huggingface_hub.InferenceClient(...).feature_extraction`, TEI's `/embed` and `/rerank` bodies.
Every answer equals sentence-transformers' (cosine >= 0.999; CrossEncoder scores within 0.01, same order), on
tiny Qwen3-shaped models built from seeds no other test uses. Under concurrent clients, bad requests get their
own 4xx naming the problem while their batch-mates are answered; a route of another task is a 404 naming the
model's routes."""
from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.model.test_decoder_embedding import DOCUMENTS, QUERY, TEXTS, sentence_transformer

pytestmark = pytest.mark.ray_serve

MORE = ["the market fell sharply today", "where is the train station near the forest and the ocean"]


def _params(folder, task: str, name: str, text: dict):
    from pipeline.core.params import parse_params
    return parse_params({"model": {"name": name, "source": "hf", "checkpoint": str(folder), "task": task,
                                   "text": text}, "variants": ["eager"], "benchmark": {"batch_sizes": [1, 4]},
                         "conversion": {"golden_batches": 2}})


def _ray_serve(root, folder, task, name, text):
    from pipeline.serve.variant_server import ray_serve_of, serve_variant
    params = _params(folder, task, name, text)
    served = serve_variant(params, root, settings={"batch_size": 8, "max_batch_delay_ms": 50})
    return ray_serve_of(served, params, root)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    from scripts.make_decoder_model import build
    root = tmp_path_factory.mktemp("ray_embedder")
    folder = build(root / "model", seed=21)
    with _ray_serve(root, folder, "text-embedding", "tiny-qwen3-ray", {"max_length": 96, "max_texts": 8}) as rs:
        yield rs, sentence_transformer(folder), folder


@pytest.fixture
def online(monkeypatch):
    """The test suite runs with HF_HUB_OFFLINE=1, under which huggingface_hub refuses every URL, even this
    loopback server's: lifted for the client call only."""
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_openai_sdk_float_and_base64_equal_sentence_transformers(embedder):
    import openai
    rs, st, _ = embedder
    texts = TEXTS + MORE
    want = st.encode(texts, batch_size=1)
    client = openai.OpenAI(base_url=rs.api.base_url + "/v1", api_key="unused", max_retries=0)
    floats = client.embeddings.create(input=texts[:8], model="tiny-qwen3-ray", encoding_format="float")
    packed = client.embeddings.create(input=texts[:8], model="tiny-qwen3-ray")    # the SDK asks for base64
    one = client.embeddings.create(input=texts[0], model="tiny-qwen3-ray")
    assert [d.index for d in floats.data] == list(range(8))
    for got in (floats, packed):
        for d, w in zip(got.data, want):
            assert _cos(d.embedding, w) >= 0.999
    assert _cos(one.data[0].embedding, want[0]) >= 0.999
    tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in texts[:8])
    assert floats.usage.prompt_tokens == tokens and floats.model == "tiny-qwen3-ray"
    # The raw base64 answer is little-endian float32 of the same vector.
    raw = rs.api.request("POST", "/v1/embeddings", json.dumps({"input": texts[1], "encoding_format": "base64"}).encode(),
                         "application/json").json()
    assert _cos(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4"), want[1]) >= 0.999
    with pytest.raises(openai.BadRequestError, match="prompts|token arrays"):
        client.embeddings.create(input=[[1, 2, 3]], model="tiny-qwen3-ray")
    short = client.embeddings.create(input=texts[1], model="m", dimensions=16, encoding_format="float").data[0].embedding
    assert len(short) == 16 and abs(np.linalg.norm(short) - 1) < 1e-3 and _cos(short, want[1][:16]) >= 0.999


def test_inference_client_and_tei_embed_equal_sentence_transformers(embedder, online):
    from huggingface_hub import InferenceClient
    rs, st, _ = embedder
    got = InferenceClient(base_url=rs.api.base_url).feature_extraction(MORE[0])
    assert _cos(np.asarray(got).reshape(-1), st.encode([MORE[0]])[0]) >= 0.999
    queries = st.encode(TEXTS, batch_size=1, prompt_name="query")
    answer = rs.api.request("POST", "/embed", json.dumps({"inputs": TEXTS, "prompt_name": "query"}).encode(),
                            "application/json")
    assert answer.status == 200
    for v, w in zip(answer.json(), queries):
        assert abs(np.linalg.norm(v) - 1) < 1e-3 and _cos(v, w) >= 0.999


def test_bad_requests_fail_alone_under_concurrent_clients(embedder):
    rs, st, _ = embedder
    texts = TEXTS + MORE
    want = st.encode(texts, batch_size=1)
    good = [("/embed", {"inputs": [t]}) for t in texts] + [("/v1/embeddings", {"input": t, "encoding_format": "float"})
                                                        for t in texts]
    bad = [("/embed", {"inputs": ["a"], "prompt_name": "passage"}, 400, "document, query"),
           ("/embed", {"inputs": [" ".join(["river"] * 200)]}, 413, "limit of 96"),
           ("/v1/embeddings", {"input": "a", "encoding": "float"}, 400, "encoding"),
           ("/embed", {"inputs": ["a"] * 9}, 413, "cap of 8"),
           ("/rerank", {"query": "a", "texts": ["b"]}, 404, "/v1/embeddings")]
    calls = [(route, body) for route, body in good[:5]] + [(r, b) for r, b, _, _ in bad] + good[5:]

    def post(call):
        route, body = call
        r = rs.api.request("POST", route, json.dumps(body).encode(), "application/json")
        return r.status, r.json()

    with ThreadPoolExecutor(8) as clients:
        answers = list(clients.map(post, calls * 2))
    for k in range(2):
        batch = answers[k * len(calls):(k + 1) * len(calls)]
        for (status, body), (_, _, want_status, words) in zip(batch[5:5 + len(bad)], bad):
            text = json.dumps(body)
            assert status == want_status and words in text, (status, body)
        for (status, body), ((route, _), w) in zip(batch[:5] + batch[5 + len(bad):], list(zip(good, list(want) * 2))):
            assert status == 200, body
            vector = body[0] if route == "/embed" else body["data"][0]["embedding"]
            assert _cos(vector, w) >= 0.999
    assert rs.api.predict(b"still alive", "text/plain").status == 200


def test_tei_rerank_equals_cross_encoder(tmp_path):
    import torch
    from sentence_transformers import CrossEncoder
    from scripts.make_decoder_model import build_reranker
    folder = build_reranker(tmp_path / "model", seed=23)
    ce = CrossEncoder(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    queries = [QUERY, "what happened on the market today"]
    want = {q: ce.predict([(q, d) for d in DOCUMENTS], batch_size=1) for q in queries}
    with _ray_serve(tmp_path, folder, "rerank", "tiny-qwen3-rerank-ray", {"max_length": 64, "max_texts": 8}) as rs:
        def post(q):
            r = rs.api.request("POST", "/rerank", json.dumps({"query": q, "texts": DOCUMENTS, "return_text": True})
                               .encode(), "application/json")
            return r.status, r.json()
        with ThreadPoolExecutor(4) as clients:
            answers = list(clients.map(post, queries * 3))
        wrong = rs.api.request("POST", "/v1/embeddings", b'{"input": "a"}', "application/json")
        empty = rs.api.request("POST", "/rerank", b'{"query": "a", "texts": []}', "application/json")
    for (status, body), q in zip(answers, queries * 3):
        assert status == 200, body
        assert [b["index"] for b in body] == list(np.argsort(-want[q], kind="stable"))
        assert max(abs(b["score"] - float(want[q][b["index"]])) for b in body) < 0.01
        assert all(b["text"] == DOCUMENTS[b["index"]] for b in body)
    assert wrong.status == 404 and "/rerank" in wrong.json()["error"]
    assert empty.status == 400 and "empty" in empty.json()["error"] and empty.json()["error_type"] == "Validation"
