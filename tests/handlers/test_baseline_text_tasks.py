"""The naive baseline (handlers/baseline_handler.py) on every text task, packed by the archive stage
(`write_baseline` + `build_reference`, as serve_check packs it) and run by TorchServe's own model loader with the repo off sys.path: requests that
make many model rows (a rerank query, a list of texts to embed or classify) are answered whole, in
the clients' formats, equal to transformers' own pipelines on the same model (labels, order, entity
words and offsets exactly, scores within 0.01); bad requests get their 4xx beside them."""
from __future__ import annotations

import json

import numpy as np
import pytest

from handlers.tasks import make_adapter
from pipeline.model.checkpoint import load_model
from pipeline.serve.mar import archive_contents
from pipeline.serve.reference.reference_archives import build_reference, write_baseline
from tests.handlers.text_task_models import (CLASSIFY_TEXTS, DOCUMENTS, NER_TEXTS, QUERY, eager_rerank,
                                             make_models, pipeline_of, same_answers)
from tests.serve.test_archive import build_stage_inputs, load_and_predict, unpack

STRATEGIES = ("none", "simple", "first", "average", "max")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("baseline_text_models"), seed=3)


def baseline_answers(tmp_path, params, requests: list) -> dict:
    """Build the baseline .mar for `params`, unpack it and answer `requests` as ONE TorchServe batch."""
    inputs = build_stage_inputs(tmp_path / "artifacts", params)
    write_baseline(params, variants_dir=inputs["variants_dir"], baseline_dir=tmp_path / "baseline")
    mar = build_reference(tmp_path / "baseline", tmp_path / "scratch", params.model.name).mar
    assert "baseline_handler.py" in archive_contents(mar)
    wire = [(b if isinstance(b, str) else json.dumps(b), ct) for b, ct in requests]
    return load_and_predict(unpack(mar, tmp_path / "unpacked"), wire)


def text_task_params(make_params, task: str, folder):
    return make_params({"name": f"tiny-{task}", "source": "hf", "checkpoint": str(folder), "task": task,
                        "text": {"max_length": 64, "max_texts": 12}})


def test_baseline_text_classification(tmp_path, make_params, models):
    folder = models["text-classification"]
    pipe = pipeline_of("text-classification", folder)
    pair = {"text": CLASSIFY_TEXTS[0], "text_pair": CLASSIFY_TEXTS[1]}
    requests = [(CLASSIFY_TEXTS[0], "text/plain"),
                ({"inputs": CLASSIFY_TEXTS[1], "parameters": {"top_k": None}}, "application/json"),
                ({"inputs": [], "parameters": {}}, "application/json"),
                ({"inputs": CLASSIFY_TEXTS + [pair], "parameters": {"top_k": 2}}, "application/json"),
                ({"inputs": pair, "parameters": {"function_to_apply": "sigmoid", "top_k": 3}}, "application/json")]
    # A JSON string `inputs` answers one list per input (the Hugging Face Inference API's shape).
    want = [pipe(CLASSIFY_TEXTS[0]), [pipe(CLASSIFY_TEXTS[1], top_k=None)], None,
            [pipe(t, top_k=2) for t in CLASSIFY_TEXTS] + [pipe(pair, top_k=2)],
            pipe(pair, top_k=3, function_to_apply="sigmoid")]
    got = baseline_answers(tmp_path, text_task_params(make_params, "text-classification", folder), requests)
    assert got["status"] == [200, 200, 400, 200, 200], got
    assert "empty list" in got["out"][2]["error"]
    for answer, expected in zip(got["out"], want):
        if expected is not None:
            assert same_answers(answer, expected) == [], (answer, expected)


def test_baseline_rerank_answers_the_whole_query(tmp_path, make_params, models):
    folder = models["rerank"]
    want = eager_rerank(folder, QUERY, DOCUMENTS)
    requests = [({"query": QUERY, "texts": DOCUMENTS}, "application/json"),
                ({"texts": ["a"]}, "application/json"),
                ({"query": QUERY, "texts": DOCUMENTS[:4], "top_n": 2, "return_text": True}, "application/json"),
                ({"query": "q", "texts": ["a"] * 13}, "application/json")]
    got = baseline_answers(tmp_path, text_task_params(make_params, "rerank", folder), requests)
    assert got["status"] == [200, 400, 200, 413], got
    full, top = got["out"][0], got["out"][2]
    assert [g["index"] for g in full] == [w["index"] for w in want]
    assert max(abs(g["score"] - w["score"]) for g, w in zip(full, want)) < 0.01
    want4 = eager_rerank(folder, QUERY, DOCUMENTS[:4])[:2]
    assert [t["index"] for t in top] == [w["index"] for w in want4]
    assert [t["text"] for t in top] == [DOCUMENTS[w["index"]] for w in want4]
    assert "`query` is missing" in got["out"][1]["error"] and "cap of 12" in got["out"][3]["error"]


def test_baseline_token_classification(tmp_path, make_params, models):
    folder = models["token-classification"]
    pipe = pipeline_of("token-classification", folder)
    requests = [({"inputs": text, "parameters": {"aggregation_strategy": s}}, "application/json")
                for text, s in zip(NER_TEXTS, STRATEGIES)]
    requests.insert(1, ({"inputs": " ".join(["guitar"] * 80)}, "application/json"))
    requests.append((NER_TEXTS[0], "text/plain"))
    want = [pipe(text, aggregation_strategy=s) for text, s in zip(NER_TEXTS, STRATEGIES)]
    want.insert(1, None)
    want.append(pipe(NER_TEXTS[0], aggregation_strategy="simple"))
    got = baseline_answers(tmp_path, text_task_params(make_params, "token-classification", folder), requests)
    assert got["status"] == [200, 413] + [200] * (len(requests) - 2), got
    assert "over the model's limit of 64" in got["out"][1]["error"]
    for answer, expected, (req, _) in zip(got["out"], want, requests):
        if expected is not None:
            assert same_answers(answer, expected) == [], (req, answer, expected)


def test_baseline_text_embedding_list_input(tmp_path, text_params):
    texts = ["hello world", "a man is playing a guitar", "the stock market fell sharply today"]
    requests = [({"inputs": texts}, "application/json"), (texts[1], "text/plain"),
                ({"inputs": ["ok", 5]}, "application/json"), ({"text": texts[2]}, "application/json")]
    got = baseline_answers(tmp_path, text_params, requests)
    assert got["status"] == [200, 200, 400, 200], got
    lm = load_model(text_params)
    adapter = make_adapter(text_params.model.checkpoint, lm.task)
    import torch
    decoded = adapter.decode_request(json.dumps({"inputs": texts}), "application/json")
    with torch.no_grad():
        want = lm.module(*lm.example_inputs(adapter.collate(decoded.rows))).numpy()
    many = got["out"][0]
    assert isinstance(many, list) and len(many) == 3
    np.testing.assert_allclose(np.asarray(many), want, atol=1e-5)
    np.testing.assert_allclose(got["out"][1]["embedding"], want[1], atol=1e-5)
    np.testing.assert_allclose(got["out"][3]["embedding"], want[2], atol=1e-5)
    assert "inputs[1] must be a string" in got["out"][2]["error"]
