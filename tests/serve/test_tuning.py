"""pipeline/serve/{candidates,decision,tuner,tuning}.py and stages/tune.py: the served operating point, tested in a real TorchServe.

The model is a tiny handler whose every call costs a fixed sleep plus a per-item sleep (set in its
model-config.yaml `handler:` section): under 8 requests in flight, batching wins in the server by a
wide margin, which the offline model of a batch-1 choice cannot see. Servers are real TorchServe
0.12 processes on free loopback ports, always stopped (checked: nothing left behind).
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import yaml

from pipeline.serve.mar import package
from pipeline.decide.properties import write_config_properties
from pipeline.decide.serve_config import CurvePoint
from pipeline.serve.tune.candidates import OperatingCandidate, candidates_from_curve
from pipeline.serve.tune.decision import CandidateResult, decide, frontend_worth_tuning, settle, slo_verdict
from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.server.processes import processes_of
from pipeline.serve.tune.tuner import ServedModel
from pipeline.serve.tune.tuning import Contender, TuneSettings, tune, tuned_derivation, variant_contest
from tests.serve.test_torchserve import DERIVED

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")

# Every call sleeps fixed_ms + per_item_ms × batch: a model with a per-call cost.
COST_HANDLER = '''
import json
import time


class CostHandler:
    def initialize(self, context):
        cfg = (context.model_yaml_config or {}).get("handler") or {}
        self.fixed_s = float(cfg.get("fixed_ms", 20)) / 1000.0
        self.item_s = float(cfg.get("per_item_ms", 0)) / 1000.0

    def handle(self, data, context):
        time.sleep(self.fixed_s + self.item_s * len(data))
        out = []
        for row in data:
            body = row.get("body") if row.get("body") is not None else row.get("data")
            if isinstance(body, (bytes, bytearray)):
                body = json.loads(body.decode("utf-8"))
            out.append([2 * x for x in body])
        return out
'''

CASES = [HttpCase(f"c{i}", "application/json", json.dumps([i, 1, 2]).encode(), [2 * i, 2, 4]) for i in range(8)]


def _cand(name, batch, delay=1, workers=1, threads=1, origin="larger batch", predicted=None):
    return OperatingCandidate(name, batch, delay, workers, threads, origin, predicted=predicted)


def _result(c, rounds):
    return CandidateResult(c, [{"ok": True, "throughput_rps": tp, "p99_ms": p99, "p50_ms": p99 / 2,
                                "batch_sizes_seen": {str(c.batch_size): 3}} for tp, p99 in rounds])


# --------------------------------------------------------------------------- pure logic
def test_frontend_is_tuned_only_where_the_server_loses_throughput_outside_the_model():
    """bert-large's chosen point served 34.1 of the 34.3 req/s predicted: nothing for a frontend
    setting to win, so its six server starts are saved; MiniLM's 300 of 558 req/s: worth serving."""
    big = _result(_cand("batch 4", 4, predicted={"throughput_rps": 34.3}), [(34.0, 570.0), (34.2, 580.0)])
    worth, why = frontend_worth_tuning(big)
    assert not worth and "34.1 req/s of the 34.3" in why and "not served" in why
    small = _result(_cand("offline", 8, predicted={"throughput_rps": 558.2}), [(296.0, 90.0), (308.0, 86.0)])
    worth, why = frontend_worth_tuning(small)
    assert worth and "loses 46%" in why
    worth, why = frontend_worth_tuning(_result(_cand("1 worker", 2), [(20.0, 900.0)]))
    assert worth and "no offline prediction" in why


def test_candidates_from_curve_offline_first_then_larger_batches_and_the_other_layout():
    curve = [CurvePoint(b, p50_ms=5.0 * b, p99_ms=6.0 * b, throughput_sps=100.0 + 20 * b) for b in (1, 2, 4, 8, 16)]
    offline = {"batch_size": 2, "max_batch_delay_ms": 3, "workers": 2, "threads_per_worker": 1}
    cands = candidates_from_curve(curve, offline, slo_ms=200, headroom_share=0.5, expected_concurrency=16,
                                  cores=2, bench_threads=1)
    assert cands[0].origin == "offline" and (cands[0].batch_size, cands[0].delay_ms) == (2, 3)
    assert [c.batch_size for c in cands if c.origin == "larger batch"] == [4, 8]     # fill bound 16 // 2
    layout = [c for c in cands if c.origin == "layout"]
    assert len(layout) == 1 and (layout[0].workers, layout[0].threads) == (1, 2)
    assert layout[0].predicted is None          # the curve was measured at 1 thread: no prediction at 2
    assert cands[0].predicted == {"request_p99_ms": 15.0, "throughput_rps": 280.0}
    # Overridden settings stay fixed: no other batch, no other layout.
    fixed = candidates_from_curve(curve, offline, slo_ms=200, headroom_share=0.5, expected_concurrency=16, cores=2,
                                  bench_threads=1, overridden=frozenset({"batch_size", "workers"}))
    assert [c.origin for c in fixed] == ["offline", "shorter delay"] and fixed[1].delay_ms == 1
    assert [c.origin for c in cands] == ["offline", "larger batch", "larger batch", "shorter delay", "layout"]


