"""The text tasks' adapters (handlers/tasks/classification.py, task_rerank.py, task_tokens.py) and
the fan-out of handlers/serving.py, run on tiny eager models in-process, against transformers'
own pipelines: labels, order, entity words and offsets exactly, scores within 0.01."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from handlers.tasks import RequestError, make_adapter
from pipeline.core.params import parse_params
from pipeline.model.checkpoint import load_model
from tests.handlers.text_task_models import (CLASSIFY_TEXTS, DOCUMENTS, NER_TEXTS, QUERY, eager_rerank,
                                             make_models, pipeline_of, same_answers)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("text_tasks"))


@pytest.fixture(scope="module")
def loaded(models):
    out = {}
    for task, folder in models.items():
        params = parse_params({"model": {"name": "t", "source": "hf", "checkpoint": str(folder), "task": task,
                                         "text": {"max_length": 64, "max_texts": 12}},
                               "serve_check": {"rerank_texts": 12},
                               "variants": ["eager"], "benchmark": {"batch_sizes": [1, 4]}})
        lm = load_model(params)
        out[task] = (lm, make_adapter(folder, lm.task))
    return out


def answer(loaded, task, body, ct="application/json", rows_per_call: int = 4):
    """What the serving handler does: decode, fan rows out in calls of `rows_per_call`, gather, respond."""
    lm, adapter = loaded[task]
    if not isinstance(body, (bytes, str)):
        body = json.dumps(body).encode()
    decoded = adapter.decode_request(body, ct)
    outs = []
    for s in range(0, len(decoded.rows), rows_per_call):
        feeds = adapter.collate(decoded.rows[s:s + rows_per_call])
        with torch.no_grad():
            logits = lm.module(*lm.example_inputs(feeds)).numpy()
        outs += [[logits[j]] for j in range(logits.shape[0])]
    return adapter.respond_request(outs, decoded.meta)


def test_text_classification_equals_transformers_pipeline(models, loaded):
    pipe = pipeline_of("text-classification", models["text-classification"])
    for text in CLASSIFY_TEXTS:
        assert same_answers(answer(loaded, "text-classification", text.encode(), "text/plain"), pipe(text)) == []
        for top_k, fn in ((None, None), (2, "sigmoid"), (3, "none")):
            params = {"top_k": top_k} | ({"function_to_apply": fn} if fn else {})
            want = pipe(text, top_k=top_k, **({"function_to_apply": fn} if fn else {}))
            # Hugging Face's body (InferenceClient's): one list per input, as its Inference API answers
            got = answer(loaded, "text-classification", {"inputs": text, "parameters": params})
            assert same_answers(got, [want]) == [] and isinstance(got[0], list)
            # today's flat pipeline answer for one text with parameters: `inputs` as {"text": ...}
            flat = answer(loaded, "text-classification", {"inputs": {"text": text}, "parameters": params})
            assert same_answers(flat, want) == [] and isinstance(flat[0], dict)
    pair = {"text": CLASSIFY_TEXTS[0], "text_pair": CLASSIFY_TEXTS[1]}
    got = answer(loaded, "text-classification", {"inputs": pair, "parameters": {"top_k": None}})
    assert same_answers(got, pipe(pair, top_k=None)) == []
    # the pair's segment ids reach the model: swapping the texts changes the answer
    swapped = answer(loaded, "text-classification", {"inputs": {"text": pair["text_pair"], "text_pair": pair["text"]},
                                                     "parameters": {"top_k": None}})
    assert swapped != got
    many = answer(loaded, "text-classification", {"inputs": CLASSIFY_TEXTS + [pair]})
    assert len(many) == 5 and same_answers(many, [pipe(t) for t in CLASSIFY_TEXTS] + [[pipe(pair)]]) == []


def test_pairs_truncate_the_longer_side_as_transformers_does(loaded, models):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(models["text-classification"]))
    _, adapter = loaded["text-classification"]
    short, long = "a man is playing", " ".join(["guitar music"] * 60)
    row = adapter.decode_request(json.dumps({"inputs": {"text": long, "text_pair": short}}), "application/json").rows[0]
    want = tok(long, short, truncation="longest_first", max_length=64)
    assert row["input_ids"].tolist() == want["input_ids"] and row["token_type_ids"].tolist() == want["token_type_ids"]
    _, rerank = loaded["rerank"]
    row = rerank.decode_request(json.dumps({"query": short, "texts": [long]}), "application/json").rows[0]
    assert row["input_ids"].tolist() == tok(short, long, truncation="only_second", max_length=64)["input_ids"]
    assert "token_type_ids" not in row                  # DistilBERT takes none


def test_rerank_is_the_sigmoid_of_eager_logits_in_order(models, loaded):
    want = eager_rerank(models["rerank"], QUERY, DOCUMENTS)
    got = answer(loaded, "rerank", {"query": QUERY, "texts": DOCUMENTS}, rows_per_call=3)   # 10 rows, 4 calls
    assert [g["index"] for g in got] == [w["index"] for w in want]
    assert max(abs(g["score"] - w["score"]) for g, w in zip(got, want)) < 1e-4
    top = answer(loaded, "rerank", {"query": QUERY, "texts": DOCUMENTS, "top_n": 3, "return_text": True,
                                    "raw_scores": True})
    assert [t["index"] for t in top] == [w["index"] for w in want[:3]]
    assert [t["text"] for t in top] == [DOCUMENTS[w["index"]] for w in want[:3]]
    assert top[0]["score"] > 1.0 or top[0]["score"] < 0.0 or abs(top[0]["score"] - want[0]["score"]) > 1e-3


@pytest.mark.parametrize("strategy", ["none", "simple", "first", "average", "max"])
def test_token_classification_equals_transformers_pipeline(models, loaded, strategy):
    pipe = pipeline_of("token-classification", models["token-classification"])
    for text in NER_TEXTS:
        got = answer(loaded, "token-classification", {"inputs": text, "parameters": {"aggregation_strategy": strategy}})
        want = pipe(text, aggregation_strategy=strategy)
        assert same_answers(got, want) == [], text
        assert all(text[e["start"]:e["end"]] for e in got)
    assert any(len(e["word"].split()) > 1 or "##" in e["word"] for t in NER_TEXTS
               for e in answer(loaded, "token-classification", {"inputs": t, "parameters": {"aggregation_strategy": strategy}})) \
        or strategy == "none"


BAD = [
    ("rerank", {"texts": ["a"]}, 400, "`query` is missing"),
    ("rerank", {"query": "q", "texts": []}, 400, "`texts` is an empty list"),
    ("rerank", {"query": "q", "texts": ["a", 3]}, 400, "texts[1] must be a string"),
    ("rerank", {"query": "q", "texts": ["a"] * 13}, 413, "cap of 12"),
    ("rerank", {"query": "q", "texts": ["a"], "top_n": 0}, 400, "top_n"),
    ("rerank", {"query": " ".join(["guitar"] * 80), "texts": ["a"]}, 413, "64 tokens"),
    ("text-classification", {"inputs": []}, 400, "empty list"),
    ("text-classification", {"inputs": "x", "parameters": {"function_to_apply": "relu"}}, 400, "function_to_apply"),
    ("text-classification", {"inputs": "x", "parameters": {"topk": 2}}, 400, "unknown parameter"),
    ("text-classification", {"text": "x"}, 400, "unknown key"),
    ("token-classification", {"inputs": " ".join(["guitar"] * 80)}, 413, "over the model's limit of 64"),
    ("token-classification", {"inputs": "x", "parameters": {"aggregation_strategy": "mean"}}, 400, "aggregation_strategy"),
    ("token-classification", {"inputs": 5}, 400, "inputs must be a string"),
]


@pytest.mark.parametrize("task,body,status,message", BAD)
def test_bad_inputs_are_named(loaded, task, body, status, message):
    _, adapter = loaded[task]
    with pytest.raises(RequestError) as e:
        adapter.decode_request(json.dumps(body).encode(), "application/json")
    assert e.value.status == status and message in e.value.message, e.value.message


def test_text_embedding_takes_a_list_of_texts(text_params):
    lm = load_model(text_params)
    from pipeline.model.golden import write_golden  # noqa: F401  (same adapter as the golden set)
    adapter = make_adapter(text_params.model.checkpoint, lm.task)
    decoded = adapter.decode_request(json.dumps({"inputs": ["hello world", "a man is playing a guitar"]}),
                                     "application/json")
    feeds = adapter.collate(decoded.rows)
    with torch.no_grad():
        emb = lm.module(*lm.example_inputs(feeds)).numpy()
    got = adapter.respond_request([[e] for e in emb], decoded.meta)
    one = adapter.decode_request(b"hello world", "text/plain")
    with torch.no_grad():
        single = lm.module(*lm.example_inputs(adapter.collate(one.rows))).numpy()[0]
    assert len(got) == 2 and np.allclose(got[0], single, atol=1e-5)
    assert adapter.respond_request([[single]], one.meta) == {"embedding": single.tolist()}


def test_rerank_examples_are_a_realistic_load_and_feed_the_benchmark_served_rows(models):
    """Issue 26: the golden set / tune load is 10-50 passages of 30-80 words per 5-15-word query, and the
    benchmark's offline feeds are those rows (query-passage pairs, padded to the batch's longest)."""
    adapter = make_adapter(models["rerank"], {"kind": "rerank", "max_length": 128, "max_texts": 64})
    docs = [json.loads(body) for body, _ in adapter.example_requests(40)]
    assert all(10 <= len(d["texts"]) <= 50 for d in docs) and len({len(d["texts"]) for d in docs}) > 5
    assert all(5 <= len(d["query"].split()) <= 15 for d in docs)
    assert all(30 <= len(t.split()) <= 80 for d in docs for t in d["texts"])
    assert {len(json.loads(b)["texts"]) for b, _ in adapter.example_requests(5, seed=3, texts=20)} == {20}
    # Benchmark feeds: the first rows of the example requests, exactly as the handler collates them.
    first = adapter.decode_request(adapter.example_requests(1)[0][0], "application/json").rows
    feeds = adapter.example_feeds(8)
    want = adapter.collate(first[:8])
    assert all(np.array_equal(feeds[k], want[k]) for k in want)
    tokens = feeds["attention_mask"].sum(axis=1)
    assert tokens.min() >= 35 and feeds["input_ids"].shape[1] == tokens.max()   # a pair, not a 16-token sentence
    assert adapter.example_feeds(4, seq_len=24)["input_ids"].shape == (4, 24)     # synthetic when asked
    # More rows than one request holds: the next request's rows follow.
    assert adapter.example_feeds(70)["input_ids"].shape[0] == 70


def test_int8_calibration_rows_fan_rerank_requests_out_one_query_per_group(models, loaded):
    """int8 calibration takes model rows, not requests: a rerank request of 10-50 texts gave 'this request
    makes 50 rows' and every int8 variant of a reranker failed to build."""
    from pipeline.accuracy.task_gate_text import RERANK_GROUP
    from pipeline.build.variants.int8.shared import calibration_rows
    adapter = make_adapter(models["rerank"], {"kind": "rerank", "max_length": 128, "max_texts": 64})
    requests = adapter.example_requests(64, seed=7919)
    rows = calibration_rows(adapter, requests, 64)
    assert len(rows) == 70 and all(set(r) >= {"input_ids", "attention_mask"} for r in rows)
    first = adapter.decode_request(*requests[1]).rows[:RERANK_GROUP]
    assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(rows[RERANK_GROUP:], first))
    one_row = loaded["text-classification"][1]
    assert len(calibration_rows(one_row, one_row.example_requests(64, seed=1), 64)) == 64
