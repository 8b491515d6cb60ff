"""Benchmark one variant folder: cold load in fresh processes, then the steady-state batch sweep.

Generic over two callables named by spec ('pkg.module:fn' or 'file.py:fn'), the same in the
cold-load children and in this process:
- loader(model_dir, device=..., threads=...) -> runtime with .run(feeds), optional .load_phases / .close()
- feeds(model_dir, batch_size, seq_len) -> feeds
The benchmark stage uses handlers.runtime:load_runtime and the task adapters; tests use tiny models.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

from pipeline.measure import memory
from pipeline.measure.cold import DEFAULT_FEEDS, DEFAULT_LOADER, artifact_files, measure_cold_load, thread_env
from pipeline.measure.cold_child import resolve_callable
from pipeline.measure.device import serving_threads, synchronizer
from pipeline.measure.feeds import read_variant
from pipeline.measure.steady import StopRule, SweepPolicy, measure_latency, measure_stable, sweep
from pipeline.params import REPO_ROOT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchmarkSettings:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    threads: int = 0                 # 0 → what one serving worker gets (see device.serving_threads)
    cold_runs: int = 5
    warmup_iters: int = 5
    min_iters: int = 20
    min_duration_s: float = 1.0
    max_cv: float = 0.15
    min_gain: float = 0.05
    sweep_patience: int = 2
    latency_cap_ms: float = 1000.0
    text_length: int = 24
    tensorrt: bool = False           # ONNX on CUDA: ask the loader for the TensorRT EP first
    cold_timeout_s: float = 300.0

    @classmethod
    def from_params(cls, bp) -> "BenchmarkSettings":
        """From pipeline.params.BenchmarkParams (already validated)."""
        shared = {f.name: getattr(bp, f.name) for f in fields(cls) if hasattr(bp, f.name)}
        return cls(**{**shared, "batch_sizes": tuple(bp.batch_sizes)})


def outcome_record(variant: str, status: str, reason: Optional[str], device: str,
                   threads: Optional[int], artifact_bytes: Optional[int] = None) -> dict:
    """The record's frame; figures stay empty for skipped / failed variants."""
    return {"variant": variant, "status": status, "reason": reason, "device": device, "threads": threads,
            "artifact_bytes": artifact_bytes, "cold_load": None, "steady": {}, "stopped_early": None,
            "peak_rss_mb": None, "noisy": False}


def _progress(total: int, desc: str):
    """tqdm on a terminal only; quiet in CI / dvc logs."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="step", disable=not sys.stderr.isatty(), leave=False)


def benchmark_variant(model_dir, variant: str, settings: BenchmarkSettings, device: str,
                      loader: str = DEFAULT_LOADER, feeds: str = DEFAULT_FEEDS) -> dict:
    """Measure one converted variant; raises on failure (the caller records it)."""
    model_dir = Path(model_dir)
    meta = read_variant(model_dir)
    threads = serving_threads(device, settings.threads)
    seq_len = settings.text_length if meta.get("task", {}).get("kind") == "text-embedding" else None
    files = artifact_files(model_dir, meta)
    started = time.monotonic()
    bar = _progress(settings.cold_runs + len(settings.batch_sizes), f"benchmark {variant}")

    # 1. cold load, each run in its own fresh process (threads pinned there before any import)
    cold = measure_cold_load(model_dir, settings.cold_runs, files, loader, feeds, device, threads, seq_len,
                             settings.cold_timeout_s, tensorrt=settings.tensorrt, on_run=lambda i: bar.update())
    log.info("%s: %s", variant, cold.render())

    # 2. steady state, in this process: pin threads before the runtime imports its library
    if threads:
        for k, v in thread_env(threads).items():
            if k.endswith("_NUM_THREADS"):
                os.environ[k] = v
    runtime = resolve_callable(loader)(str(model_dir), device=device, threads=threads,
                                       **({"tensorrt": True} if settings.tensorrt else {}))
    make_feeds = resolve_callable(feeds)
    sync = synchronizer(device)
    gpu = memory.GpuMemoryTracker(device)
    rule = StopRule(settings.min_iters, settings.min_duration_s)
    peaks: dict[int, dict] = {}

    def measure_at(batch_size: int):
        x = make_feeds(str(model_dir), batch_size, seq_len)
        gpu.start()
        cpu0, wall0 = time.process_time(), time.monotonic()
        m = measure_stable(lambda: measure_latency(lambda: runtime.run(x), batch_size, rule, settings.warmup_iters,
                                                   sync=sync, after_call=gpu.sample if gpu.active else None),
                           settings.max_cv)
        # CPU time this process got per wall second and thread: well under 1 on CPU means other
        # processes shared our cores during the measurement (contention no CV shows if it lasts)
        cpu_share = (time.process_time() - cpu0) / max(time.monotonic() - wall0, 1e-9) / (threads or 1)
        peaks[batch_size] = {"peak_rss_mb": memory.peak_rss_mb(), "peak_gpu_mb": gpu.peak_mb(),
                             "cpu_share": round(cpu_share, 3)}
        return m

    def on_point(b, m):
        bar.update()
        log.info("%s: %s%s", variant, m.summary.render(), "  NOISY" if m.noisy else "")

    try:
        policy = SweepPolicy(settings.min_gain, settings.latency_cap_ms, settings.sweep_patience)
        result = sweep(measure_at, settings.batch_sizes, policy,
                       on_point=on_point)
    finally:
        bar.close()
        close = getattr(runtime, "close", None)
        if close:
            close()
    if result.stopped_early:
        log.info("%s: sweep stopped after batch %s: %s", variant, result.stopped_early["after_batch"],
                 result.stopped_early["why"])

    record = outcome_record(variant, "ok", None, device, threads, cold.artifact_bytes)
    steady = result.as_dict()
    for b, extra in peaks.items():
        if str(b) in steady:
            steady[str(b)].update(extra)
    record.update({
        "cold_load": cold.as_dict(),
        "steady": steady,
        "stopped_early": result.stopped_early,
        "peak_rss_mb": memory.peak_rss_mb(),
        "noisy": any(m.noisy for m in result.points.values()),
        "settings": asdict(settings),
        "duration_s": round(time.monotonic() - started, 2),
    })
    return record


def curve_rows(record: dict) -> list[dict]:
    """Plot data: latency and throughput vs batch size."""
    return [{"variant": record["variant"], "batch_size": int(b), "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"],
             "throughput_sps": s["throughput_sps"]} for b, s in (record.get("steady") or {}).items()]


def throughput_rows(record: dict) -> list[dict]:
    """Plot data: throughput vs batch size (its own folder: DVC plots one y field set per folder)."""
    return [{"variant": r["variant"], "batch_size": r["batch_size"], "throughput_sps": r["throughput_sps"]}
            for r in curve_rows(record)]


def load_rows(record: dict) -> list[dict]:
    """Plot data: cold-load breakdown (median per phase) with the raw-read floor."""
    cold = record.get("cold_load")
    if not cold:
        return []
    rows = [{"variant": record["variant"], "phase": name, "ms": p["median"]}
            for name, p in cold["phases_ms"].items() if name not in ("phases_sum", "total")]
    rows.append({"variant": record["variant"], "phase": "raw_read", "ms": cold["raw_read_ms"]})
    return rows


def conversion_status(model_dir) -> tuple[str, Optional[str]]:
    """(status, reason) from the variant's conversion.json; a missing one reads as not converted."""
    import json
    path = Path(model_dir) / "conversion.json"
    if not path.is_file():
        return "missing", f"{path} not found: the variant was not converted (run `dvc repro convert@{Path(model_dir).name}`)"
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        return "unreadable", f"{path} is not valid JSON ({e})"
    return str(doc.get("status")), doc.get("reason")