def test_an_offline_batch_at_the_fill_bound_is_also_tried_at_half_with_the_next_batch_queued():
    curve = [CurvePoint(b, p50_ms=1.0 * b, p99_ms=1.2 * b, throughput_sps=500.0 + 20 * b) for b in (1, 2, 4, 8, 16)]
    offline = {"batch_size": 8, "max_batch_delay_ms": 5, "workers": 2, "threads_per_worker": 1}
    cands = candidates_from_curve(curve, offline, slo_ms=200, headroom_share=0.5, expected_concurrency=16,
                                  cores=2, bench_threads=1)
    queued = [c for c in cands if c.origin == "queued batch"]
    assert len(queued) == 1 and (queued[0].batch_size, queued[0].workers) == (4, 2)
    assert queued[0].predicted["throughput_rps"] == 2 * 580.0
    # Below the fill bound, batches already queue: no such candidate.
    below = candidates_from_curve(curve, {**offline, "batch_size": 4}, slo_ms=200, headroom_share=0.5,
                                  expected_concurrency=16, cores=2, bench_threads=1)
    assert "queued batch" not in [c.origin for c in below]


def test_decide_keeps_the_offline_choice_within_noise_and_replaces_it_beyond():
    off, big = _cand("offline", 1, origin="offline"), _cand("batch 8", 8)
    # +4% with 10% round spread: noise → the offline one stays.
    d = decide([_result(off, [(100, 50), (110, 50)]), _result(big, [(105, 40), (113, 40)])],
               objective="throughput", slo_ms=100, min_gain=0.05)
    assert d["chosen"] == 0 and d["slo_met"] and "stays" in d["steps"][-1]
    # +80%, steady rounds: replaced.
    d = decide([_result(off, [(100, 50), (101, 50)]), _result(big, [(180, 60), (182, 60)])],
               objective="throughput", slo_ms=100, min_gain=0.05)
    assert d["chosen"] == 1 and "taken" in d["steps"][-1]
    # Faster but over the SLO: not taken.
    d = decide([_result(off, [(100, 50), (101, 50)]), _result(big, [(180, 160), (182, 160)])],
               objective="throughput", slo_ms=100, min_gain=0.05)
    assert d["chosen"] == 0
    # Objective latency: the lowest served p99 beyond the noise.
    d = decide([_result(off, [(100, 50), (101, 50)]), _result(big, [(180, 30), (182, 31)])],
               objective="latency", slo_ms=100, min_gain=0.05)
    assert d["chosen"] == 1


def test_the_noise_band_shrinks_with_rounds_and_an_undecided_challenger_gets_more():
    """spread = 2 standard errors of the mean (the range for 2 rounds): the same scatter over more
    rounds narrows it. A challenger better by more than min_gain but within the band is 'undecided';
    settle() serves it and the incumbent more rounds until the band decides, up to max_rounds."""
    off, big = _cand("offline", 4, origin="offline"), _cand("batch 8", 8)
    two = _result(off, [(100, 50), (120, 50)])
    assert two.spread("throughput_rps") == pytest.approx(20 / 110)
    four = _result(off, [(100, 50), (120, 50), (100, 50), (120, 50)])
    assert four.spread("throughput_rps") < 0.7 * two.spread("throughput_rps")
    # +12.7% against a 15.7% band (the AVX2 contest): undecided after 2 rounds.
    results = [_result(off, [(239, 50), (205, 50)]), _result(big, [(246, 50), (254, 50)])]
    d = decide(results, objective="throughput", slo_ms=100, min_gain=0.05)
    assert d["chosen"] == 0 and d["undecided"] == [1]
    served_rounds = []
    more = {0: [(231, 50), (226, 50)], 1: [(262, 50), (258, 50)]}     # the next rounds, as the server answers

    def measure_round(idx, round_no):
        served_rounds.append((tuple(idx), round_no))
        for i in idx:
            tp, p99 = more[i].pop(0)
            results[i].rounds.append({"ok": True, "throughput_rps": tp, "p99_ms": p99, "p50_ms": p99 / 2,
                                      "round": round_no})

    redecide = lambda: decide(results, objective="throughput", slo_ms=100, min_gain=0.05)  # noqa: E731
    d, extra = settle(results, redecide, measure_round, rounds_done=2, max_rounds=4)
    assert d["chosen"] == 1 and "taken" in d["steps"][-1] and served_rounds[0] == ((0, 1), 3)
    assert extra == len(served_rounds) <= 2 and d["steps"][0].startswith(f"round {2 + extra} served")
    # Nothing undecided (worse, or better beyond the noise): no extra round.
    steady = [_result(off, [(100, 50), (101, 50)]), _result(big, [(180, 50), (182, 50)])]
    d = decide(steady, objective="throughput", slo_ms=100, min_gain=0.05)
    assert d["undecided"] == [] and settle(steady, lambda: decide(steady, objective="throughput", slo_ms=100,
                                                                  min_gain=0.05),
                                           measure_round, rounds_done=2, max_rounds=4)[1] == 0
    # max_rounds bounds it: still undecided at the cap, the incumbent stays.
    noisy = [_result(off, [(100, 50), (130, 50)]), _result(big, [(112, 50), (140, 50)])]
    more = {0: [(100, 50)] * 5, 1: [(140, 50)] * 5}
    results = noisy
    d = decide(noisy, objective="throughput", slo_ms=100, min_gain=0.05)
    assert d["undecided"] == [1]
    d, extra = settle(noisy, redecide, measure_round, rounds_done=2, max_rounds=3)
    assert extra == 1 and d["chosen"] == 0 and d["undecided"] == [1]


