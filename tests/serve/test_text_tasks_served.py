"""The text tasks in a REAL TorchServe 0.12: tiny models (MiniLM's real tokenizer) built by the
pipeline's own steps (golden set, eager variant verified, archive with the torch handler), served,
and their HTTP answers compared with transformers' pipelines on the eager model: labels, order,
entity words and character offsets exactly, scores within 0.01; rerank = sigmoid of eager's logits
in order. Requests go concurrently so batches mix valid and bad requests: the bad ones get a 4xx
naming the problem, their batch-mates are answered, the worker stays up."""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.handlers.text_task_models import (CLASSIFY_TEXTS, DOCUMENTS, NER_TEXTS, QUERY, eager_rerank,
                                             make_models, max_score_diff, pipeline_of, same_answers)

pytestmark = [pytest.mark.torchserve,
              pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")]

SERVED = {"batch_size": 4, "max_batch_delay_ms": 50, "workers": 1, "threads_per_worker": 1,
          "response_timeout_s": 30, "startup_timeout_s": 60, "job_queue_size": 200,
          "max_request_size": 200000, "max_response_size": 2000000, "max_request_bytes": 200000, "device": "cpu"}
FIGURES: dict = {}


def serve_task(root: Path, task: str, folder: Path):
    """Build golden + eager variant + .mar for `task` with the pipeline's code; a started TorchServe."""
    from pipeline.core.params import parse_params
    from pipeline.serve.variant_server import serve_variant

    params = parse_params({"model": {"name": f"tiny-{task}", "source": "hf", "checkpoint": str(folder), "task": task,
                                     "text": {"max_length": 64, "max_texts": 12}},
                           "serve_check": {"rerank_texts": 12},
                           "variants": ["eager"], "benchmark": {"batch_sizes": [1, 4]},
                           "conversion": {"golden_batches": 2}})
    served = serve_variant(params, root, settings=SERVED)
    return served.ts, served.golden


def post_all(ts, requests: list) -> list:
    """All requests at once (4 clients): TorchServe batches them."""
    def one(item):
        body, ct = item
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = ts.api.predict(data, ct)
        return r.status, r.json()
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, requests))


def check_bad(answers: list, expected: list) -> None:
    for (status, body), (want_status, words) in zip(answers, expected):
        assert status == want_status and words in body["error"], (status, body)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("served_text_models"), seed=7)   # weights no other test used


def test_text_classification_served_equals_transformers(tmp_path, models):
    pipe = pipeline_of("text-classification", models["text-classification"])
    ts, golden = serve_task(tmp_path, "text-classification", models["text-classification"])
    pair = {"text": CLASSIFY_TEXTS[0], "text_pair": CLASSIFY_TEXTS[2]}
    good = [(t.encode(), "text/plain") for t in CLASSIFY_TEXTS] + \
           [({"inputs": t, "parameters": {"top_k": None}}, "application/json") for t in CLASSIFY_TEXTS] + \
           [({"inputs": pair, "parameters": {"top_k": 2}}, "application/json"),
            ({"inputs": CLASSIFY_TEXTS}, "application/json")]
    want = [pipe(t) for t in CLASSIFY_TEXTS] + [[pipe(t, top_k=None)] for t in CLASSIFY_TEXTS] + \
           [pipe(pair, top_k=2), [pipe(t) for t in CLASSIFY_TEXTS]]
    bad = [({"inputs": []}, "application/json"), ({"inputs": "x", "parameters": {"function_to_apply": "relu"}},
                                                   "application/json"), (b"", "text/plain")]
    with ts:
        answers = post_all(ts, good[:6] + bad[:1] + good[6:] + bad[1:])
        got = answers[:6] + answers[7:7 + len(good) - 6]
        check_bad([answers[6]] + answers[-2:], [(400, "empty list"), (400, "function_to_apply"), (400, "empty")])
        for (status, body), w in zip(got, want):
            assert status == 200 and same_answers(body, w) == [], (body, w)
        cases = golden.http_cases
        served_cases = post_all(ts, [(c["body"].encode(), c["content_type"]) for c in cases])
        assert all(s == 200 and same_answers(b, c["expected"], 1e-4) == [] for (s, b), c in zip(served_cases, cases))
        assert ts.api.predict(b"still alive", "text/plain").status == 200
    FIGURES["text-classification"] = max(max_score_diff(b, w) for (_, b), w in zip(got, want))


def test_rerank_served_is_the_sigmoid_of_eager_logits(tmp_path, models):
    ts, _ = serve_task(tmp_path, "rerank", models["rerank"])
    want = eager_rerank(models["rerank"], QUERY, DOCUMENTS)
    queries = [({"query": QUERY, "texts": DOCUMENTS}, "application/json")] * 4 + \
              [({"query": QUERY, "texts": DOCUMENTS, "top_n": 3, "return_text": True}, "application/json")]
    bad = [({"texts": ["a"]}, "application/json"), ({"query": "q", "texts": ["a", 3]}, "application/json"),
           ({"query": "q", "texts": ["a"] * 13}, "application/json")]
    with ts:
        answers = post_all(ts, queries[:2] + bad + queries[2:])
        check_bad(answers[2:5], [(400, "`query` is missing"), (400, "texts[1] must be a string"), (413, "cap of 12")])
        served = answers[:2] + answers[5:]
        for status, body in served[:4]:
            assert status == 200 and [b["index"] for b in body] == [w["index"] for w in want]
            assert max(abs(b["score"] - w["score"]) for b, w in zip(body, want)) < 0.01
        status, top = served[4]
        assert [t["index"] for t in top] == [w["index"] for w in want[:3]]
        assert [t["text"] for t in top] == [DOCUMENTS[w["index"]] for w in want[:3]]
    FIGURES["rerank"] = max(abs(b["score"] - w["score"]) for _, body in served[:4] for b, w in zip(body, want))


def test_token_classification_served_equals_transformers(tmp_path, models):
    pipe = pipeline_of("token-classification", models["token-classification"])
    ts, _ = serve_task(tmp_path, "token-classification", models["token-classification"])
    strategies = ("none", "simple", "first", "average", "max")
    good = [({"inputs": t, "parameters": {"aggregation_strategy": s}}, "application/json")
            for t in NER_TEXTS for s in strategies]
    want = [pipe(t, aggregation_strategy=s) for t in NER_TEXTS for s in strategies]
    bad = [({"inputs": " ".join(["guitar"] * 80)}, "application/json"), ({"inputs": 5}, "application/json")]
    with ts:
        answers = post_all(ts, good[:7] + bad + good[7:])
        check_bad(answers[7:9], [(413, "over the model's limit of 64"), (400, "inputs must be a string")])
        served = answers[:7] + answers[9:]
        for (status, body), w, (req, _) in zip(served, want, good):
            assert status == 200 and same_answers(body, w) == [], (req, body, w)
    FIGURES["token-classification"] = max(max_score_diff(b, w) for (_, b), w in zip(served, want))
    print("served-vs-transformers max score differences:", FIGURES)