def benchmark_or_record(model_dir, variant: str, settings: BenchmarkSettings, device: str,
                        loader: str = DEFAULT_LOADER, feeds: str = DEFAULT_FEEDS) -> dict:
    """Never raises: a variant that was not converted is `skipped`, a benchmark that crashes is
    `failed` with the reason — one variant's trouble never stops the others."""
    status, reason = conversion_status(model_dir)
    if status != "converted":
        why = f"conversion status is {status!r}" + (f": {reason}" if reason else "")
        log.warning("%s: skipped (%s)", variant, why)
        return outcome_record(variant, "skipped", why, device, serving_threads(device, max(settings.threads, 0)))
    try:
        return benchmark_variant(model_dir, variant, settings, device, loader, feeds)
    except Exception as e:
        log.exception("%s: benchmark failed", variant)
        return outcome_record(variant, "failed", f"{type(e).__name__}: {str(e)[:2000]}", device,
                              serving_threads(device, max(settings.threads, 0)))


def benchmark_isolated(model_dir, variant: str, settings: BenchmarkSettings, device: str,
                       loader: str = DEFAULT_LOADER, feeds: str = DEFAULT_FEEDS) -> dict:
    """benchmark_or_record in a fresh process (`python -m pipeline.measure.runner`): a runtime that
    crashes the interpreter (segfault, abort, OOM kill) becomes a `failed` record, and the steady-state
    peak RSS is the variant's own. A plain subprocess, not multiprocessing: spawn would re-import the
    caller's __main__, which may itself be waiting on the device lock."""
    import json
    import subprocess
    import tempfile
    spec = {"model_dir": str(model_dir), "variant": variant, "settings": asdict(settings), "device": device,
            "loader": loader, "feeds": feeds}
    with tempfile.TemporaryDirectory(prefix="benchmark-") as tmp:
        result = Path(tmp) / "record.json"
        proc = subprocess.run([sys.executable, "-m", "pipeline.measure.runner", json.dumps(spec), str(result)],
                              cwd=str(REPO_ROOT), env=thread_env(None))
        if result.is_file():
            return json.loads(result.read_text())
    code = proc.returncode
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    return outcome_record(variant, "failed", f"the benchmark process died ({how}) without a result",
                          device, serving_threads(device, max(settings.threads, 0)))


def _main(argv) -> int:
    import json
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spec, out = json.loads(argv[0]), Path(argv[1])
    settings = BenchmarkSettings(**{**spec["settings"], "batch_sizes": tuple(spec["settings"]["batch_sizes"])})
    record = benchmark_or_record(spec["model_dir"], spec["variant"], settings, spec["device"],
                                 spec["loader"], spec["feeds"])
    out.write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