def test_verdict_follows_the_served_p99_not_the_prediction():
    c = _cand("offline", 2, origin="offline", predicted={"request_p99_ms": 25.0, "throughput_rps": 300.0})
    r = _result(c, [(160, 140), (168, 144)])
    v = slo_verdict(r, [r], slo_ms=100, expected_concurrency=16,
                    capacity={"levels": [], "inflight_within_slo": 8}, predicted_p99_ms=25.0)
    assert v["slo_met"] is False and v["predicted_request_p99_ms"] == 25.0
    assert v["littles_law_floor_ms"] == pytest.approx(16 / 164 * 1000, rel=1e-3)    # mean of the rounds
    assert v["replicas"] == 2 and "ceil(16 / 8) = 2" in v["message"] and "Little's law" in v["message"]
    ok = slo_verdict(r, [r], slo_ms=150, expected_concurrency=16)
    assert ok["slo_met"] is True and ok["served_p99_ms"] == pytest.approx(142)


def test_tuned_derivation_keeps_offline_beside_served_and_respects_overrides():
    configured = {k: {"value": v, "formula": "offline", "inputs": {}, "overridden": False}
                  for k, v in (("batch_size", 2), ("max_batch_delay_ms", 3), ("workers", 2), ("threads_per_worker", 1))}
    configured["workers"]["overridden"] = True
    configured["job_queue_size"] = {"value": 32, "formula": "q", "inputs": {"expected_concurrency": 16},
                                    "overridden": False}
    record = {"chosen": {"batch_size": 8, "max_batch_delay_ms": 5, "workers": 2, "threads_per_worker": 1},
              "chosen_name": "batch 8", "slo_met": True, "served_p99_ms": 50.0, "served_throughput_rps": 300.0,
              "decision_steps": ["x"], "frontend": None,
              "candidates": [{"name": "batch 8", "settings": {}, "predicted": None, "throughput_rps": 300.0,
                              "p99_ms": 50.0, "meets_slo": True, "throughput_spread": 0.01, "batches_formed": {}}]}
    d = tuned_derivation(configured, record)
    assert d["batch_size"]["value"] == 8 and d["batch_size"]["inputs"]["offline"]["value"] == 2
    assert d["batch_size"]["inputs"]["served"]["served_throughput_rps"] == 300.0
    assert d["threads_per_worker"]["confirmed_offline"] is True
    assert d["workers"] == configured["workers"]           # overridden: untouched
    assert d["job_queue_size"]["value"] == 32 and d["disable_system_metrics"]["value"] is None


TENSOR_MODEL = {"name": "signalnet", "source": "state_dict", "checkpoint": "examples/tensor/weights.safetensors",
                "factory": "examples/tensor/model.py:build", "task": "tensor", "input_shape": [16, 32]}


def _proposal(tmp_path, monkeypatch, params, benchmark, env):
    """configure's derivation for `benchmark` (artifacts/configured/derivation.json) and the benchmark
    where the tune stage reads it (metrics/benchmark/<variant>.json); returns (folder, derivation)."""
    import stages.tune as stage
    from pipeline.decide.serve_config import derivation_as_dict, derive_serve_config
    configured = derivation_as_dict(derive_serve_config(benchmark, env, params.serve))
    proposal = tmp_path / "configured"
    proposal.mkdir()
    (proposal / "derivation.json").write_text(json.dumps(configured))
    bench_dir = tmp_path / "benchmark"
    bench_dir.mkdir()
    (bench_dir / f"{benchmark['variant']}.json").write_text(json.dumps(benchmark))
    monkeypatch.setattr(stage, "BENCHMARK_METRICS", bench_dir)
    return proposal, configured


