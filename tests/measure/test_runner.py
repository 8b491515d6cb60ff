"""The harness end to end on tiny variants: cold load in real fresh processes, steady-state rounds
in several of them, the benchmark stage's outputs, and a failing / unconverted variant recorded
without raising.

Two tiny variants: a TorchScript MLP behind a loader written here (the harness is generic over
the loader), and an ONNX MatMul loaded by the real handlers.runtimes + task adapter.
"""
import dataclasses
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.measure.cold import (BenchmarkChildError, artifact_files, measure_fresh_processes, raw_read_seconds,
                                   run_fresh_process)
from pipeline.measure.runner import (BenchmarkSettings, benchmark_or_record, benchmark_variant, combine_rounds, curve_rows,
                                     host_reference, load_rows, repeat_sizes)
from pipeline.core.params import parse_params

TINY_LOADER = textwrap.dedent('''
    import io, time
    from pathlib import Path
    import numpy as np

    class TinyRuntime:
        def __init__(self, model_dir, threads):
            t0 = time.perf_counter()
            import torch
            self.torch = torch
            if threads:
                torch.set_num_threads(threads)
            t1 = time.perf_counter()
            data = (Path(model_dir) / "model.pt").read_bytes()
            t2 = time.perf_counter()
            self.model = torch.jit.load(io.BytesIO(data))
            t3 = time.perf_counter()
            self.load_phases = {"import": t1 - t0, "read": t2 - t1, "deserialize": t3 - t2, "to_device": 0.0}

        def run(self, feeds):
            with self.torch.inference_mode():
                return [self.model(self.torch.from_numpy(feeds["input"])).numpy()]

    def load(model_dir, device="cpu", threads=None):
        return TinyRuntime(model_dir, threads)

    def load_broken(model_dir, device="cpu", threads=None):
        raise RuntimeError("deserialization failed: corrupt artifact")

    def load_segfaulting(model_dir, device="cpu", threads=None):
        rt = TinyRuntime(model_dir, threads)
        plain = rt.run

        def run(feeds):   # fine at batch 1 (the cold first call), kills the interpreter beyond
            if feeds["input"].shape[0] > 1:
                import os, signal
                os.kill(os.getpid(), signal.SIGSEGV)
            return plain(feeds)
        rt.run = run
        return rt

    def feeds(model_dir, batch_size, seq_len=None):
        return {"input": np.random.default_rng(batch_size).standard_normal((batch_size, 16), dtype=np.float32)}
''')


def _write_variant(folder: Path, variant: dict, status="converted"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "variant.json").write_text(json.dumps(variant))
    (folder / "conversion.json").write_text(json.dumps({"variant": variant["variant"], "status": status,
                                                        "reason": None if status == "converted" else "too slow"}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A TorchScript MLP variant + the loader/feeds specs that run it."""
    root = tmp_path_factory.mktemp("tiny")
    loader_file = root / "tiny_loader.py"
    loader_file.write_text(TINY_LOADER)
    folder = root / "variants" / "torchscript"
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).eval()
    folder.mkdir(parents=True)
    torch.jit.save(torch.jit.trace(model, torch.randn(2, 16)), str(folder / "model.pt"))
    _write_variant(folder, {"variant": "torchscript", "family": "torch", "format": "torchscript",
                            "artifact": "model.pt", "dtype": "float32", "files": ["model.pt"],
                            "task": {"kind": "tensor", "input_shape": [16]}})
    return {"root": root, "dir": folder, "loader": f"{loader_file}:load", "broken": f"{loader_file}:load_broken",
            "segfault": f"{loader_file}:load_segfaulting",
            "feeds": f"{loader_file}:feeds"}


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    """An ONNX variant loadable by the real handlers.runtimes, tensor task (input 'input', 8 floats)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    folder = tmp_path_factory.mktemp("onnx") / "onnx"
    folder.mkdir()
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["input", "w"], ["output"])], "tiny",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 4])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9),
              str(folder / "model.onnx"))
    _write_variant(folder, {"variant": "onnx", "family": "onnx", "format": "onnx", "artifact": "model.onnx",
                            "dtype": "float32", "device": "cpu", "inputs": [{"name": "input", "dtype": "float32"}],
                            "outputs": [{"name": "output"}], "task": {"kind": "tensor", "input_shape": [8]},
                            "files": ["model.onnx"]})
    return folder


