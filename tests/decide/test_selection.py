"""Selection on synthetic conversion / benchmark records (docs/artifacts.md schema)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from pipeline.core.params import REPO_ROOT
from pipeline.decide.selection import SIMPLICITY_ORDER, Criteria, SelectionError, check_decision, select
from tests.decide.test_serve_config import bench

CONVERTED = {"status": "converted", "reason": None, "dtype": "float32", "artifact_bytes": 1000,
             "verification": {"batch_sizes": [1, 8], "outputs": [{"name": "y", "max_abs": 2e-6, "max_rel": 1e-5,
                                                                  "min_cosine": 0.9999999, "topk_agreement": None}]}}
REJECTED = {**CONVERTED, "status": "rejected", "reason": "output y: max_abs 0.3 > atol 0.02 at batch 8"}
FAILED = {"status": "failed", "reason": "aoti: compiler crashed", "verification": None}


def curve(scale: float = 1.0, p99_scale: float = 1.0) -> dict:
    return {1: (5.0 * p99_scale, 200.0 * scale), 2: (8.0 * p99_scale, 260.0 * scale),
            4: (14.0 * p99_scale, 320.0 * scale), 8: (30.0 * p99_scale, 380.0 * scale)}


def run(benchmarks: dict, conversions: dict | None = None, variants=None, **criteria) -> dict:
    variants = variants or list(benchmarks)
    conversions = conversions or {v: CONVERTED for v in variants}
    return select(variants, conversions, benchmarks, Criteria(**criteria))


def test_max_throughput_within_slo_wins():
    d = run({"eager": bench(curve(1.0)), "onnx": bench(curve(1.5)), "torchscript": bench(curve(1.2))})
    assert d["winner"] == "onnx" and d["slo_met"] and d["objective"] == "throughput"
    assert d["variants"]["onnx"]["status"] == "winner"
    assert d["variants"]["eager"]["status"] == "eligible"
    f = d["variants"]["onnx"]["figures"]
    assert f["batch_size"] == 8 and f["throughput_sps"] == 570.0
    assert f["request_p99_ms"] == f["batch_p99_ms"] + f["max_batch_delay_ms"]
    assert {"cold_load_median_ms", "worker_memory_mb", "cv", "max_abs_error"} <= set(f)


def test_variants_are_judged_at_the_batch_their_workers_can_fill():
    # per worker, batch 8 is the best point; 2 workers with 8 requests in flight fill batches of 4 only
    d = run({"onnx": bench(curve(1.0))}, expected_concurrency=8)
    assert d["variants"]["onnx"]["figures"]["batch_size"] == 8
    d = select(["onnx"], {"onnx": CONVERTED}, {"onnx": bench(curve(1.0))}, Criteria(expected_concurrency=8),
               workers_for=lambda b: 2)
    f = d["variants"]["onnx"]["figures"]
    assert f["workers"] == 2 and f["batch_size"] == 4 and f["throughput_sps"] == 320.0


def test_tie_within_noise_prefers_the_simpler_variant():
    # bf16 is 2% faster, inside the noise of the two runs (cv 0.05 each → band 7%): onnx wins.
    d = run({"bf16": bench(curve(1.02), cv=0.05), "onnx": bench(curve(1.0), cv=0.05),
             "eager": bench(curve(0.5), cv=0.05)})
    assert d["winner"] == "onnx"
    assert d["tie_break"]["best_by_figure"] == "bf16"
    assert {t["variant"] for t in d["tie_break"]["within_noise"]} == {"bf16", "onnx"}
    assert "within measured noise" in d["message"]
    # clearly faster (30%) beats simplicity
    d = run({"bf16": bench(curve(1.3), cv=0.05), "onnx": bench(curve(1.0), cv=0.05)})
    assert d["winner"] == "bf16"
    # 10% faster with quiet calls (cv 0.01) but rounds that disagree by 12%: still a tie
    d = run({"bf16": bench(curve(1.10), cv=0.01, spread=0.12), "onnx": bench(curve(1.0), cv=0.01, spread=0.02)})
    assert d["winner"] == "onnx" and d["variants"]["bf16"]["figures"]["noise"] == 0.12
    d = run({"bf16": bench(curve(1.10), cv=0.01, spread=0.02), "onnx": bench(curve(1.0), cv=0.01, spread=0.02)})
    assert d["winner"] == "bf16"
    assert SIMPLICITY_ORDER.index("onnx") < SIMPLICITY_ORDER.index("torchscript") < SIMPLICITY_ORDER.index("eager")


def test_failed_and_rejected_variants_carry_reasons():
    conversions = {"eager": CONVERTED, "onnx": CONVERTED, "fp16": REJECTED, "aoti": FAILED, "torchscript": CONVERTED,
                   "bf16": None}
    benchmarks = {"eager": bench(curve(1.0)), "onnx": bench(curve(0.9), rss=9000.0),
                  "torchscript": {"variant": "torchscript", "status": "failed", "reason": "OOM at batch 8"},
                  "fp16": bench(curve(2.0)), "aoti": None, "bf16": None}
    d = run(benchmarks, conversions, variants=list(conversions))
    v = d["variants"]
    assert d["winner"] == "eager"
    assert v["fp16"]["status"] == "rejected" and "verification failed" in v["fp16"]["reasons"][0]
    assert v["aoti"]["status"] == "failed" and "compiler crashed" in v["aoti"]["reasons"][0]
    assert v["torchscript"]["status"] == "failed" and "OOM" in v["torchscript"]["reasons"][0]
    assert v["bf16"]["status"] == "failed" and "convert@bf16" in v["bf16"]["reasons"][0]
    assert v["onnx"]["status"] == "rejected"
    assert "exceeds serve.memory_budget_mb 4096 MB by 4904 MB" in v["onnx"]["reasons"][0]


def test_cold_load_constraint_and_objective():
    benchmarks = {"eager": bench(curve(1.0), cold=(3000.0, 4000.0)), "onnx": bench(curve(0.7), cold=(800.0, 900.0))}
    d = run(benchmarks, max_cold_load_s=2.0)
    assert d["winner"] == "onnx"
    assert "cold load: worst 4.00 s exceeds serve.max_cold_load_s 2 s by 2.00 s" in d["variants"]["eager"]["reasons"]
    assert run(benchmarks, objective="cold_load")["winner"] == "onnx"
    assert run(benchmarks)["winner"] == "eager"


def test_latency_objective_picks_lowest_p99():
    d = run({"eager": bench(curve(2.0, p99_scale=1.5)), "torchscript": bench(curve(1.0, p99_scale=0.5))},
            objective="latency")
    assert d["winner"] == "torchscript" and d["variants"]["torchscript"]["figures"]["batch_size"] == 1


def test_slo_unreachable_picks_closest_accurate_and_says_so():
    benchmarks = {"eager": bench(curve(1.0, p99_scale=100.0)), "onnx": bench(curve(1.0, p99_scale=60.0)),
                  "fp16": bench(curve(1.0, p99_scale=1.0))}
    conversions = {"eager": CONVERTED, "onnx": CONVERTED, "fp16": REJECTED}
    d = run(benchmarks, conversions, latency_slo_ms=100.0)
    assert d["winner"] == "onnx" and d["slo_met"] is False      # fp16 is fast but inaccurate
    assert d["message"].startswith("NO VARIANT MEETS THE CONSTRAINTS")
    reason = d["variants"]["eager"]["reasons"][0]
    assert reason.startswith("latency SLO: p99 per request 501.0 ms") and "by 401.0 ms" in reason
    check_decision(d, require_slo=False)
    with pytest.raises(SelectionError, match="require_slo"):
        check_decision(d, require_slo=True)


def test_nothing_servable_is_an_error_with_every_reason():
    d = run({"eager": None}, {"eager": FAILED})
    assert d["winner"] is None and "compiler crashed" in d["message"]
    with pytest.raises(SelectionError):
        check_decision(d, require_slo=False)


def test_only_listed_variants_are_considered():
    d = run({"eager": bench(curve(1.0)), "onnx": bench(curve(3.0))}, variants=["eager"])
    assert d["winner"] == "eager" and set(d["variants"]) == {"eager"}


def test_select_and_configure_stages_end_to_end(tmp_path):
    """Both stage scripts as `python -m` processes on synthetic upstream records in a scratch folder."""
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["variants"] = ["eager", "onnx", "aoti"]
    params["serve"] = {"latency_slo_ms": 100, "platform": "windows", "model_store": r"C:\models\store"}
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    variants, met, serve = tmp_path / "variants", tmp_path / "benchmark", tmp_path / "serve"
    for v, conv in {"eager": CONVERTED, "onnx": CONVERTED, "aoti": FAILED}.items():
        (variants / v).mkdir(parents=True)
        (variants / v / "conversion.json").write_text(json.dumps({**conv, "variant": v}))
    met.mkdir()
    for v, s in {"eager": 1.0, "onnx": 1.4}.items():
        (met / f"{v}.json").write_text(json.dumps(bench(curve(s), variant=v)))
    (tmp_path / "env.json").write_text(json.dumps({"device": "cpu", "memory_mb": 24000, "gpu": None,
                                                   "cpu": {"physical_cores": 2, "usable_cpus": 2}}))
    env = {**os.environ, "PIPELINE_PARAMS": str(params_file)}
    selection = tmp_path / "selection.json"
    commands = {
        "select": ["--out", str(selection), "--variants-dir", str(variants), "--benchmarks-dir", str(met)],
        "configure": ["--out", str(serve), "--selection", str(selection), "--benchmarks-dir", str(met),
                      "--env", str(tmp_path / "env.json"), "--golden", str(tmp_path / "no-golden")],
    }
    for stage, args in commands.items():
        r = subprocess.run([sys.executable, "-m", f"stages.{stage}", *args], cwd=REPO_ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    sel = json.loads(selection.read_text())
    assert sel["winner"] == "onnx" and sel["variants"]["aoti"]["status"] == "failed"
    deriv = json.loads((serve / "derivation.json").read_text())
    assert deriv["batch_size"]["value"] == 8 and deriv["workers"]["value"] == 2
    cfg = yaml.safe_load((serve / "model-config.yaml").read_text())
    assert cfg["batchSize"] == 8 and cfg["startupTimeout"] == deriv["startup_timeout_s"]["value"]
    props = (serve / "config.properties").read_text()
    assert "model_store=C:/models/store\n" in props and "load_models=minilm=minilm.mar" in props
    cmd = (serve / "start_command.txt").read_text()
    assert "--ncs" in cmd and "set OMP_NUM_THREADS=1" in cmd
    # serve.require_slo with an unreachable SLO: the decision is still written, the stage fails.
    params["serve"] = {"latency_slo_ms": 5, "require_slo": True}
    params_file.write_text(yaml.safe_dump(params))
    r = subprocess.run([sys.executable, "-m", "stages.select", *commands["select"]], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "NO VARIANT MEETS" in r.stderr
    assert json.loads(selection.read_text())["slo_met"] is False


def test_exact_by_default_quantized_wins_only_when_the_user_opts_in():
    gate = {"embedding": {"kind": "text-embedding", "min_cosine": 0.996, "recall_at_k": 0.97}}
    int8 = {**CONVERTED, "dtype": "int8", "verification": {**CONVERTED["verification"], "task_gate": gate}}
    benches = {"onnx": bench(curve(1.0)), "onnx-int8-dynamic": bench(curve(2.0))}
    convs = {"onnx": CONVERTED, "onnx-int8-dynamic": int8}
    d = run(benches, convs)
    assert d["winner"] == "onnx"                                    # the faster int8 is held back
    assert d["variants"]["onnx-int8-dynamic"]["status"] == "opt-in"
    alt = d["quantized_alternative"]
    assert alt["variant"] == "onnx-int8-dynamic" and alt["opt_in"] == "serve.allow_quantized: true"
    assert alt["figures"]["throughput_sps"] == 760.0 and alt["figures"]["task_gate"] == gate
    assert alt["met_constraints"] is True
    opted = run(benches, convs, allow_quantized=True)
    assert opted["winner"] == "onnx-int8-dynamic" and opted["quantized_alternative"] is None
    # only int8 works: still not served without the opt-in
    alone = run({"int8": bench(curve(1.0))}, {"int8": int8})
    assert alone["winner"] is None and alone["quantized_alternative"]["variant"] == "int8"


def test_a_float_variant_that_changes_the_tasks_answers_is_held_back_like_int8():
    answers = {"exact": False, "kind": "rerank", "changed_samples": 4, "queries": 13,
               "reason": "4 of 13 queries' texts come in another order than eager's (queries [0, 2, 5, 9])"}
    bf16 = {**CONVERTED, "dtype": "bfloat16", "verification": {**CONVERTED["verification"], "answers": answers}}
    same = {**CONVERTED, "verification": {**CONVERTED["verification"], "answers": {**answers, "exact": True}}}
    benches = {"onnx": bench(curve(1.0)), "bf16": bench(curve(2.0))}
    d = run(benches, {"onnx": same, "bf16": bf16})
    assert d["winner"] == "onnx" and d["variants"]["bf16"]["status"] == "opt-in"
    assert "within its float tolerance, but 4 of 13 queries" in d["variants"]["bf16"]["reasons"][-1]
    alt = d["quantized_alternative"]
    assert alt["variant"] == "bf16" and alt["figures"]["answers"]["changed_samples"] == 4
    assert run(benches, {"onnx": same, "bf16": bf16}, allow_quantized=True)["winner"] == "bf16"