def _served_yaml(tmp_path, configured, c) -> dict:
    """The model-config.yaml the tuner serves candidate `c` with (configure's yaml as its base)."""
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    base = {"batchSize": configured["batch_size"]["value"], "responseTimeout": configured["response_timeout_s"]["value"],
            "startupTimeout": configured["startup_timeout_s"]["value"], "handler": {"threads": 1}}
    ServedModel(tmp_path, "m", "m", tmp_path / "config.properties", base).write_yaml(c)
    return yaml.safe_load((folder / "model-config.yaml").read_text())


def _tuning_record(c) -> dict:
    """A tuning record (as `tune` writes it) whose served choice is `c`."""
    from pipeline.serve.tune.tuning import chosen_record
    return {**chosen_record(c), "slo_met": False, "served_p99_ms": 3100.0, "served_throughput_rps": 10.0,
            "decision_steps": ["x"], "frontend": None,
            "candidates": [{"name": c.name, "settings": c.settings(), "predicted": None, "throughput_rps": 10.0,
                            "p99_ms": 3100.0, "meets_slo": False, "throughput_spread": 0.01, "batches_formed": {}}]}


def test_a_larger_batch_is_served_and_recorded_with_timeouts_for_its_own_batch(tmp_path, make_params, monkeypatch):
    """The tuner kept configure's timeouts, derived for the offline batch 1 (5 s): a candidate batch of
    32 (p99 3 s) ran past that responseTimeout (5xx), and once adopted, the tuned derivation.json
    explained timeouts of a point that was not served."""
    import stages.tune as stage
    params = make_params(TENSOR_MODEL, serve={"latency_slo_ms": 100, "expected_concurrency": 32},
                         tune={"max_candidates": 5})
    env = {"device": "cpu", "memory_mb": 8000, "cpu": {"model": "x", "physical_cores": 1, "logical_cores": 1}}
    from tests.decide.test_serve_config import bench
    benchmark = bench({1: (5.0, 200.0), 32: (3000.0, 900.0)}, variant="torchscript")
    proposal, configured = _proposal(tmp_path, monkeypatch, params, benchmark, env)
    assert configured["batch_size"]["value"] == 1 and configured["response_timeout_s"]["value"] == 5
    cands, _ = stage.operating_candidates(params, env, proposal, "torchscript")
    offline, big = cands[0], next(c for c in cands if c.batch_size == 32)
    # Served: batch 32's p99 × the safety factor configure uses (+ its delay), not batch 1's.
    need_s = benchmark["steady"]["32"]["p99_ms"] * params.serve.response_safety / 1000.0
    served = _served_yaml(tmp_path, configured, big)
    assert served["batchSize"] == 32 and served["responseTimeout"] >= need_s > configured["response_timeout_s"]["value"]
    assert served["responseTimeout"] == math.ceil((3000.0 * params.serve.response_safety + big.delay_ms) / 1000)
    assert served["startupTimeout"] == big.timeouts["startup_timeout_s"]["value"] > configured["startup_timeout_s"]["value"]
    assert big.timeouts["startup_timeout_s"]["inputs"]["warmup_ms"] == 3000.0       # the warm-up call at 32
    assert big.settings()["response_timeout_s"] == served["responseTimeout"]      # in tuning.json's candidates
    # The offline point keeps exactly configure's timeouts.
    assert {k: offline.timeouts[k]["value"] for k in offline.timeouts} == \
        {k: configured[k]["value"] for k in ("response_timeout_s", "startup_timeout_s")}
    off_yaml = _served_yaml(tmp_path, configured, offline)
    assert (off_yaml["responseTimeout"], off_yaml["startupTimeout"]) == (5, configured["startup_timeout_s"]["value"])
    # Adopted: the tuned derivation carries the served point's timeouts, formula and inputs included.
    d = tuned_derivation(configured, _tuning_record(big))
    rt = d["response_timeout_s"]
    assert rt["value"] == served["responseTimeout"] and rt["confirmed_offline"] is False
    assert rt["inputs"]["batch_p99_ms"] == 3000.0 and rt["inputs"]["response_safety"] == params.serve.response_safety
    assert rt["inputs"]["candidate"]["batch_size"] == 32 and rt["inputs"]["offline"]["value"] == 5
    assert "response_safety" in rt["formula"] and "served point" in rt["formula"]
    assert d["startup_timeout_s"]["value"] == served["startupTimeout"]
    # serve.overrides still win: an overridden timeout is served and recorded as the user set it.
    params = make_params(TENSOR_MODEL, serve={"latency_slo_ms": 100, "expected_concurrency": 32,
                                              "overrides": {"response_timeout_s": 9}}, tune={"max_candidates": 5})
    (tmp_path / "ov").mkdir()
    proposal, configured = _proposal(tmp_path / "ov", monkeypatch, params, benchmark, env)
    cands, _ = stage.operating_candidates(params, env, proposal, "torchscript")
    big = next(c for c in cands if c.batch_size == 32)
    assert _served_yaml(tmp_path / "ov", configured, big)["responseTimeout"] == 9
    d = tuned_derivation(configured, _tuning_record(big))
    assert d["response_timeout_s"] == configured["response_timeout_s"] and d["response_timeout_s"]["value"] == 9
    assert d["startup_timeout_s"]["value"] == big.timeouts["startup_timeout_s"]["value"]


