"""One benchmark process, started fresh: `python -m pipeline.measure.child --model-dir DIR ...`

Phases as optimum-benchmark names them: load (the cold start, phase by phase) → first call → and,
when `--steady` gives a round spec, one steady-state round at the listed batch sizes. Steady state
is measured in several such processes, not one: each process starts with its own memory layout
and allocator state, and rounds spread over time show what the host did meanwhile.

Imports nothing heavy before timing starts; prints one line `BENCHMARK_CHILD_RESULT {json}` with
the phases in seconds and monotonic timestamps (CLOCK_MONOTONIC is system-wide, so the parent can
subtract its spawn time and get the wall time including interpreter start).
"""
import time

_STARTED_AT = time.monotonic()

import argparse  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

MARKER = "BENCHMARK_CHILD_RESULT "


def resolve_callable(spec: str):
    """'pkg.module:fn' or 'path/to/file.py:fn' → the function."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"callable spec {spec!r} must look like 'pkg.module:function' or 'file.py:function'")
    if target.endswith(".py"):
        path = Path(target)
        mod_spec = importlib.util.spec_from_file_location(f"_child_{path.stem}", path)
        if mod_spec is None or not path.exists():
            raise ValueError(f"callable spec {spec!r}: file {path} not found")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_spec.name] = module
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"callable spec {spec!r}: {target} has no attribute {name!r}") from None


def cold_start(loader_spec: str, feeds_spec: str, model_dir: str, device: str, threads, seq_len,
               tensorrt: bool = False):
    """Load and call once, timing each phase. Returns (phases, runtime, make_feeds)."""
    phases = {"interpreter": 0.0}
    t0 = time.monotonic()
    loader = resolve_callable(loader_spec)
    import_module_s = time.monotonic() - t0

    t0 = time.monotonic()
    runtime = loader(model_dir, device=device, threads=threads, **({"tensorrt": True} if tensorrt else {}))
    load_wall = time.monotonic() - t0
    reported = {k: float(v) for k, v in (getattr(runtime, "load_phases", None) or {}).items()}
    if not reported:          # a loader that reports no phases: its whole call is deserialization
        reported = {"deserialize": load_wall}
    phases["import"] = import_module_s + reported.pop("import", 0.0)
    for k in ("read", "deserialize", "to_device"):
        phases[k] = reported.pop(k, 0.0)
    phases.update(reported)   # extra phases a loader names
    # loader overhead no phase accounts for (reading variant.json, dispatch)
    phases["other"] = max(0.0, load_wall - sum(v for k, v in phases.items() if k != "interpreter") + import_module_s)

    t0 = time.monotonic()
    make_feeds = resolve_callable(feeds_spec)
    feeds = make_feeds(model_dir, 1, seq_len)
    phases["adapter"] = time.monotonic() - t0

    t0 = time.monotonic()
    runtime.run(feeds)
    if device == "cuda" and "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.synchronize()
    phases["first_call"] = time.monotonic() - t0
    return phases, runtime, make_feeds


def steady_round(runtime, make_feeds, model_dir: str, device: str, threads, seq_len, spec) -> dict:
    """One steady-state round in this process: per batch size the raw samples, whether it was
    re-measured / stayed noisy, peak memory and the CPU share it got. A sweep round measures size
    after size (each decides whether the next is worth it); a repeat round interleaves its sizes."""
    from pipeline.measure import memory
    from pipeline.host.device import synchronizer
    from pipeline.measure.reference import reference_window_ms
    from pipeline.measure.steady import measure_interleaved, measure_latency, measure_stable, sweep

    sync = synchronizer(device)
    gpu = memory.GpuMemoryTracker(device)
    rule = spec.stop_rule()
    after_call = gpu.sample if gpu.active else None
    points: dict = {}
    # the host's speed, in windows between the model's (pipeline/measure/reference.py)
    reference_ms = [reference_window_ms()]

    def cpu_share_since(cpu0: float, wall0: float) -> float:
        # CPU time this process got per wall second and thread: well under 1 on CPU means other
        # processes shared our cores during the measurement (contention no CV shows if it lasts)
        return round((time.process_time() - cpu0) / max(time.monotonic() - wall0, 1e-9) / (threads or 1), 3)

    def record(b: int, summary, noisy: bool, remeasured: bool, first_cv: float, cpu_share: float) -> None:
        points[str(b)] = {"samples_s": list(summary.samples_s), "noisy": noisy, "remeasured": remeasured,
                          "first_cv": first_cv, "peak_rss_mb": memory.peak_rss_mb(), "peak_gpu_mb": gpu.peak_mb(),
                          "cpu_share": cpu_share}

    stopped_early = None
    if spec.sweep:
        def measure_at(batch_size: int):
            x = make_feeds(model_dir, batch_size, seq_len)
            gpu.start()
            cpu0, wall0 = time.process_time(), time.monotonic()
            m = measure_stable(lambda: measure_latency(lambda: runtime.run(x), batch_size, rule, spec.warmup_iters,
                                                       sync=sync, after_call=after_call,
                                                       warmup_max_s=spec.warmup_max_s), spec.max_cv)
            record(batch_size, m.summary, m.noisy, m.remeasured, m.first_cv, cpu_share_since(cpu0, wall0))
            reference_ms.append(reference_window_ms())
            return m
        stopped_early = sweep(measure_at, spec.batch_sizes, spec.policy()).stopped_early
    else:
        feeds = {b: make_feeds(model_dir, b, seq_len) for b in spec.batch_sizes}
        gpu.start()
        cpu0, wall0 = time.process_time(), time.monotonic()
        ran: dict = {}
        summaries = measure_interleaved({b: (lambda x=x: runtime.run(x)) for b, x in feeds.items()}, rule,
                                        spec.passes, spec.warmup_iters, spec.warmup_max_s, sync=sync,
                                        after_call=after_call,
                                        after_pass=lambda: reference_ms.append(reference_window_ms()),
                                        max_s=spec.max_s, done=ran)
        passes = {"run": ran.get("passes"), "of": spec.passes, "max_s": spec.max_s}
        share = cpu_share_since(cpu0, wall0)
        for b, s in summaries.items():
            record(b, s, s.cv > spec.max_cv, False, s.cv, share)
    out = {"points": points, "stopped_early": stopped_early, "peak_rss_mb": memory.peak_rss_mb(),
           "reference_ms": reference_ms}
    if not spec.sweep:
        out["passes"] = passes
    return out


def run_child(loader_spec: str, feeds_spec: str, model_dir: str, device: str, threads, seq_len,
              tensorrt: bool = False, steady: dict | None = None) -> dict:
    phases, runtime, make_feeds = cold_start(loader_spec, feeds_spec, model_dir, device, threads, seq_len, tensorrt)
    done_at = time.monotonic()
    result = {"phases": phases, "started_at": _STARTED_AT, "done_at": done_at, "steady": None}
    try:
        if steady is not None:
            from pipeline.measure.steady import RoundSpec
            result["steady"] = steady_round(runtime, make_feeds, model_dir, device, threads, seq_len,
                                            RoundSpec.from_dict(steady))
    finally:
        close = getattr(runtime, "close", None)
        if close:
            close()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--loader", default="handlers.runtimes:load_runtime")
    ap.add_argument("--feeds", default="pipeline.measure.feeds:example_feeds")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--tensorrt", action="store_true")
    ap.add_argument("--steady", default=None, help="a steady-state round spec (JSON, see steady.RoundSpec)")
    a = ap.parse_args(argv)
    result = run_child(a.loader, a.feeds, a.model_dir, a.device, a.threads, a.seq_len, a.tensorrt,
                       json.loads(a.steady) if a.steady else None)
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