FAST = BenchmarkSettings(batch_sizes=(1, 2, 4), cold_runs=3, steady_runs=2, warmup_iters=2, min_iters=10,
                         min_duration_s=0.05, max_cv=10.0, min_gain=-1.0, latency_cap_ms=10_000)


def test_cold_start_in_a_fresh_process_times_every_phase(tiny):
    run = run_fresh_process(tiny["dir"], tiny["loader"], tiny["feeds"], threads=1)
    phases = run.phases
    assert run.steady is None                                   # no round asked: cold start only
    for name in ("interpreter", "import", "read", "deserialize", "to_device", "adapter", "first_call", "total"):
        assert phases[name] >= 0, name
    # a fresh process pays the torch import; this test process has torch already
    assert phases["import"] > phases["read"]
    assert phases["total"] >= sum(v for k, v in phases.items() if k != "total") * 0.95


def test_cold_load_over_runs_with_raw_read_floor(tiny):
    files = artifact_files(tiny["dir"], json.loads((tiny["dir"] / "variant.json").read_text()))
    assert files == [tiny["dir"] / "model.pt"]
    runs = measure_fresh_processes(tiny["dir"], 2, files, tiny["loader"], tiny["feeds"], threads=1)
    c = runs.cold
    assert runs.rounds == []
    assert c.runs == 2 and c.artifact_bytes == (tiny["dir"] / "model.pt").stat().st_size
    assert c.raw_read_s > 0 and c.floor_ratios()["load"] > 0
    assert c.phases["total"].max_s >= c.phases["total"].median_s


def test_cold_load_from_disk_is_one_more_fresh_process(tiny):
    files = artifact_files(tiny["dir"], json.loads((tiny["dir"] / "variant.json").read_text()))
    runs = measure_fresh_processes(tiny["dir"], 1, files, tiny["loader"], tiny["feeds"], threads=1, from_disk=True)
    assert runs.cold.runs == 1
    d = runs.disk.as_dict()
    assert d["measured"], d
    assert d["resident_after_drop"] <= 0.05 and d["raw_read_ms"] > 0
    assert d["load_ms"] > 0 and d["total_ms"] > d["load_ms"] and set(d["phases_ms"]) >= {"import", "first_call"}
    assert measure_fresh_processes(tiny["dir"], 1, files, tiny["loader"], tiny["feeds"], threads=1).disk is None


def test_cold_load_failure_names_the_cause(tiny):
    with pytest.raises(BenchmarkChildError, match="corrupt artifact"):
        run_fresh_process(tiny["dir"], tiny["broken"], tiny["feeds"])


