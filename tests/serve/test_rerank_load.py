"""The rerank load (issue 26, pipeline/serve/checks/rerank_load.py): rows/s served against the rows/s the model
gives alone, measured in the same run on the load's own requests (the benchmark's figure at the model
calls the server made kept beside it, and standing in when the in-run measurement fails), and their
ratio in metrics/serve_check.json.

Pure arithmetic first (calls formed from TorchServe's batches, call times from the benchmark curve,
the bound in requests/s, which figure the ratio uses), then the serve_check stage on a tiny cross-encoder (MiniLM's real tokenizer,
random weights) archived by the pipeline's own steps and served in a REAL TorchServe: the figures are
recorded and consistent with each other — never compared with a wall-clock threshold."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.serve.reference.ceiling import model_alone_rps
from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.checks.rerank_load import (alone_batch, call_ms, failures_of, model_calls_formed, offline_rows_per_s,
                                        rerank_figure, rows_of, whole_batches)

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")

# rows/s per process at each measured rows-per-call
STEADY = {"1": {"throughput_sps": 100.0}, "4": {"throughput_sps": 320.0}, "8": {"throughput_sps": 400.0},
          "16": {"throughput_sps": 480.0}}
BENCH = {"threads": 1, "steady": STEADY}


# --------------------------------------------------------------------------- arithmetic
def test_model_calls_formed_from_torchserves_batches():
    # 20 texts per query, calls of at most 16 rows: a batch of 1 request is 16 + 4 rows, of 2 is 16 + 16 + 8.
    assert model_calls_formed({"1": 5, "2": 3}, 20, 16) == {4: 5, 8: 3, 16: 11}
    assert model_calls_formed({"2": 4}, 8, 16) == {16: 4}           # whole calls only
    assert model_calls_formed({}, 20, 16) == {}


def test_call_times_measured_interpolated_and_beyond_the_curve():
    assert call_ms(STEADY, 8) == (pytest.approx(20.0), "measured")                # 8 rows / 400 rows/s
    ms, how = call_ms(STEADY, 12)                                                 # between 8 (20 ms) and 16 (33.3 ms)
    assert ms == pytest.approx(20.0 + (1000 * 16 / 480 - 20.0) / 2) and how == "interpolated between 8 and 16"
    ms, how = call_ms(STEADY, 32)
    assert ms == pytest.approx(2 * 1000 * 16 / 480) and "largest measured batch 16" in how
    assert call_ms({}, 4)[0] is None


def test_offline_rows_per_s_is_model_alone_when_every_call_is_one_measured_batch():
    one = offline_rows_per_s(BENCH, {16: 10}, workers=2)
    assert one["value"] == pytest.approx(model_alone_rps(BENCH, 16, 2)["value"]) == pytest.approx(960.0)
    mixed = offline_rows_per_s(BENCH, {16: 1, 4: 1}, workers=1)
    assert mixed["value"] == pytest.approx(20 / (16 / 480 + 4 / 320))            # Σ rows / Σ call time
    assert [c["rows"] for c in mixed["calls"]] == [4, 16]


def test_the_bound_is_in_requests_per_second_for_many_rows():
    alone = model_alone_rps(BENCH, 16, 2, rows_per_request=30.0)
    assert alone["value"] == pytest.approx(2 * 480 / 30) and alone["rows_per_s"] == 960.0
    assert model_alone_rps(BENCH, 16, 2)["value"] == 960.0                       # one row per request: unchanged


def test_rerank_figure_rows_per_second_offline_and_ratio():
    load = {"requests_ok": 50, "requests_sent": 50, "wall_s": 2.5, "throughput_rps": 20.0, "p50_ms": 150.0,
            "p99_ms": 300.0, "batch_sizes_seen": {"1": 30, "2": 10}, "errors_5xx": 0, "errors_4xx": 0, "lost": 0}
    fig = rerank_figure(load, texts=20, clients=4, batch_rows=16, workers=1, benchmark=BENCH, variant="onnx")
    assert fig["rows_answered"] == 1000 and fig["served_rows_per_s"] == 400.0        # 50 × 20 rows / 2.5 s
    assert fig["model_calls"] == {"4": 30, "8": 10, "16": 50}
    offline = (30 * 4 + 10 * 8 + 50 * 16) / ((30 * 4 / 320) + (10 * 8 / 400) + (50 * 16 / 480))
    assert fig["offline_rows_per_s"] == pytest.approx(offline, abs=0.01)
    assert fig["served_vs_offline"] == pytest.approx(400.0 / offline, abs=1e-4)
    assert fig["meets_target"] == (fig["served_vs_offline"] >= 0.7) and fig["target"] == 0.7
    assert failures_of(fig) == []
    assert failures_of({**fig, "load": {**load, "errors_5xx": 2}})[0].startswith("rerank load: 0 4xx, 2 5xx")
    # No batch seen in the logs: the configured batchSize stands in, and says so.
    blind = rerank_figure({**load, "batch_sizes_seen": {}}, texts=20, clients=4, batch_rows=16, workers=1,
                          benchmark=BENCH, variant="onnx", configured_batch=1)
    assert blind["model_calls"] == {"4": 1, "16": 1} and "configured" in blind["batches_basis"]
    # Not measured alone (no runner): the benchmark's figure, and the record says so.
    assert fig["offline_source"] == "benchmark" and fig["offline"] == fig["offline_benchmark"]
    assert "could not be measured" in fig["offline_why"] and fig["served_vs_offline_benchmark"] == fig["served_vs_offline"]


LOAD = {"requests_ok": 50, "requests_sent": 50, "wall_s": 2.5, "throughput_rps": 20.0, "p50_ms": 150.0,
        "p99_ms": 300.0, "batch_sizes_seen": {"1": 30, "2": 10}, "errors_5xx": 0, "errors_4xx": 0, "lost": 0}
# model_alone.measure's record for the load's requests, server batches of 1 request, calls of 16 rows
ALONE = {"ok": True, "rows_per_s": 500.0, "requests_per_s": 25.0, "workers": 1, "threads_per_process": 1,
         "batch_size": 1, "batch_rows": 16, "window_s": 3.0, "overlap": "every process timed the same window",
         "processes": [], "batch_basis": "the batches TorchServe formed under the load: 1 request(s), 60% of its requests"}


def test_the_ratio_uses_the_model_alone_measured_on_the_loads_own_requests():
    fig = rerank_figure(LOAD, texts=20, clients=4, batch_rows=16, workers=1, benchmark=BENCH, variant="onnx",
                        alone=ALONE)
    assert fig["offline_source"] == "model_alone" and fig["offline_rows_per_s"] == 500.0
    assert fig["served_vs_offline"] == pytest.approx(400.0 / 500.0) and fig["meets_target"] is True
    off = fig["offline"]
    assert off["batch_size"] == 1 and off["batch_rows"] == 16 and off["rows_per_request"] == 20
    assert off["model_calls_per_batch"] == {"4": 1, "16": 1} and off["measured"] is ALONE
    assert "this run" in off["formula"] and "own requests" in off["formula"] and "same rows" in fig["offline_why"]
    # The benchmark's figure at the calls the server made, beside it, with its own ratio.
    bench = fig["offline_benchmark"]
    assert bench["source"] == "benchmark" and bench["value"] == pytest.approx(
        rerank_figure(LOAD, texts=20, clients=4, batch_rows=16, workers=1, benchmark=BENCH, variant="onnx")["offline"]["value"])
    assert fig["served_vs_offline_benchmark"] == pytest.approx(400.0 / bench["value"], abs=1e-4)
    assert fig["model_alone_errors"] is None and "model alone on this load's own requests" in fig["ratio_formula"]


def test_a_failed_in_run_measurement_falls_back_to_the_benchmark_and_says_so():
    failed = {"ok": False, "errors": ["exit 1: ModuleNotFoundError"], "processes": [], "batch_basis": "x"}
    fig = rerank_figure(LOAD, texts=20, clients=4, batch_rows=16, workers=1, benchmark=BENCH, variant="onnx",
                        alone=failed)
    assert fig["offline_source"] == "benchmark" and fig["offline"] == fig["offline_benchmark"]
    assert fig["offline_rows_per_s"] == pytest.approx(fig["offline_benchmark"]["value"], abs=0.01)
    assert fig["model_alone_errors"] == ["exit 1: ModuleNotFoundError"]
    assert "could not be measured" in fig["offline_why"] and "ModuleNotFoundError" in fig["offline_why"]
    assert "benchmark's figure" in fig["ratio_formula"]
    # Neither figure: no ratio, and why.
    none = rerank_figure(LOAD, texts=20, clients=4, batch_rows=16, workers=1, benchmark={}, variant="onnx", alone=failed)
    assert none["offline_rows_per_s"] is None and none["served_vs_offline"] is None and none["meets_target"] is None
    assert none["offline_source"] is None and "no steady-state curve" in none["offline_why"]


def test_the_model_alone_runs_the_batches_that_carried_the_load():
    # 30 batches of 1 = 30 requests, 10 of 2 = 20: size 1 carried most; a tie goes to the larger.
    assert alone_batch({"1": 30, "2": 10})[0] == 1 and "60%" in alone_batch({"1": 30, "2": 10})[1]
    assert alone_batch({"1": 20, "2": 10})[0] == 2 and alone_batch({"4": 3, "2": 1})[0] == 4
    assert alone_batch({}, 3) == (3, "the configured batchSize (no batch was seen in the logs)")
    assert alone_batch({})[0] == 1
    cases = [HttpCase(f"q{i}", "application/json", b"{}") for i in range(16)]
    assert len(whole_batches(cases, 1)) == 16 and len(whole_batches(cases, 4)) == 16
    assert len(whole_batches(cases, 3)) == 48 and len(whole_batches(cases, 32)) == 32


def test_the_stage_runs_the_model_alone_on_the_loads_requests_as_the_workers_run_it(tmp_path, monkeypatch):
    """stages/serve_check.py's wiring, no server: the model-alone runner it hands the rerank load runs
    the served variant on the cases it is given, at the served batch_rows, threads and workers."""
    from types import SimpleNamespace
    import pipeline.serve.checks.model_alone as model_alone
    import stages.serve_check as stage
    (tmp_path / "model-config.yaml").write_text("batchSize: 2\nhandler:\n  threads: 3\n  batch_rows: 16\n")
    monkeypatch.setattr(stage, "SERVE_DIR", tmp_path)
    monkeypatch.setattr(stage, "served_benchmark", lambda name: ("onnx", BENCH))
    monkeypatch.setattr(stage, "variant_dir", lambda v: tmp_path / "variants" / v)
    monkeypatch.setattr(stage, "rerank_cases", lambda golden, texts: [HttpCase("q", "application/json", b"{}")] * 16)
    handed, ran = {}, {}
    monkeypatch.setattr(stage, "measure_rerank_load", lambda spec, cases, **kw: handed.update(kw, cases=cases) or {})
    monkeypatch.setattr(model_alone, "measure_cases", lambda vdir, cases, **kw: ran.update(kw, vdir=vdir, cases=cases)
                        or {"ok": True})
    sc = SimpleNamespace(rerank_texts=20, rerank_clients=4, requests=100, time_cap_s=5, warmup_s=1)
    params = SimpleNamespace(serve_check=sc, model=SimpleNamespace(name="m", text=SimpleNamespace(max_texts=64)))
    derivation = {"batch_rows": {"value": 16}, "batch_size": {"value": 2}, "workers": {"value": 2}}
    stage.rerank_load(params, None, derivation)
    assert (handed["batch_rows"], handed["workers"], handed["configured_batch"]) == (16, 2, 2)
    mine = handed["cases"][:4]
    assert handed["model_alone"](mine, 2) == {"ok": True}
    assert ran["cases"] == mine and ran["vdir"] == tmp_path / "variants" / "onnx"
    assert ran == {**ran, "batch_size": 2, "batch_rows": 16, "workers": 2, "threads": 3, "device": "cpu"}
    monkeypatch.setattr(stage, "served_benchmark", lambda name: (None, {}))
    stage.rerank_load(params, None, derivation)
    assert not handed["model_alone"](mine, 2)["ok"]                    # no served variant: says so, no run


# --------------------------------------------------------------------------- real TorchServe
SERVED = {"batch_size": 2, "batch_rows": 16, "max_batch_delay_ms": 20, "workers": 1, "threads_per_worker": 1,
          "response_timeout_s": 30, "startup_timeout_s": 60, "job_queue_size": 200, "max_request_size": 400000,
          "max_response_size": 2000000, "max_request_bytes": 200000, "device": "cpu"}


def build_rerank_stage_inputs(root: Path, folder: Path) -> tuple:
    """What prepare → convert (eager, verified) → configure → archive leave for a tiny cross-encoder."""
    from pipeline.build.builder import build_variant
    from pipeline.build.variants import get_converter
    from pipeline.core.params import parse_params
    from pipeline.decide.properties import write_config_properties, write_model_config
    from pipeline.model.checkpoint import load_model
    from pipeline.model.golden import write_golden
    from pipeline.serve.archive import build_archive

    raw = {"model": {"name": "tiny-rerank", "source": "hf", "checkpoint": str(folder), "task": "rerank",
                     "text": {"max_length": 64}},
           "variants": ["eager"], "benchmark": {"batch_sizes": [1, 4]}, "conversion": {"golden_batches": 1},
           "serve_check": {"requests": 24, "concurrency": 2, "time_cap_s": 60, "warmup_s": 0.5, "rounds": 1,
                           "baseline": False, "handtuned": False, "rerank_texts": 20, "rerank_clients": 4}}
    params = parse_params(raw)
    art = root / "artifacts"
    loaded = load_model(params)
    golden = write_golden(params, loaded, art / "golden")
    record = build_variant(get_converter("eager").from_params(params), loaded, golden, art / "variants" / "eager",
                           "cpu", params.conversion.tolerances["float32"], params.conversion.min_topk_agreement)
    assert record["status"] == "converted", record["reason"]
    (art / "selection.json").write_text(json.dumps({"winner": "eager", "objective": "throughput", "slo_met": True,
                                                    "message": "test", "variants": {}}))
    packed, serve = art / "configured", art / "serve"     # the stage reads serve/: no model-config.yaml, no ceiling
    packed.mkdir()
    serve.mkdir()
    write_model_config(packed / "model-config.yaml", SERVED)
    store = art / "model_store"
    build_archive(params, selection_path=art / "selection.json", variants_dir=art / "variants", serve_dir=packed,
                  env_path=art / "env.json", export_dir=store)
    write_config_properties(serve / "config.properties", SERVED, model_name="tiny-rerank", model_store=store)
    (serve / "derivation.json").write_text(json.dumps({k: {"value": v} for k, v in SERVED.items()}))
    (root / "params.yaml").write_text(json.dumps(raw))
    return store, serve, art / "golden"


@pytest.mark.torchserve
@needs_java
def test_serve_check_records_the_rerank_load_in_rows(tmp_path, monkeypatch):
    import stages.serve_check as stage
    from tests.handlers.text_task_models import make_models

    folder = make_models(tmp_path / "models", seed=3)["rerank"]
    store, serve, golden = build_rerank_stage_inputs(tmp_path, folder)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    out = tmp_path / "serve_check.json"
    monkeypatch.setenv("PIPELINE_PARAMS", str(tmp_path / "params.yaml"))
    for name, value in (("MODEL_STORE", store), ("SERVE_DIR", serve), ("GOLDEN_DIR", golden), ("SERVE_CHECK_JSON", out)):
        monkeypatch.setattr(stage, name, value)
    monkeypatch.setattr(stage, "benchmark_json", lambda v: bench)
    monkeypatch.setattr(stage, "variant_dir", lambda v: tmp_path / "artifacts" / "variants" / v)

    rc = stage.main([])
    rec = json.loads(out.read_text())
    assert rc == 0, rec["failures"]
    rl = rec["rerank_load"]
    load = rl["load"]
    assert (rl["texts_per_query"], rl["clients"], rl["batch_rows"], rl["workers"]) == (20, 4, 16, 1)
    assert load["concurrency"] == 4 and load["errors_5xx"] == load["errors_4xx"] == load["lost"] == 0
    assert load["requests_ok"] == load["requests_sent"] == 24 and rl["variant"] == "eager"
    # rows/s = rows answered / wall, rows answered = requests answered × 20 texts.
    assert rl["rows_answered"] == 20 * load["requests_ok"]
    assert rl["served_rows_per_s"] == pytest.approx(rl["rows_answered"] / load["wall_s"], rel=1e-3)
    assert rl["served_requests_per_s"] == pytest.approx(load["throughput_rps"], rel=1e-3)
    # The batches TorchServe formed hold every answered request, at most batchSize (2) each...
    seen = {int(k): v for k, v in rl["batches_formed"].items()}
    assert sum(k * v for k, v in seen.items()) == load["requests_ok"] and max(seen) <= 2
    # ...and the handler ran their 20 k rows in calls of at most 16: the calls the offline figure is priced at.
    calls = {int(k): v for k, v in rl["model_calls"].items()}
    assert calls == model_calls_formed(seen, 20, 16) and max(calls) <= 16
    assert sum(r * n for r, n in calls.items()) == rl["rows_answered"]
    offline = offline_rows_per_s(BENCH, calls, 1)["value"]
    assert rl["offline_benchmark"]["value"] == pytest.approx(offline, abs=0.01)
    # The ratio's offline figure: the model alone in this run on the load's own 20-text queries, 1 process,
    # server batches of the size that carried the load, calls of 16 rows.
    alone = rl["offline"]
    assert rl["offline_source"] == "model_alone" and alone["measured"]["ok"], rl.get("model_alone_errors")
    assert alone["workers"] == 1 and alone["batch_rows"] == 16 and alone["rows_per_request"] == 20
    assert alone["batch_size"] == max(seen, key=lambda k: (k * seen[k], k))
    assert all(p["rows"] > 0 for p in alone["measured"]["processes"])
    assert rl["offline_rows_per_s"] == round(alone["measured"]["rows_per_s"], 2) > 0
    assert rl["served_vs_offline"] == pytest.approx(rl["served_rows_per_s"] / rl["offline_rows_per_s"], rel=1e-3)
    assert rl["served_vs_offline_benchmark"] == pytest.approx(rl["served_rows_per_s"] / offline, rel=1e-3)
    assert rl["meets_target"] == (rl["served_vs_offline"] >= 0.7)
    # The task's bad inputs: each answered with a 4xx naming it, the worker up.
    assert {"no_texts", "missing_query", "non_string_text", "too_many_texts", "query_over_the_limit"} <= set(rec["bad_inputs"])
    assert all(400 <= s < 500 for s in rec["bad_inputs"].values()), rec["bad_inputs"]
    # The main load is the golden set's rerank requests: 10-50 texts each (here the tiny model's cap of 64).
    cases = json.loads((golden / "http_cases.json").read_text())
    assert all(10 <= len(json.loads(c["body"])["texts"]) <= 50 for c in cases)


def test_rerank_cases_have_exactly_the_texts_asked(tmp_path):
    from pipeline.serve.checks.rerank_load import rerank_cases
    from scripts.make_text_task_model import minilm_folder
    shutil.copyfile(minilm_folder() / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "golden.json").write_text(json.dumps({"task": {"kind": "rerank", "max_length": 128, "max_texts": 64}}))
    cases = rerank_cases(tmp_path, 20, n=6)
    assert len(cases) == 6 and {rows_of(c) for c in cases} == {20}
    assert len({c.body for c in cases}) == 6 and all(c.content_type == "application/json" for c in cases)


def test_the_tuner_serves_each_candidates_rows_per_call(tmp_path):
    """A candidate's rows per model call reach the handler (model-config.yaml handler.batch_rows) only
    where they differ from its batchSize; the warm-up runs on one row on a CPU, at that many rows on a GPU."""
    import yaml
    from pipeline.serve.tune.candidates import OperatingCandidate
    from pipeline.serve.tune.tuner import ServedModel
    (tmp_path / "m").mkdir()
    model = ServedModel(tmp_path, "n", "m", tmp_path / "config.properties",
                        {"batchSize": 1, "handler": {"threads": 2, "warmup_batch_size": 16, "batch_rows": 16}})

    def served(c):
        model.write_yaml(c)
        return yaml.safe_load((tmp_path / "m" / "model-config.yaml").read_text())
    cfg = served(OperatingCandidate("batch 64 rows", 2, 5, 1, 1, "larger batch", batch_rows=64))
    assert cfg["batchSize"] == 2 and cfg["handler"]["batch_rows"] == 64 and cfg["handler"]["warmup_batch_size"] == 1
    cfg = served(OperatingCandidate("one row each", 8, 5, 1, 1, "offline"))
    assert cfg["batchSize"] == 8 and "batch_rows" not in cfg["handler"] and cfg["handler"]["warmup_batch_size"] == 1
    model.base_yaml["handler"]["device"] = "cuda"
    cfg = served(OperatingCandidate("batch 64 rows", 2, 5, 1, 1, "larger batch", batch_rows=64))
    assert cfg["handler"]["warmup_batch_size"] == 64


def test_the_report_and_summary_show_the_rerank_figure(tmp_path):
    from types import SimpleNamespace
    from pipeline.publish.report_render import fmt, render_markdown
    from pipeline.publish.report_serving import rerank_load_blocks
    from pipeline.publish.report_summary import _serve_check_figures
    load = {"requests_ok": 50, "wall_s": 2.5, "throughput_rps": 20.0, "batch_sizes_seen": {"1": 30, "2": 10}}
    fig = rerank_figure(load, texts=20, clients=4, batch_rows=16, workers=1, benchmark=BENCH, variant="onnx")
    md = render_markdown(rerank_load_blocks(SimpleNamespace(serve_check={"rerank_load": fig})), tmp_path)
    assert "| served rows/s | 400 |" in md and f"**{fig['served_vs_offline']}** (met)" in md
    assert "30 of 1 request(s), 10 of 2 request(s)" in md and "target ≥ 0.7" in md
    assert _serve_check_figures({"rerank_load": fig})["rerank_vs_offline"] == fig["served_vs_offline"]
    assert "rerank_vs_offline" not in _serve_check_figures({"ratios": {}})          # other tasks: nothing added
    assert rerank_load_blocks(SimpleNamespace(serve_check={})) == []
    assert "Why this figure: the model alone could not be measured" in md
    # Measured alone in the run: the table says so, the benchmark's figure beside it for comparison.
    fig = rerank_figure(LOAD, texts=20, clients=4, batch_rows=16, workers=1, benchmark=BENCH, variant="onnx",
                        alone=ALONE)
    md = render_markdown(rerank_load_blocks(SimpleNamespace(serve_check={"rerank_load": fig})), tmp_path)
    assert "| offline rows/s: the model alone on these requests, this run | 500 |" in md
    assert "run alone right after the load, in this run, on the load's own queries" in md
    assert "1 of 4 rows, 1 of 16 rows per batch" in md and "**0.8** (met)" in md
    assert f"| served / benchmark figure (not the ratio judged) | {fmt(fig['served_vs_offline_benchmark'])} |" in md
    assert _serve_check_figures({"rerank_load": fig})["rerank_offline_rows_per_s"] == 500.0
    # A record from before the in-run measurement (only the benchmark's figure, under `offline`) still renders.
    old = {k: v for k, v in rerank_figure(load, texts=20, clients=4, batch_rows=16, workers=1, benchmark=BENCH,
                                          variant="onnx").items()
           if k not in ("offline_benchmark", "offline_source", "offline_why", "served_vs_offline_benchmark")}
    md = render_markdown(rerank_load_blocks(SimpleNamespace(serve_check={"rerank_load": old})), tmp_path)
    assert "Offline = workers x sum(rows)" in md and "Why this figure" not in md
