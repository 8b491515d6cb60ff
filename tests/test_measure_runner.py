"""The harness end to end on tiny variants: cold load in real fresh processes, the steady sweep,
the benchmark stage's three outputs, and a failing / unconverted variant recorded without raising.

Two tiny variants: a TorchScript MLP behind a loader written here (the harness is generic over
the loader), and an ONNX MatMul loaded by the real handlers.runtime + task adapter.
"""
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.measure.cold import artifact_files, cold_start_once, measure_cold_load, raw_read_seconds
from pipeline.measure.runner import BenchmarkSettings, benchmark_isolated, benchmark_or_record, curve_rows, load_rows
from pipeline.params import parse_params

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
    """An ONNX variant loadable by the real handlers.runtime, tensor task (input 'input', 8 floats)."""
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


FAST = BenchmarkSettings(batch_sizes=(1, 2, 4), cold_runs=2, warmup_iters=2, min_iters=10, min_duration_s=0.05,
                         max_cv=10.0, min_gain=-1.0, latency_cap_ms=10_000)


def test_cold_start_in_a_fresh_process_times_every_phase(tiny):
    phases = cold_start_once(tiny["dir"], tiny["loader"], tiny["feeds"], threads=1)
    for name in ("interpreter", "import", "read", "deserialize", "to_device", "adapter", "first_call", "total"):
        assert phases[name] >= 0, name
    # a fresh process pays the torch import; this test process has torch already
    assert phases["import"] > phases["read"]
    assert phases["total"] >= sum(v for k, v in phases.items() if k != "total") * 0.95


def test_cold_load_over_runs_with_raw_read_floor(tiny):
    files = artifact_files(tiny["dir"], json.loads((tiny["dir"] / "variant.json").read_text()))
    assert files == [tiny["dir"] / "model.pt"]
    c = measure_cold_load(tiny["dir"], 2, files, tiny["loader"], tiny["feeds"], threads=1)
    assert c.runs == 2 and c.artifact_bytes == (tiny["dir"] / "model.pt").stat().st_size
    assert c.raw_read_s > 0 and c.floor_ratios()["load"] > 0
    assert c.phases["total"].max_s >= c.phases["total"].median_s


def test_cold_load_failure_names_the_cause(tiny):
    from pipeline.measure.cold import ColdLoadError
    with pytest.raises(ColdLoadError, match="corrupt artifact"):
        cold_start_once(tiny["dir"], tiny["broken"], tiny["feeds"])


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
        assert s["batch_size"] == int(b) and s["iters"] >= 10 and s["p50_ms"] <= s["p99_ms"]
        assert s["peak_rss_mb"] > 0 and s["peak_gpu_mb"] is None and s["noisy"] is False
        assert 0 < s["cpu_share"] <= 1.5
    assert r["cold_load"]["runs"] == 2 and r["cold_load"]["load_floor_ratio"] > 0
    assert {row["batch_size"] for row in curve_rows(r)} == {1, 2, 4}
    phases = {row["phase"] for row in load_rows(r)}
    assert {"import", "read", "deserialize", "first_call", "raw_read"} <= phases and "total" not in phases


def test_a_crashing_benchmark_is_recorded_failed_not_raised(tiny):
    r = benchmark_or_record(tiny["dir"], "torchscript", FAST, "cpu", tiny["broken"], tiny["feeds"])
    assert r["status"] == "failed" and "corrupt artifact" in r["reason"]
    assert r["steady"] == {} and curve_rows(r) == [] and load_rows(r) == []


def test_a_benchmark_that_kills_its_process_is_recorded_failed(tiny):
    settings = BenchmarkSettings(batch_sizes=(1, 2), cold_runs=1, warmup_iters=1, min_iters=3, min_duration_s=0.0)
    r = benchmark_isolated(tiny["dir"], "torchscript", settings, "cpu", tiny["segfault"], tiny["feeds"])
    assert r["status"] == "failed" and "signal 11" in r["reason"]


def test_an_unconverted_variant_is_skipped_with_its_reason(tiny):
    folder = tiny["root"] / "variants" / "fp16"
    _write_variant(folder, {"variant": "fp16", "artifact": "model.pt"}, status="rejected")
    r = benchmark_or_record(folder, "fp16", FAST, "cpu", tiny["loader"], tiny["feeds"])
    assert r["status"] == "skipped" and "'rejected'" in r["reason"] and "too slow" in r["reason"]
    missing = benchmark_or_record(tiny["root"] / "variants" / "nope", "nope", FAST, "cpu")
    assert missing["status"] == "skipped" and "not converted" in missing["reason"]


def test_real_runtime_on_a_tiny_onnx_variant(tiny_onnx):
    """The default loader/feeds: handlers.runtime + handlers.tasks, as the stage runs them."""
    settings = BenchmarkSettings(batch_sizes=(1, 8), cold_runs=1, warmup_iters=2, min_iters=10,
                                 min_duration_s=0.05, max_cv=10.0, min_gain=-1.0, latency_cap_ms=10_000)
    r = benchmark_or_record(tiny_onnx, "onnx", settings, "cpu")
    assert r["status"] == "ok", r["reason"]
    assert list(r["steady"]) == ["1", "8"] and r["artifact_bytes"] == (tiny_onnx / "model.onnx").stat().st_size
    assert r["cold_load"]["phases_ms"]["deserialize"]["median"] > 0


def _params(**bench):
    base = {"model": {"name": "tiny", "source": "torchscript", "checkpoint": "x.pt", "task": "tensor",
                      "input_shape": [16]},
            "variants": ["eager", "torchscript", "onnx"],
            "benchmark": {"batch_sizes": [1, 2], "cold_runs": 1, "warmup_iters": 1, "min_iters": 5,
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