def test_a_layout_with_fewer_threads_per_worker_gets_timeouts_for_its_slower_calls(tmp_path, make_params,
                                                                                 monkeypatch):
    """The curve measured one worker at 4 threads; the other layout runs 4 workers × 1 thread, each
    call up to 4 × slower: its responseTimeout covers that, the offline 1 × 4 keeps configure's."""
    import stages.tune as stage
    from tests.decide.test_serve_config import bench
    params = make_params(TENSOR_MODEL, serve={"latency_slo_ms": 2000, "expected_concurrency": 4},
                         benchmark={"latency_cap_ms": 2000}, tune={"max_candidates": 5})
    env = {"device": "cpu", "memory_mb": 8000, "cpu": {"model": "x", "physical_cores": 4, "logical_cores": 4}}
    benchmark = bench({1: (1500.0, 0.7), 2: (2900.0, 0.7)}, variant="torchscript", threads=4)
    proposal, configured = _proposal(tmp_path, monkeypatch, params, benchmark, env)
    assert (configured["workers"]["value"], configured["threads_per_worker"]["value"]) == (1, 4)
    cands, _ = stage.operating_candidates(params, env, proposal, "torchscript")
    layout = next(c for c in cands if c.origin == "layout")
    assert (layout.workers, layout.threads, layout.batch_size) == (4, 1, 1)
    rt = layout.timeouts["response_timeout_s"]
    assert rt["value"] == math.ceil((1500.0 * 4 * params.serve.response_safety + layout.delay_ms) / 1000)
    assert rt["inputs"]["thread_scale"] == 4 and rt["inputs"]["curve_p99_ms"] == 1500.0
    assert cands[0].timeouts["response_timeout_s"]["value"] == configured["response_timeout_s"]["value"] == 8
    assert "thread_scale" not in configured["response_timeout_s"]["inputs"]      # configure's own point: unscaled


# --------------------------------------------------------------------------- real TorchServe
@pytest.fixture(scope="module")
def cost_model(tmp_path_factory):
    """The cost handler as a folder-form model + the configure-style config.properties."""
    root = tmp_path_factory.mktemp("tune_model")
    src = root / "src"
    src.mkdir()
    handler = src / "cost_handler.py"
    handler.write_text(COST_HANDLER)
    base_yaml = {"minWorkers": 1, "maxWorkers": 1, "batchSize": 1, "maxBatchDelay": 1, "responseTimeout": 30,
                 "startupTimeout": 30, "handler": {"threads": 1, "fixed_ms": 20, "per_item_ms": 5}}
    (src / "model-config.yaml").write_text(yaml.safe_dump(base_yaml))
    store = root / "store"
    folder = package("cost", handler, {}, store, config_file=src / "model-config.yaml", archive_format="no-archive")
    derived = {**DERIVED, "workers": 1, "job_queue_size": 200, "startup_timeout_s": 30, "response_timeout_s": 30}
    config = write_config_properties(root / "config.properties", derived, model_name="cost", model_store=store)
    return ServedModel(store, "cost", folder.name, config, base_yaml)


def _no_server_left(root):
    """None of this test's servers (their folders under `root`) left running; other runs on the
    host may have theirs up meanwhile."""
    left = processes_of(root)
    assert left == [], f"TorchServe processes left behind: {left}"


@pytest.mark.torchserve
@needs_java
def test_tuner_replaces_the_offline_choice_when_bigger_batches_serve_better(cost_model, tmp_path):
    offline = _cand("offline choice", 1, origin="offline", predicted={"request_p99_ms": 26.0, "throughput_rps": 40.0})
    cands = [offline, _cand("batch 8", 8, delay=5)]
    # max_rounds = rounds: a busy host's noisy round adds none, so the registrations below are the rounds'.
    s = TuneSettings(latency_slo_ms=1000, expected_concurrency=8, rounds=2, max_rounds=2, measure_s=1.0,
                     warmup_requests=8, frontend=False)
    rec = tune(cost_model, CASES, cands, s, workroot=tmp_path / "servers")
    by = {c["name"]: c for c in rec["candidates"]}
    assert by["batch 8"]["throughput_rps"] > 2 * by["offline choice"]["throughput_rps"], rec["candidates"]
    assert rec["chosen"]["batch_size"] == 8 and rec["replaced_offline"] is True
    assert max(int(k) for k in by["batch 8"]["batches_formed"]) > 1          # TorchServe really batched
    assert by["offline choice"]["batches_formed"] == {"1": sum(by["offline choice"]["batches_formed"].values())}
    assert len(by["batch 8"]["rounds"]) == 2 and rec["slo_met"] is True
    # One server for both candidates: the model re-registered between measurements, not restarted.
    assert rec["server_starts"] == 1 and rec["registrations"] == 3
    assert rec["slo_met"] == (rec["served_p99_ms"] <= 1000)
    # The tuning's wall time holds its disjoint phases: the server's start, each re-registration
    # (every round's ready_s: the first is the start) and each measure_s window of load.
    rounds = [r for c in rec["candidates"] for r in c["rounds"]]
    assert all(r["ok"] for r in rounds), [(r["round"], r.get("error")) for r in rounds if not r["ok"]]
    assert round(rounds[0]["ready_s"], 2) == rec["server_start_s"][0]     # the first measurement: the start's READY
    assert sum(r["ready_s"] for r in rounds) + len(rounds) * s.measure_s <= rec["duration_s"] + 0.05
    _assert_throughput_is_requests_over_the_window(rounds, s.measure_s, rec["duration_s"])
    assert rec["predicted_request_p99_ms"] == 26.0          # the prediction stays beside the served figure
    _no_server_left(tmp_path)


