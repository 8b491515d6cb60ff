"""The plan's screen judges a variant at its steady state: a TorchScript variant slow only on its
first calls (the JIT's profiling runs) is built, a variant slow at every call is skipped, and the
reason says what was measured (a steady-state median, or the time cap)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.accuracy.verify import tolerance_for
from pipeline.build.builder import build_variant
from pipeline.build.plan import Screen, make_screen
from pipeline.build.steady import MAX_WARMUPS, TIMED_CALLS, Series, jit_warmup_calls
from pipeline.build.variants.base import get_converter
from pipeline.model.checkpoint import load_model
from pipeline.model.golden import write_golden
from tests.build.test_variants import tensor_case


@pytest.fixture(scope="module")
def xlmr_shaped_dir(tmp_path_factory) -> Path:
    """An XLM-R-shaped encoder (2 layers, hidden 128, 2 heads, pad id 1, one token type) with a
    small WordPiece vocabulary: the shape whose TorchScript variant a first-call screen skipped."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import XLMRobertaConfig, XLMRobertaModel

    from handlers.tasks import _WORDS
    folder = tmp_path_factory.mktemp("xlmr_shaped")
    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>"] + sorted(set(_WORDS)))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.enable_truncation(32)
    tok.enable_padding(length=32, pad_id=1, pad_token="<pad>")
    tok.save(str(folder / "tokenizer.json"))
    config = XLMRobertaConfig(vocab_size=len(vocab), hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=512, max_position_embeddings=66, pad_token_id=1,
                              bos_token_id=0, eos_token_id=2, type_vocab_size=1)
    torch.manual_seed(0)
    XLMRobertaModel(config).eval().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def xlmr_case(xlmr_shaped_dir, make_params, tmp_path_factory):
    params = make_params({"name": "xlmr-shaped", "source": "hf", "checkpoint": str(xlmr_shaped_dir),
                          "task": "text-embedding", "text": {"max_length": 32}})
    loaded = load_model(params)
    return params, loaded, write_golden(params, loaded, tmp_path_factory.mktemp("xlmr_golden"))


def screened_build(variant, params, loaded, golden, out_dir, env=None) -> dict:
    cls = get_converter(variant)
    screen = make_screen(cls, params, loaded, golden, env or {}, "cpu")
    return build_variant(cls.from_params(params), loaded, golden, out_dir, "cpu", tolerance_for(params, cls.dtype),
                         params.conversion.min_topk_agreement, screen=screen)


def test_xlmr_shaped_torchscript_is_built_on_its_steady_state_not_its_cold_calls(xlmr_case, tmp_path):
    params, loaded, golden = xlmr_case
    record = screened_build("torchscript", params, loaded, golden, tmp_path / "torchscript")
    s = record["screen"]
    assert s["decision"] == "build", s["reason"]
    assert record["status"] == "converted", record["reason"]
    assert s["variant"]["warmups"] >= jit_warmup_calls() and s["variant"]["timed"] == TIMED_CALLS
    assert s["eager"]["timed"] == TIMED_CALLS and not s["variant"]["capped"]
    assert f"median of {TIMED_CALLS} calls after {s['variant']['warmups']} warm-ups" in s["reason"]
    assert s["measured"] in s["reason"] and "vs eager" in s["reason"]
    # The case this guards: the first (profiling) call is far slower than the steady state.
    assert s["variant_calls_s"][0] > 2 * s["variant_call_s"], s["variant_calls_s"]


@pytest.mark.parametrize("variant", ["bf16", "fp16"])
def test_half_precision_screen_says_what_it_measured(variant, xlmr_case, tmp_path):
    """Emulated or native on this CPU, either decision stands; its reason names the measurement."""
    params, loaded, golden = xlmr_case
    record = screened_build(variant, params, loaded, golden, tmp_path / variant)
    if loaded.module is None:                     # a build that released the module: the next test reloads
        xlmr_case[1].module = load_model(params).module
    s = record["screen"]
    assert record["status"] in ("converted", "skipped", "rejected"), record["reason"]
    assert "steady-state median" in s["reason"] or "time cap" in s["reason"] or "never settled" in s["reason"]
    assert s["variant"]["timed"] == TIMED_CALLS or s["variant"]["capped"]