def test_raw_read_reads_every_byte(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(b"x" * (3 * 2**20 + 7))
    assert raw_read_seconds([f], repeats=2, chunk=2**20) > 0


def test_benchmark_variant_with_a_tiny_torch_model(tiny):
    r = benchmark_or_record(tiny["dir"], "torchscript", FAST, "cpu", tiny["loader"], tiny["feeds"])
    assert r["status"] == "ok", r["reason"]
    assert r["threads"] == 1 and r["device"] == "cpu"          # threads 0 → one serving worker's share
    assert list(r["steady"]) == ["1", "2", "4"] and r["stopped_early"] is None
    for b, s in r["steady"].items():
        # two rounds (fresh processes), pooled: at least min_iters from each
        assert s["batch_size"] == int(b) and s["rounds"] == 2 and s["iters"] >= 20
        assert len(s["round_p50_ms"]) == 2 and s["spread"] >= 0
        assert min(s["round_p50_ms"]) <= s["p50_ms"] * 1.001 and s["p50_ms"] <= s["p99_ms"]
        # `noisy` depends on how busy the shared host was: recorded, not asserted
        assert s["peak_rss_mb"] > 0 and s["peak_gpu_mb"] is None and isinstance(s["noisy"], bool)
        assert 0 < s["cpu_share"] <= 1.5
        # both figures are rounded to 4 decimals in the record
        assert s["p50_ref"] == pytest.approx(s["p50_ms"] / r["host_reference"]["median_ms"], rel=1e-3, abs=1e-4)
    # the host reference was timed in both rounds: before the first size and after each size / pass
    ref = r["host_reference"]
    assert ref["median_ms"] > 0 and len(ref["round_median_ms"]) == 2 and ref["drift"] >= 0
    # three fresh processes: all three cold starts count, two went on to steady rounds
    assert r["cold_load"]["runs"] == 3 and r["cold_load"]["load_floor_ratio"] > 0
    assert {row["batch_size"] for row in curve_rows(r)} == {1, 2, 4}
    phases = {row["phase"] for row in load_rows(r)}
    assert {"import", "read", "deserialize", "first_call", "raw_read"} <= phases and "total" not in phases


def test_a_crashing_benchmark_is_recorded_failed_not_raised(tiny):
    r = benchmark_or_record(tiny["dir"], "torchscript", FAST, "cpu", tiny["broken"], tiny["feeds"])
    assert r["status"] == "failed" and "corrupt artifact" in r["reason"]
    assert r["steady"] == {} and curve_rows(r) == [] and load_rows(r) == []


def test_a_benchmark_that_kills_its_process_is_recorded_failed(tiny):
    settings = BenchmarkSettings(batch_sizes=(1, 2), cold_runs=1, steady_runs=1, warmup_iters=1, min_iters=3,
                                 min_duration_s=0.0)
    r = benchmark_or_record(tiny["dir"], "torchscript", settings, "cpu", tiny["segfault"], tiny["feeds"])
    assert r["status"] == "failed" and "signal 11" in r["reason"]


def test_an_unconverted_variant_is_skipped_with_its_reason(tiny):
    folder = tiny["root"] / "variants" / "fp16"
    _write_variant(folder, {"variant": "fp16", "artifact": "model.pt"}, status="rejected")
    r = benchmark_or_record(folder, "fp16", FAST, "cpu", tiny["loader"], tiny["feeds"])
    assert r["status"] == "skipped" and "'rejected'" in r["reason"] and "too slow" in r["reason"]
    missing = benchmark_or_record(tiny["root"] / "variants" / "nope", "nope", FAST, "cpu")
    assert missing["status"] == "skipped" and "not converted" in missing["reason"]


def test_real_runtime_on_a_tiny_onnx_variant(tiny_onnx):
    """The default loader/feeds: handlers.runtimes + handlers.tasks, as the stage runs them."""
    settings = BenchmarkSettings(batch_sizes=(1, 8), cold_runs=1, steady_runs=1, warmup_iters=2, min_iters=10,
                                 min_duration_s=0.05, max_cv=10.0, min_gain=-1.0, latency_cap_ms=10_000)
    r = benchmark_or_record(tiny_onnx, "onnx", settings, "cpu")
    assert r["status"] == "ok", r["reason"]
    assert list(r["steady"]) == ["1", "8"] and r["artifact_bytes"] == (tiny_onnx / "model.onnx").stat().st_size
    assert r["cold_load"]["phases_ms"]["deserialize"]["median"] > 0


def _params(**bench):
    base = {"model": {"name": "tiny", "source": "torchscript", "checkpoint": "x.pt", "task": "tensor",
                      "input_shape": [16]},
            "variants": ["eager", "torchscript", "onnx"],
            "benchmark": {"batch_sizes": [1, 2], "cold_runs": 1, "steady_runs": 1, "warmup_iters": 1, "min_iters": 5,
                          "min_duration_s": 0.02, "max_cv": 10.0, **bench}}
    return parse_params(base)


def test_stage_writes_all_three_files_even_when_one_variant_fails(tiny, tmp_path):
    from stages import benchmark as stage
    variants_dir = tiny["root"] / "variants"
    broken_dir = variants_dir / "eager"
    broken_dir.mkdir(exist_ok=True)
    for f in ("model.pt", "variant.json", "conversion.json"):
        (broken_dir / f).write_bytes((tiny["dir"] / f).read_bytes())
    kw = dict(variants_dir=variants_dir, metrics_dir=tmp_path / "metrics", plots_dir=tmp_path / "plots",
              env_json=tmp_path / "env.json", feeds=tiny["feeds"], lock_dir=tmp_path / "locks")
    params = _params()
    failed = stage.run("eager", params, loader=tiny["broken"], **kw)
    ok = stage.run("torchscript", params, loader=tiny["loader"], **kw)
    assert failed["status"] == "failed" and ok["status"] == "ok"
    for v, status in (("eager", "failed"), ("torchscript", "ok")):
        doc = json.loads((tmp_path / "metrics" / f"{v}.json").read_text())
        assert doc["status"] == status and doc["variant"] == v
        assert isinstance(json.loads((tmp_path / "plots" / "curve" / f"{v}.json").read_text()), list)
        assert isinstance(json.loads((tmp_path / "plots" / "load" / f"{v}.json").read_text()), list)
        assert isinstance(json.loads((tmp_path / "plots" / "throughput" / f"{v}.json").read_text()), list)
    curve = json.loads((tmp_path / "plots" / "curve" / "torchscript.json").read_text())
    assert [row["batch_size"] for row in curve] == [1, 2]
    assert set(curve[0]) == {"variant", "batch_size", "p50_ms", "p99_ms", "throughput_sps"}


def _round(points: dict, stopped_early=None) -> dict:
    """A child's steady round, as JSON brings it back: batch → samples (s)."""
    return {"points": {str(b): {"samples_s": xs, "noisy": False, "remeasured": False, "first_cv": 0.0,
                                "peak_rss_mb": 100.0 + b, "peak_gpu_mb": None, "cpu_share": 0.99}
                       for b, xs in points.items()},
            "stopped_early": stopped_early, "peak_rss_mb": 150.0}


def test_rounds_pool_their_samples_and_report_the_spread_of_their_p50s():
    quiet = _round({1: [0.010] * 10, 2: [0.018] * 10})
    same = _round({1: [0.010] * 10, 2: [0.018] * 10})
    slow = _round({1: [0.013] * 10, 2: [0.0185] * 10})        # batch 1 30% off in this process
    steady = combine_rounds([quiet, same, slow], max_cv=0.15)
    b1, b2 = steady["1"], steady["2"]
    assert b1["rounds"] == 3 and b1["iters"] == 30 and b1["round_p50_ms"] == [10.0, 10.0, 13.0]
    assert b1["p50_ms"] == 10.0                               # one disturbed round does not move the p50
    assert b1["spread"] == 0.3 and b1["noisy"] is True        # but the disagreement is reported and flagged
    assert b2["spread"] == pytest.approx(0.5 / 18, abs=1e-4) and b2["noisy"] is False
    assert b2["peak_rss_mb"] == 102.0 and b2["cpu_share"] == 0.99


def test_p50_in_host_reference_units_and_rounds_without_references():
    a, b = _round({1: [0.010] * 10}), _round({1: [0.010] * 10})
    a["reference_ms"], b["reference_ms"] = [0.5, 0.5], [0.5]
    assert combine_rounds([a, b], max_cv=0.15)["1"]["p50_ref"] == 20.0
    assert host_reference([a, b]).as_dict()["round_median_ms"] == [0.5, 0.5]
    # a record from a child without reference windows keeps its figures, p50_ref None
    assert combine_rounds([_round({1: [0.010] * 10})], max_cv=0.15)["1"]["p50_ref"] is None


def test_later_rounds_skip_the_point_past_the_latency_cap():
    first = _round({1: [0.1] * 10, 2: [0.2] * 10, 4: [1.5] * 10},
                   stopped_early={"after_batch": 4, "why": "p99 1500 ms > latency_cap_ms 1000"})
    assert repeat_sizes(first, latency_cap_ms=1000) == [1, 2]
    steady = combine_rounds([first, _round({1: [0.1] * 10, 2: [0.2] * 10})], max_cv=0.15)
    assert steady["4"]["rounds"] == 1 and steady["2"]["rounds"] == 2


def test_steady_rounds_really_run_in_separate_processes(tiny):
    """Each round reports its own process's peak RSS; the stage's rounds re-measure what round 1 kept."""
    files = artifact_files(tiny["dir"], json.loads((tiny["dir"] / "variant.json").read_text()))
    settings = BenchmarkSettings(batch_sizes=(1, 2), warmup_iters=1, min_iters=5, min_duration_s=0.0,
                                 max_cv=10.0, min_gain=-1.0)

    def round_for(i, done):
        return settings.round_spec((1, 2) if i == 0 else repeat_sizes(done[0], 1e9), sweep=i == 0)

    runs = measure_fresh_processes(tiny["dir"], 2, files, tiny["loader"], tiny["feeds"], threads=1,
                                   round_for=round_for, steady_timeout_s=120)
    assert len(runs.rounds) == 2 and runs.cold.runs == 2
    for r in runs.rounds:
        assert list(r["points"]) == ["1", "2"] and all(len(p["samples_s"]) >= 5 for p in r["points"].values())


def test_process_budget_keeps_the_minimums_then_stops_starting_processes():
    """A variant whose rounds take 30 s under a 60 s budget: the 2nd round still runs (a spread needs
    two), and nothing more starts: the two rounds' processes are the two cold loads; with no budget
    all run."""
    from pipeline.measure.runner import ProcessBudget
    now = [0.0]
    budget = ProcessBudget(60.0, clock=lambda: now[0])
    kinds = []
    for i in range(5):
        steady = i == 0 or (i < 5 and budget.round_allowed())
        if budget.stop_before(i, "spec" if steady else None) and i > 0:
            break
        took = 30.0 if steady else 8.0
        now[0] += took
        budget.ran("steady" if steady else "cold", took)
        kinds.append("steady" if steady else "cold")
    assert kinds == ["steady", "steady"]
    assert budget.as_dict()["steady_rounds"] == 2 and budget.as_dict()["cut"] >= 2

    now[0] = 0.0
    free = ProcessBudget(0.0, clock=lambda: now[0])
    for _ in range(5):
        now[0] += 100.0
        free.ran("steady", 100.0)
        assert free.round_allowed() and not free.stop_before(4, None)


def test_the_benchmark_records_its_processes_within_the_budget(tiny):
    settings = dataclasses.replace(FAST, cold_runs=5, steady_runs=4, budget_s=0.001)
    record = benchmark_variant(tiny["dir"], "tiny", settings, "cpu", loader=tiny["loader"], feeds=tiny["feeds"])
    assert record["processes"]["steady_rounds"] == 2            # the minimum, whatever the budget
    assert record["cold_load"]["runs"] == 2                      # ...and their processes' cold loads
    assert all(len(p["round_p50_ms"]) == 2 for p in record["steady"].values())
    # the required repeat round had nothing left of the budget: one pass of its interleaved windows
    assert record["processes"]["round_allowance_s"] == [0.0]
    assert record["processes"]["repeat_passes"] == [{"run": 1, "of": settings.interleave_passes, "max_s": 0.0}]


def _round_at(p50s_ms: dict) -> dict:
    """A steady round's record with 6 samples per size around the given p50 (ms)."""
    return {"points": {str(b): {"samples_s": [ms / 1e3 * f for f in (0.99, 1.0, 1.0, 1.0, 1.0, 1.01)]}
                       for b, ms in p50s_ms.items()}}


def test_rounds_agree_only_when_every_size_repeats_within_the_band():
    from pipeline.measure.runner import rounds_agree
    first = _round_at({1: 100.0, 2: 180.0, 8: 1500.0})            # batch 8: past the cap, measured once
    assert not rounds_agree([first], 0.03)                      # one round has no spread
    assert rounds_agree([first, _round_at({1: 101.0, 2: 182.0})], 0.03)
    assert not rounds_agree([first, _round_at({1: 101.0, 2: 190.0})], 0.03)   # batch 2 5.4 % apart
    assert not rounds_agree([first, _round_at({1: 100.0, 2: 180.0})], 0.0)    # 0: never


def test_agreeing_rounds_end_the_series_after_the_minimum_cold_loads():
    """Two rounds that agree: no third round and no cold-only process (the rounds' own processes are
    the minimum two cold loads), although the budget would allow all five processes."""
    from pipeline.measure.runner import ProcessBudget
    now = [0.0]
    budget = ProcessBudget(600.0, clock=lambda: now[0])
    kinds = []
    for i in range(5):
        steady = i == 0 or budget.round_allowed(rounds_agree=i >= 2)
        if i > 0 and budget.stop_before(i, "spec" if steady else None):
            break
        now[0] += 10.0
        budget.ran("steady" if steady else "cold", 10.0)
        kinds.append("steady" if steady else "cold")
    assert kinds == ["steady", "steady"]
    assert budget.as_dict()["rounds_agreed"] is True


def test_the_benchmark_stops_adding_rounds_once_they_agree(tiny):
    """A wide band: the rounds agree after two, so of five steady runs allowed two run; with the check
    off, all of them do."""
    settings = dataclasses.replace(FAST, cold_runs=5, steady_runs=5, budget_s=0, rounds_agree_within=0.99)
    record = benchmark_variant(tiny["dir"], "tiny", settings, "cpu", loader=tiny["loader"], feeds=tiny["feeds"])
    assert record["processes"]["steady_rounds"] == 2 and record["processes"]["rounds_agreed"]
    assert record["cold_load"]["runs"] == 2
    off = benchmark_variant(tiny["dir"], "tiny", dataclasses.replace(settings, rounds_agree_within=0.0), "cpu",
                            loader=tiny["loader"], feeds=tiny["feeds"])
    assert off["processes"]["steady_rounds"] == 5 and not off["processes"]["rounds_agreed"]


def test_the_required_repeat_round_gets_what_the_budget_leaves_after_the_loads_to_come():
    """Issue 30: a 2 GB variant's two required rounds and its start from disk ran 45–67 s under a
    40 s budget. The second round measures for at most budget - spent - its own cold load - the
    start from disk (each the mean cold load so far), and an optional process counts that start too."""
    from pipeline.measure.runner import ProcessBudget
    now = [0.0]
    budget = ProcessBudget(40.0, clock=lambda: now[0], disk_load=True)
    assert budget.round_allowed() and budget.required_round()
    now[0] += 16.0                                   # round 1: a 5 s load + its sweep
    budget.ran("steady", 16.0)
    budget.loaded(5.0)
    assert budget.round_allowance() == 40.0 - 16.0 - 5.0 - 5.0
    now[0] += 20.0
    budget.ran("steady", 20.0)
    budget.loaded(5.0)
    assert not budget.required_round() and not budget.round_allowed()    # 36 + 18 + 5 > 40
    assert budget.as_dict()["round_allowance_s"] == [14.0]
    now[0] = 0.0
    no_disk = ProcessBudget(40.0, clock=lambda: now[0])
    now[0] = 10.0
    no_disk.loaded(5.0)
    assert no_disk.reserve_s == 0.0 and no_disk.round_allowance() == 25.0
    assert ProcessBudget(0.0).round_allowance() is None                    # no budget: no limit