@pytest.mark.torchserve
@needs_java
def test_infeasible_slo_is_not_met_with_the_replica_count(cost_model, tmp_path):
    # 8 in flight: a batch of 8 costs 325 ms, so a 200 ms SLO is out of reach at 8 in flight but
    # within reach at a lower load (1 request in flight: 45 ms + the 2 ms delay; wide margins, as
    # a busy host can run this several times slower).
    cands = [_cand("offline choice", 8, delay=2, origin="offline")]
    cost_model = dataclasses.replace(cost_model, base_yaml={
        **cost_model.base_yaml, "handler": {"threads": 1, "fixed_ms": 5, "per_item_ms": 40}})
    s = TuneSettings(latency_slo_ms=200, expected_concurrency=8, rounds=1, measure_s=1.5, warmup_requests=8,
                     frontend=False)
    rec = tune(cost_model, CASES, cands, s, workroot=tmp_path / "servers")
    assert rec["slo_met"] is False and rec["served_p99_ms"] > 200
    assert rec["littles_law_floor_ms"] == pytest.approx(8 / rec["max_served_throughput_rps"] * 1000, rel=1e-3)
    inflight = rec["inflight_within_slo"]
    assert inflight is not None and 1 <= inflight < 8, rec["capacity"]
    assert rec["replicas"] == math.ceil(8 / inflight)
    assert f"replicas = ceil(8 / {inflight}) = {rec['replicas']}" in rec["message"]
    _no_server_left(tmp_path)


@pytest.mark.torchserve
@needs_java
def test_variant_contest_serves_the_offline_tie_and_the_faster_variant_replaces_the_winner(cost_model, tmp_path):
    """Selection's winner ("slow": 60 ms per call) and a variant it could not tell apart offline
    ("fast": 5 ms per call) served at the same point: the server decides, beyond the noise."""
    def variant(name: str, fixed_ms: float) -> ServedModel:
        store = tmp_path / name
        shutil.copytree(cost_model.store, store)
        return dataclasses.replace(cost_model, store=store, base_yaml={
            **cost_model.base_yaml, "handler": {"threads": 1, "fixed_ms": fixed_ms, "per_item_ms": 0}})

    point = _cand("offline choice", 1, origin="offline")
    entries = [Contender("slow", variant("slow", 60), point), Contender("fast", variant("fast", 5), point)]
    s = TuneSettings(latency_slo_ms=5000, expected_concurrency=4, rounds=2, measure_s=1.0, warmup_requests=4,
                     frontend=False)
    rec = variant_contest(entries, CASES, s, workroot=tmp_path / "contest")
    by = {c["variant"]: c for c in rec["candidates"]}
    assert rec["contenders"] == ["slow", "fast"] and len(by["fast"]["rounds"]) == 2
    assert by["fast"]["throughput_rps"] > 2 * by["slow"]["throughput_rps"], rec["candidates"]
    assert rec["chosen"] == "fast" and rec["replaced_selection"] is True
    assert any("beyond the noise" in step and "taken" in step for step in rec["decision_steps"])
    assert rec["server_starts"] == 4           # a fresh server per measurement
    rounds = [r for c in rec["candidates"] for r in c["rounds"]]
    assert sum(r["ready_s"] for r in rounds) + len(rounds) * s.measure_s <= rec["duration_s"] + 0.05
    _assert_throughput_is_requests_over_the_window(rounds, s.measure_s, rec["duration_s"])
    _no_server_left(tmp_path)


def _assert_throughput_is_requests_over_the_window(rounds: list[dict], measure_s: float, duration_s: float) -> None:
    """Each round's throughput is its answered requests over its load's wall time, and that wall
    time is at least the measure_s window (no request is started after it) and inside the tuning."""
    for r in rounds:
        wall_s = r["requests_ok"] / r["throughput_rps"]
        assert measure_s <= wall_s <= duration_s, r


