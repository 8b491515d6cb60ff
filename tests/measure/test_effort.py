"""pipeline/measure/effort.py: an inexact variant (cannot win by default) is measured briefly."""
from __future__ import annotations

import json

import pytest

from pipeline.core.params import ParamsError, parse_params
from pipeline.measure.effort import effort_for
from pipeline.measure.runner import BenchmarkSettings


def converted(tmp_path, name: str, answers=None):
    d = tmp_path / name
    d.mkdir()
    (d / "conversion.json").write_text(json.dumps({"status": "converted", "verification": {"answers": answers}}))
    return d


def test_quantized_and_answer_changing_variants_are_brief_exact_ones_full(tmp_path):
    s = BenchmarkSettings(budget_s=40.0)
    q = effort_for(converted(tmp_path, "int8"), "int8", s)
    assert q.level == "brief" and "quantized" in q.why and "serve.allow_quantized: true" in q.why
    assert (q.settings.cold_runs, q.settings.steady_runs, q.settings.from_disk, q.settings.budget_s) == (2, 2, False, 10.0)
    assert q.as_dict()["steady_runs"] == 2
    moved = effort_for(converted(tmp_path, "bf16", {"exact": False, "reason": "2 of 64 labels differ"}), "bf16", s)
    assert moved.level == "brief" and "2 of 64 labels differ" in moved.why
    exact = effort_for(converted(tmp_path, "onnx", {"exact": True}), "onnx", s)
    assert exact.level == "full" and exact.why is None and exact.settings is s
    # Not converted: full (benchmark_or_record records it as skipped).
    assert effort_for(tmp_path / "missing", "eager", s).level == "full"


def test_full_measures_an_inexact_variant_like_the_others(tmp_path):
    s = BenchmarkSettings(inexact="full")
    assert effort_for(converted(tmp_path, "int8"), "int8", s).settings is s


def test_allow_quantized_needs_the_full_benchmark():
    base = {"model": {"name": "m", "source": "hf", "checkpoint": "x", "task": "text-embedding"}}
    with pytest.raises(ParamsError, match=r"serve.allow_quantized.*benchmark.inexact: full"):
        parse_params({**base, "serve": {"allow_quantized": True}})
    p = parse_params({**base, "serve": {"allow_quantized": True}, "benchmark": {"inexact": "full"}})
    assert p.benchmark.inexact == "full"
