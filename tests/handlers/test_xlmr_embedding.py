"""An XLM-RoBERTa-shaped sentence-embedding folder (SentencePiece-style Unigram tokenizer, pad id 1,
no token_type_ids, mean pooling + Normalize) through loading, half-precision conversion and the
serving handler: served embeddings are unit vectors within 1e-5 and match eager's direction."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.model.checkpoint import load_model
from pipeline.model.golden import read_golden, write_golden
from tests.build.test_variants import convert
from tests.handlers.test_handlers import make_context, serve_batch

SENTENCES = ["the quick brown fox jumps over the lazy dog", "a model that reads many languages",
             "short", "ein kleiner test mit wörtern", "le modèle lit des phrases plus longues que celle-ci"]


@pytest.fixture(scope="module")
def xlmr_dir(tmp_path_factory) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import XLMRobertaConfig, XLMRobertaModel

    folder = tmp_path_factory.mktemp("tiny_xlmr")
    specials = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    chars = sorted(set("".join(SENTENCES)) - {" "})
    words = sorted({w for s in SENTENCES for w in s.split()})
    pieces = specials + [("▁" + w, -2.0) for w in words] + [("▁", -3.0)] + [(c, -5.0) for c in chars]
    tok = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.enable_padding(pad_id=1, pad_token="<pad>")
    tok.save(str(folder / "tokenizer.json"))

    config = XLMRobertaConfig(vocab_size=len(pieces), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=128, max_position_embeddings=80, pad_token_id=1,
                              bos_token_id=0, eos_token_id=2, type_vocab_size=1)
    torch.manual_seed(0)
    XLMRobertaModel(config, add_pooling_layer=False).eval().save_pretrained(str(folder))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    return folder


@pytest.fixture(scope="module")
def xlmr_case(xlmr_dir, tmp_path_factory, make_params):
    params = make_params({"name": "tiny-xlmr", "source": "hf", "checkpoint": str(xlmr_dir),
                          "task": "text-embedding", "text": {"max_length": 48}})
    loaded = load_model(params)
    golden_dir = tmp_path_factory.mktemp("xlmr_golden")
    write_golden(params, loaded, golden_dir)
    return params, loaded, read_golden(golden_dir)


def test_xlmr_folder_loads_without_token_types(xlmr_case):
    _params, loaded, _golden = xlmr_case
    assert [i.name for i in loaded.inputs] == ["input_ids", "attention_mask"]
    assert loaded.task["normalize"] is True and loaded.task["pooling"] == "mean"


@pytest.mark.parametrize("variant", ["bf16", "onnx-fp16"])
def test_half_precision_variant_serves_unit_vectors(xlmr_case, tmp_path, variant):
    import torch
    from tokenizers import Tokenizer
    params, _loaded, golden = xlmr_case
    loaded = load_model(params)        # a half-precision build releases the module it converts
    tok = Tokenizer.from_file(str(Path(params.model.checkpoint) / "tokenizer.json"))
    want = {}
    for sentence in SENTENCES:
        ids = torch.tensor([tok.encode(sentence).ids])
        with torch.inference_mode():
            want[sentence] = loaded.module(ids, torch.ones_like(ids))[0].double().numpy()
    out_dir = tmp_path / variant
    record = convert(variant, params, loaded, golden, out_dir)
    if record["status"] == "skipped":
        pytest.skip(f"{variant} is skipped on this host by the screen: {record['reason']}")
    assert record["status"] == "converted", record["reason"]

    from handlers.onnx_handler import OnnxHandler
    from handlers.torch_handler import TorchHandler
    handler = TorchHandler() if variant == "bf16" else OnnxHandler()
    context = make_context(out_dir, batch_size=4)
    handler.initialize(context)
    try:
        requests = [(s.encode("utf-8"), "text/plain") for s in SENTENCES]
        answers = serve_batch(handler, context, requests)
    finally:
        handler.close()

    for sentence, (status, answer) in zip(SENTENCES, answers):
        assert status == 200, answer
        got = np.asarray(answer["embedding"], dtype=np.float64)
        assert abs(np.linalg.norm(got) - 1.0) <= 1e-5, (variant, np.linalg.norm(got))
        ref = want[sentence]
        assert float(got @ ref / np.linalg.norm(ref)) >= 0.999, variant