class Repeated(nn.Module):
    """`inner` applied `times` times in a chain: slow at every call, not only the first. Each pass
    takes the previous one's output, so no compiler merges passes or drops one as unused."""

    def __init__(self, inner: nn.Module, times: int):
        super().__init__()
        self.inner, self.times = inner, times

    def forward(self, x):
        for _ in range(self.times):
            x = self.inner(x)
        return x


def slow_variant_screen(times: int, max_slowdown: float, **screen_kwargs):
    inner = nn.Sequential(nn.Linear(512, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 512))
    loaded, golden = tensor_case(Repeated(inner, times), 512, batch_sizes=(1, 2))
    x = torch.from_numpy(golden.batches[0].feeds["input"])

    def eager_call() -> float:                # the reference: one pass of the same layers
        import time
        with torch.inference_mode():
            t0 = time.perf_counter()
            inner(x)
            return time.perf_counter() - t0
    screen = Screen(variant="torchscript", dtype="float32", note=None, max_slowdown=max_slowdown,
                    eager_call=eager_call, feeds=golden.batches[0].feeds, **screen_kwargs)
    return loaded, golden, screen


def test_a_variant_slow_at_its_steady_state_is_skipped_with_the_median_it_measured(tensor_params, tmp_path):
    loaded, golden, screen = slow_variant_screen(times=16, max_slowdown=4.0)
    record = build_variant(get_converter("torchscript").from_params(tensor_params), loaded, golden,
                           tmp_path / "slow", "cpu", tolerance_for(tensor_params, "float32"),
                           tensor_params.conversion.min_topk_agreement, screen=screen)
    s = record["screen"]
    assert record["status"] == "skipped", (record["reason"], s)
    assert record["reason"] == s["reason"] and record["verification"] is None
    assert record["reason"].startswith(f"torchscript batch-1 call, ") and "limit 4×" in record["reason"]
    assert f"median of {TIMED_CALLS} calls after" in record["reason"] and "time cap" not in record["reason"]
    assert s["variant"]["timed"] == TIMED_CALLS and s["slowdown"] > 4


def test_a_cap_hit_before_the_steady_state_still_skips_a_call_no_warm_up_explains(tensor_params, tmp_path):
    loaded, golden, screen = slow_variant_screen(times=32, max_slowdown=2.0, cap_s=1e-6)
    record = build_variant(get_converter("torchscript").from_params(tensor_params), loaded, golden,
                           tmp_path / "slow", "cpu", tolerance_for(tensor_params, "float32"),
                           tensor_params.conversion.min_topk_agreement, screen=screen)
    s = record["screen"]
    assert record["status"] == "skipped", (record["reason"], s)
    assert "time cap of 1e-06 s hit after 1 call, before a steady state" in record["reason"]
    assert s["variant"]["capped"] and len(s["variant_calls_s"]) == 1


def test_warm_up_ends_when_the_calls_settle_and_not_before_the_jit_profiled():
    jit_like = Series(min_warmups=2)
    for seconds in (0.039, 0.0117, 0.00055, 0.0005, 0.00048):
        assert not jit_like.warm
        jit_like.add(seconds)
    assert jit_like.warm and jit_like.settled and jit_like.timed == []
    for seconds in (0.0005, 0.0004, 0.0006):
        jit_like.add(seconds)
    assert jit_like.figure() == 0.0005 and jit_like.steady

    alike_from_the_start = Series(min_warmups=4)
    for _ in range(3):
        alike_from_the_start.add(0.001)
    assert not alike_from_the_start.warm              # the runtime's own warm-up calls come first

    jittery = Series(min_warmups=1)
    for i in range(MAX_WARMUPS):
        jittery.add(0.001 * (1 + i % 2))
    assert jittery.warm and not jittery.settled       # timed anyway; the reason says it never settled
    jittery.add(0.001)
    assert "never settled" in jittery.describe(30.0)