def test_the_contenders_are_selections_tie_closest_first():
    from pipeline.decide.selection import tied_contenders
    selection = {"winner": "onnx", "tie_break": {"within_noise": [
        {"variant": "onnx-int8-dynamic", "relative_gap": 0.0}, {"variant": "int8", "relative_gap": 0.15},
        {"variant": "onnx", "relative_gap": 0.23}, {"variant": "onnx-int8-static", "relative_gap": 0.04}]}}
    assert tied_contenders(selection) == ["onnx-int8-dynamic", "onnx-int8-static", "int8"]
    assert tied_contenders({"winner": "onnx", "tie_break": None}) == []


# --------------------------------------------------------------------------- the stage, end to end
def _stage_inputs(tmp_path, tensor_params, monkeypatch, serve: dict) -> dict:
    """artifacts/ as select + configure leave them for the committed tensor example (torchscript
    winner, the project's torch handler), params with `serve`, the stage's paths pointed there."""
    import stages.configure as configure
    import stages.tune as stage
    from pipeline.model.golden import write_golden
    from pipeline.model.checkpoint import load_model
    from tests.serve.test_archive import build_stage_inputs

    art = tmp_path / "artifacts"
    inputs = build_stage_inputs(art, tensor_params)
    golden = art / "golden"
    write_golden(tensor_params, load_model(tensor_params), golden)
    bench_dir = tmp_path / "metrics" / "benchmark"
    bench_dir.mkdir(parents=True)
    curve = {str(b): {"batch_size": b, "p50_ms": 1.0 + 0.2 * b, "p99_ms": 2.0 + 0.3 * b,
                      "throughput_sps": 1000.0 * b / (1.0 + 0.2 * b), "cv": 0.02, "peak_rss_mb": 300.0}
             for b in (1, 2, 4)}
    (bench_dir / "torchscript.json").write_text(json.dumps({
        "variant": "torchscript", "status": "ok", "device": "cpu", "threads": 1, "artifact_bytes": 100000,
        "steady": curve, "cold_load": {"phases_ms": {"total": {"median": 300.0, "max": 400.0}}}}))
    env = art / "env.json"
    env.write_text(json.dumps({"device": "cpu", "memory_mb": 8000,
                               "cpu": {"model": "test", "physical_cores": 1, "logical_cores": 1, "usable_cpus": 1}}))
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({
        "model": {"name": "signalnet", "source": "state_dict", "checkpoint": "examples/tensor/weights.safetensors",
                  "factory": "examples/tensor/model.py:build", "task": "tensor", "input_shape": [16, 32]},
        "variants": ["eager", "torchscript"], "serve": serve,
        "tune": {"rounds": 1, "measure_s": 1.0, "warmup_requests": 4, "max_candidates": 2, "frontend": False}}))
    monkeypatch.setenv("PIPELINE_PARAMS", str(params))
    configured = art / "configured"
    assert configure.main(["--out", str(configured), "--selection", str(inputs["selection_path"]),
                           "--benchmarks-dir", str(bench_dir), "--env", str(env), "--golden", str(golden),
                           "--model-store", str(art / "model_store")]) == 0
    paths = {"SELECTION_JSON": inputs["selection_path"], "CONFIGURED_DIR": configured, "ENV_JSON": env,
             "GOLDEN_DIR": golden, "BENCHMARK_METRICS": bench_dir, "VARIANTS_DIR": inputs["variants_dir"],
             "SERVE_DIR": art / "serve_tuned", "TUNING_METRICS": tmp_path / "metrics" / "tuning.json",
             "MODEL_STORE": art / "model_store"}
    for name, value in paths.items():
        monkeypatch.setattr(stage, name, value)
    return paths


