"""A Qwen3-Embedding-shaped folder (decoder backbone, byte-level BPE appending <|endoftext|>, LEFT
padding with pad = eos at the vocabulary's end, last-token pooling, a query prompt, bf16 weights)
read as sentence-transformers reads it, its vectors equal to `SentenceTransformer(folder).encode` in
fp32 — batched with mixed lengths, with and without `prompt_name` — and every pooling mode equal to
sentence-transformers' own Pooling module on either padding side. sentence-transformers is the oracle."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from handlers.pooling import MODES, pool
from handlers.tasks import RequestError, make_adapter
from pipeline.model.checkpoint import CheckpointError, load_model
from pipeline.model.sentence_folder import read_sentence_folder
from scripts.make_decoder_model import QUERY_PROMPT, SPECIALS, build

TEXTS = ["a", "the river runs near the quiet city", "Who plays the guitar?",
         "yesterday the teacher reads a story to every child in the garden because it is so bright",
         "Ünïcödé café 東京 😀", "dog"]


def sentence_transformer(folder: Path, max_seq_length: int | None = None):
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length
    return model.float()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("qwen3_embedder") / "model", seed=3)


@pytest.fixture(scope="module")
def loaded(folder, make_params):
    params = make_params({"name": "tiny-qwen3-embedding", "source": "hf", "checkpoint": str(folder),
                          "task": "text-embedding", "text": {"max_length": 64}})
    return load_model(params)


def embed(loaded, folder: Path, requests: list) -> list[np.ndarray]:
    """The served computation in-process: the handler's adapter decodes and batches (left padding),
    the loaded task module computes, the adapter answers."""
    adapter = make_adapter(folder, loaded.task)
    decoded = [adapter.decode_request(body, "application/json") for body in requests]
    rows = [row for d in decoded for row in d.rows]
    feeds = adapter.collate(rows)
    with torch.inference_mode():
        out = loaded.module(*(torch.as_tensor(feeds[i.name]) for i in loaded.inputs)).numpy()
    return [adapter.vector([out], i) for i in range(len(rows))]


def test_folder_read_as_sentence_transformers_reads_it(folder, loaded):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    task = loaded.task
    assert task["pooling"] == "lasttoken" and task["normalize"] is True and task["padding_side"] == "left"
    eos = tok.token_to_id(SPECIALS[0])
    assert task["pad_id"] == eos == tok.get_vocab_size() - len(SPECIALS)       # pad = eos, at the vocabulary's end
    assert tok.encode("a dog").ids[-1] == eos                                 # the post-processor appends it
    assert task["prompts"] == {"query": QUERY_PROMPT, "document": ""} and task["default_prompt_name"] is None
    assert task["max_length"] == 64 and task["max_length_from"] == "model.text.max_length"
    assert read_sentence_folder(folder).max_seq_length == 8192


def test_batched_mixed_lengths_equal_sentence_transformers(folder, loaded):
    st = sentence_transformer(folder)
    docs = st.encode(TEXTS, batch_size=1)              # each text alone
    queries = st.encode(TEXTS, batch_size=1, prompt_name="query")
    got = embed(loaded, folder, [{"inputs": TEXTS}, *({"text": t, "prompt_name": "query"} for t in TEXTS)])
    for vector, want in zip(got, [*docs, *queries]):
        assert abs(np.linalg.norm(vector) - 1.0) <= 1e-3
        assert float(vector @ want) / float(np.linalg.norm(want)) >= 0.999
    assert float(got[0] @ got[len(TEXTS)]) < 0.999          # the prompt changes the vector


def test_truncate_follows_tei(folder, loaded, make_params):
    adapter = make_adapter(folder, loaded.task)
    long = " ".join(["river"] * 200)
    with pytest.raises(RequestError) as e:
        adapter.decode_request({"text": long}, "application/json")
    assert e.value.status == 413 and "limit of 64" in e.value.message and '"truncate": true' in e.value.message
    st = sentence_transformer(folder, max_seq_length=64)
    got = embed(loaded, folder, [{"text": long, "truncate": True}])[0]
    want = st.encode([long])[0]
    assert float(got @ want) >= 0.999


def test_unknown_prompt_name_lists_the_folder_prompts(folder, loaded):
    adapter = make_adapter(folder, loaded.task)
    with pytest.raises(RequestError) as e:
        adapter.decode_request({"text": "a", "prompt_name": "passage"}, "application/json")
    assert e.value.status == 400 and "document, query" in e.value.message
    with pytest.raises(RequestError) as e:
        adapter.decode_request({"text": "a", "promt_name": "query"}, "application/json")
    assert e.value.status == 400 and "promt_name" in e.value.message


def test_default_prompt_applies_when_none_is_named(folder, make_params, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config_sentence_transformers.json").read_text())
    (copy / "config_sentence_transformers.json").write_text(json.dumps({**cfg, "default_prompt_name": "query"}))
    params = make_params({"name": "tiny-default-prompt", "source": "hf", "checkpoint": str(copy),
                          "task": "text-embedding", "text": {"max_length": 64}})
    loaded = load_model(params)
    st = sentence_transformer(copy)
    got = embed(loaded, copy, [{"inputs": TEXTS[:3]}])
    for vector, want in zip(got, st.encode(TEXTS[:3])):
        assert float(vector @ want) >= 0.999


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("key", sorted(MODES))
def test_every_pooling_mode_equals_sentence_transformers_on_each_row_alone(key, side):
    from sentence_transformers.models import Pooling
    torch.manual_seed(0)
    hidden = torch.randn(4, 7, 8)
    lengths = [7, 3, 1, 5]
    mask = torch.zeros(4, 7, dtype=torch.int64)
    for row, n in enumerate(lengths):
        mask[row, 7 - n:] = 1 if side == "left" else 0
        if side == "right":
            mask[row, :n] = 1
    name = MODES[key][0]
    st = Pooling(8, pooling_mode={"mean_sqrt_len": "mean_sqrt_len_tokens"}.get(name, name))
    # the oracle is each row alone (no pads): the answer a request gets whatever its batch-mates
    want = torch.cat([st({"token_embeddings": hidden[row:row + 1, mask[row] == 1],
                          "attention_mask": torch.ones(1, n, dtype=torch.int64)})["sentence_embedding"]
                      for row, n in enumerate(lengths)])
    got = pool(hidden, mask, name, normalize=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _with_pooling(folder: Path, tmp_path: Path, cfg: dict) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **cfg}))
    return copy


@pytest.mark.parametrize("cfg, words", [
    ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": True}, "exactly one pooling mode"),
    ({}, "found none"),
    ({"pooling_mode_medoid_tokens": True}, "pooling_mode_medoid_tokens is not supported"),
    ({"pooling_mode_mean_tokens": True, "include_prompt": "no"}, "include_prompt is 'no'"),
])
def test_pooling_the_pipeline_cannot_compute_is_refused_by_name(folder, tmp_path, cfg, words):
    with pytest.raises(CheckpointError) as e:
        read_sentence_folder(_with_pooling(folder, tmp_path, cfg))
    assert words in str(e.value)
    if "include_prompt" not in cfg:                  # the modes supported are listed
        assert "pooling_mode_lasttoken (lasttoken)" in str(e.value), str(e.value)


INSTRUCTION = "Represent this sentence for retrieving supporting documents: "


@pytest.mark.parametrize("family", ["decoder", "modernbert"])
@pytest.mark.parametrize("mode", ["mean", "cls", "lasttoken", "weightedmean"])
def test_include_prompt_false_pools_without_the_prompt_as_sentence_transformers(folder, tmp_path, make_params,
                                                                                family, mode):
    """INSTRUCTOR-style pooling: the prompt attended to, left out of the pooled vector. Left padding
    (the decoder) and right padding (ModernBERT), prompted and plain texts in one batch."""
    key = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "lasttoken": "pooling_mode_lasttoken",
           "weightedmean": "pooling_mode_weightedmean_tokens"}[mode]
    if family == "decoder":
        copy = _with_pooling(folder, tmp_path, {key: True, "include_prompt": False})
    else:
        from scripts.make_modernbert_model import build as build_modernbert
        copy = build_modernbert(tmp_path / "model", seed=4)
        (copy / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, key: True,
                                                                     "include_prompt": False}))
    (copy / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": INSTRUCTION}}))
    params = make_params({"name": f"tiny-instructor-{family}", "source": "hf", "checkpoint": str(copy),
                          "task": "text-embedding", "text": {"max_length": 64}})
    loaded = load_model(params)
    assert [i.name for i in loaded.inputs] == ["input_ids", "attention_mask", "pooling_mask"]
    assert loaded.task["include_prompt"] is False and loaded.task["pooling"] == mode
    st = sentence_transformer(copy)
    assert not st[1].include_prompt
    want = [*st.encode(TEXTS, batch_size=1, prompt_name="query"), *st.encode(TEXTS, batch_size=1)]
    got = embed(loaded, copy, [*({"text": t, "prompt_name": "query"} for t in TEXTS), {"inputs": TEXTS}])
    for vector, w in zip(got, want):
        assert float(vector @ w) / (float(np.linalg.norm(vector)) * float(np.linalg.norm(w))) >= 0.999
    # the prompt is still attended to: the same text with the prompt pooled in differs
    pooled_in = sentence_transformer(copy)
    pooled_in.set_pooling_include_prompt(True)
    if mode != "lasttoken":
        assert float(got[1] @ pooled_in.encode([TEXTS[1]], prompt_name="query")[0]) < 0.9999


def test_a_module_that_is_not_served_is_refused(folder, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    modules = json.loads((copy / "modules.json").read_text())
    modules.insert(2, {"idx": 9, "name": "9", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError) as e:
        read_sentence_folder(copy)
    assert "sentence_transformers.models.Dense" in str(e.value) and "Transformer, Pooling, Normalize" in str(e.value)


# --------------------------------------------------------------------------- decoder reranker
QUERY = "who plays the guitar in the city"
DOCUMENTS = ["a man plays the guitar", "the market fell sharply today", "music in the old city at evening",
             "dog", "a teacher reads a story to every child in the garden while the river runs slowly"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, make_params):
    from scripts.make_decoder_model import build_reranker
    folder = build_reranker(tmp_path_factory.mktemp("qwen3_reranker") / "model", seed=5)
    params = make_params({"name": "tiny-qwen3-reranker", "source": "hf", "checkpoint": str(folder),
                          "task": "rerank", "text": {"max_length": 64, "max_texts": 16}})
    return folder, load_model(params)


def rerank(loaded, folder: Path, body: dict) -> list[dict]:
    adapter = make_adapter(folder, loaded.task)
    decoded = adapter.decode_request(body, "application/json")
    feeds = adapter.collate(decoded.rows)
    with torch.inference_mode():
        out = loaded.module(*(torch.as_tensor(feeds[i.name]) for i in loaded.inputs)).numpy()
    return adapter.respond_request([[out[r]] for r in range(len(decoded.rows))], decoded.meta)


def test_decoder_reranker_scores_equal_cross_encoder(reranker):
    from sentence_transformers import CrossEncoder
    folder, loaded = reranker
    assert loaded.task["padding_side"] == "left" and "token_type_ids" not in loaded.task["inputs"]
    ce = CrossEncoder(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    want = ce.predict([(QUERY, d) for d in DOCUMENTS], batch_size=1)
    got = rerank(loaded, folder, {"query": QUERY, "texts": DOCUMENTS})       # one left-padded batch
    assert [g["index"] for g in got] == list(np.argsort(-want, kind="stable"))
    assert max(abs(g["score"] - float(want[g["index"]])) for g in got) < 0.01


# --------------------------------------------------------------------------- ModernBERT
MODERN_TEXTS = TEXTS + ["a small red bird sings in the morning while the old farmer walks slowly across the "
                        "garden and the children play together near the quiet river before the evening train"]


def test_modernbert_vectors_equal_sentence_transformers_past_the_window(tmp_path, make_params):
    from scripts.make_modernbert_model import build as build_modernbert
    folder = build_modernbert(tmp_path / "model", seed=2)
    params = make_params({"name": "tiny-modernbert", "source": "hf", "checkpoint": str(folder),
                          "task": "text-embedding", "text": {"max_length": 128}})
    loaded = load_model(params)
    assert [i.name for i in loaded.inputs] == ["input_ids", "attention_mask"] and loaded.task["padding_side"] == "right"
    st = sentence_transformer(folder)
    want = st.encode(MODERN_TEXTS, batch_size=1)
    got = embed(loaded, folder, [{"inputs": MODERN_TEXTS}])
    assert len(st.tokenizer(MODERN_TEXTS[-1])["input_ids"]) > 16            # longer than the 16-token window
    for vector, w in zip(got, want):
        assert float(vector @ w) >= 0.999