@pytest.mark.torchserve
@needs_java
def test_stage_require_slo_fails_with_the_served_reason(tmp_path, tensor_params, monkeypatch, capsys):
    """An SLO no server meets (0.5 ms at 16 in flight): served verdict false, replicas reasoned,
    the tuned files still written for inspection, and require_slo fails the stage with the message."""
    import tempfile

    import stages.tune as stage
    # The stage's servers in a folder of this test's own, short (a worker's socket path has a length limit).
    servers = tempfile.mkdtemp(prefix="tune-test-")
    monkeypatch.setattr(tempfile, "tempdir", servers)
    paths = _stage_inputs(tmp_path, tensor_params, monkeypatch,
                          {"latency_slo_ms": 0.5, "require_slo": True, "expected_concurrency": 4})
    assert stage.main([]) == 1
    err = capsys.readouterr().err
    assert "SLO NOT met in TorchServe" in err and "serve.require_slo is true" in err and "Little's law" in err
    rec = json.loads((paths["SERVE_DIR"] / "tuning.json").read_text())
    assert rec["slo_met"] is False and rec["served_p99_ms"] > 0.5
    assert rec["capacity"]["levels"] and rec["inflight_within_slo"] is None    # not even 1 in flight fits
    # Memory holds every candidate's workers: one server each, all up together, no re-registration;
    # the capacity measurement runs on the chosen point's server, still up.
    assert rec["settings"]["side_by_side"] and rec["registrations"] == 0
    assert rec["server_starts"] == len(rec["candidates"]) and rec["servers_reused"] >= 1
    metrics = json.loads(paths["TUNING_METRICS"].read_text())
    assert metrics["slo_met"] is False and metrics["duration_s"] == rec["duration_s"]
    # Every server start (side by side, then the capacity one) and every measured window of load
    # (1 s each: a round per candidate, then each capacity level) lie inside the tuning's wall time.
    windows = sum(1 for c in rec["candidates"] for r in c["rounds"] if r["ok"]) + \
        sum(1 for level in rec["capacity"]["levels"] if level["ok"])
    assert len(rec["server_start_s"]) == rec["server_starts"]
    assert sum(rec["server_start_s"]) + windows * 1.0 <= rec["duration_s"] + 0.1
    d = json.loads((paths["SERVE_DIR"] / "derivation.json").read_text())
    assert "offline" in d["batch_size"]["inputs"] and "served" in d["batch_size"]["inputs"]
    for f in ("model-config.yaml", "config.properties", "start_command.txt"):
        assert (paths["SERVE_DIR"] / f).is_file()
    _no_server_left(servers)
    shutil.rmtree(servers, ignore_errors=True)


def test_when_nothing_meets_the_slo_the_incumbent_stays_within_noise():
    off, alt = _cand("offline", 8, origin="offline"), _cand("no metrics", 8, origin="frontend")
    d = decide([_result(off, [(100, 300), (110, 330)]), _result(alt, [(105, 280), (112, 300)])],
               objective="throughput", slo_ms=200, min_gain=0.05)
    assert d["chosen"] == 0 and not d["slo_met"] and "offline is served" in d["steps"][-1]
    d = decide([_result(off, [(100, 300), (101, 302)]), _result(alt, [(105, 210), (106, 212)])],
               objective="throughput", slo_ms=200, min_gain=0.05)
    assert d["chosen"] == 1 and not d["slo_met"]


def test_when_nothing_meets_the_slo_more_throughput_at_no_worse_p99_is_taken():
    # measured at SLO 14 ms: batch 1 (the offline choice) 151 req/s / p99 148 ms, batch 8 252 req/s / 114 ms
    off, big = _cand("offline", 1, origin="offline"), _cand("batch 8", 8)
    # (here batch 8's p99 is within the noise of the offline choice's, so only its throughput decides)
    d = decide([_result(off, [(150, 145), (152, 151)]), _result(big, [(250, 140), (254, 150)])],
               objective="throughput", slo_ms=14, min_gain=0.05)
    assert d["chosen"] == 1 and not d["slo_met"] and "batch 8: throughput" in d["steps"][-1]
    # more throughput but a p99 worse beyond the noise: the incumbent stays
    d = decide([_result(off, [(150, 145), (152, 151)]), _result(big, [(250, 300), (254, 310)])],
               objective="throughput", slo_ms=14, min_gain=0.05)
    assert d["chosen"] == 0


@pytest.mark.torchserve
@needs_java
def test_a_measurement_that_raises_is_made_again_on_a_fresh_registration(cost_model, tmp_path):
    """The model unregistered behind the tuner's back after the first measurement: the next
    candidate's registration fails (nothing to unregister), is made again, and is measured; the
    record keeps the first attempt's error."""
    from pipeline.serve.server.torchserve_http import ServerApi, read_properties
    from pipeline.serve.tune.tuner import Tuner
    workroot = tmp_path / "servers"
    unregistered = []

    def unregister_once():
        if unregistered:
            return
        wd = workroot / "server-1"
        props = read_properties(wd / "config.properties")
        port = {k: int(props[k].rsplit(":", 1)[1]) for k in ("inference_address", "management_address")}
        api = ServerApi(wd, port["inference_address"], port["management_address"], "cost")
        unregistered.append(api.management("DELETE", "/models/cost", timeout_s=60).status)

    tuner = Tuner(cost_model, CASES, concurrency=4, measure_s=0.5, warmup_requests=4, workroot=workroot,
                  progress=unregister_once)
    try:
        results = tuner.run_rounds([_cand("batch 1", 1), _cand("batch 4", 4, delay=5)], 1)
    finally:
        tuner.close()
    assert unregistered == [200]
    first, second = results[0].rounds, results[1].rounds
    assert len(first) == 1 and first[0]["ok"] and "retried_after" not in first[0]
    assert len(second) == 1 and second[0]["ok"], second
    assert "unregistering cost" in second[0]["retried_after"] and "404" in second[0]["retried_after"]
    assert tuner.starts == 1 and tuner.registrations == 1
    _no_server_left(tmp_path)
