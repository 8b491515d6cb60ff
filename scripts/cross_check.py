"""Cross-check the benchmark harness with an independent method (not a timed test).

    python scripts/cross_check.py <variant> [--batch-size 8] [--fresh] [--min-run-time 2]

Measures one variant at one batch size with plain `timeit` (stdlib autorange + repeat) in its own
process — same runtime, same inputs, same thread count, none of the harness's timing code — and
prints that figure beside the harness's p50 (from metrics/benchmark/<variant>.json, or a fresh
harness run with --fresh or when the metrics lack that batch size) and their ratio. With --fresh the
independent figure is the mean of one run before and one after the harness run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
MARKER = "CROSS_CHECK_RESULT "


def independent(model_dir: str, batch_size: int, device: str, threads: int | None, seq_len: int | None,
                min_run_time: float) -> dict:
    """In a fresh process: load with handlers.runtimes, time with timeit only."""
    import timeit

    from handlers.runtimes import load_runtime
    from handlers.tasks import make_adapter
    variant = json.loads((Path(model_dir) / "variant.json").read_text())
    runtime = load_runtime(model_dir, device=device, threads=threads)
    feeds = make_adapter(model_dir, variant.get("task", {})).example_feeds(batch_size, seq_len=seq_len)
    timer = timeit.Timer(lambda: runtime.run(feeds))
    timer.timeit(number=3)                                   # warm-up
    number, took = timer.autorange()                          # calls per block: a block lasts >= 0.2 s
    repeat = max(3, int(min_run_time / max(took, 1e-9)))
    blocks = timer.repeat(repeat=repeat, number=number)
    per_call = [b / number for b in blocks]
    return {"method": f"timeit: {repeat} blocks × {number} calls", "median_ms": statistics.median(per_call) * 1e3,
            "min_ms": min(per_call) * 1e3, "calls": repeat * number}


def harness_figure(variant: str, vdir: Path, path: Path, batch_size: int, fresh: bool, params) -> tuple[dict, str]:
    if not fresh and path.is_file():
        doc = json.loads(path.read_text())
        point = (doc.get("steady") or {}).get(str(batch_size))
        if doc.get("status") == "ok" and point:
            return point, str(path)
    from pipeline.measure.runner import BenchmarkSettings, benchmark_or_record
    settings = dataclasses.replace(BenchmarkSettings.from_params(params.benchmark), batch_sizes=(batch_size,),
                                   cold_runs=1)
    doc = benchmark_or_record(vdir, variant, settings, _device(params))
    if doc["status"] != "ok":
        raise SystemExit(f"harness run of {variant} {doc['status']}: {doc['reason']}")
    return doc["steady"][str(batch_size)], "fresh harness run"


def _device(params) -> str:
    from pipeline.core.paths import ENV_JSON
    if params.benchmark.device == "cpu":
        return "cpu"
    if ENV_JSON.is_file():
        return json.loads(ENV_JSON.read_text())["device"]
    from pipeline.host.device import resolve_device
    return resolve_device(params.benchmark.device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--fresh", action="store_true", help="measure the harness figure now instead of reading metrics")
    ap.add_argument("--min-run-time", type=float, default=2.0, help="seconds of timed calls for the independent figure")
    ap.add_argument("--variant-dir", type=Path, help="variant folder (default artifacts/variants/<variant>)")
    ap.add_argument("--metrics", type=Path, help="harness record (default metrics/benchmark/<variant>.json)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:                                               # the independent measurement's own process
        spec = json.loads(a.child)
        print(MARKER + json.dumps(independent(**spec)), flush=True)
        return 0

    from pipeline.measure.cold import thread_env
    from pipeline.host.device import serving_threads
    from pipeline.core.params import load_params
    from pipeline.core.paths import benchmark_json, variant_dir
    params = load_params()
    device = _device(params)
    threads = serving_threads(device, params.benchmark.threads)
    vdir = a.variant_dir or variant_dir(a.variant)
    if not (vdir / "variant.json").is_file():
        print(f"{vdir} is not a built variant folder; run `dvc repro convert@{a.variant}` or pass --variant-dir",
              file=sys.stderr)
        return 2
    task = json.loads((vdir / "variant.json").read_text()).get("task", {})
    seq_len = params.benchmark.text_length if task.get("kind") == "text-embedding" else None

    spec = {"model_dir": str(vdir), "batch_size": a.batch_size, "device": device, "threads": threads,
            "seq_len": seq_len, "min_run_time": a.min_run_time}

    def measure_independently() -> dict | None:
        proc = subprocess.run([sys.executable, __file__, a.variant, "--child", json.dumps(spec)], cwd=REPO_ROOT,
                              env=thread_env(threads), capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)), None)
        if proc.returncode != 0 or line is None:
            print(proc.stderr[-2000:], file=sys.stderr)
            return None
        return json.loads(line[len(MARKER):])

    # A fresh harness run is bracketed by two independent runs (before and after), so a host that
    # drifts while they run moves both figures alike instead of showing up as disagreement.
    before = measure_independently() if a.fresh else None
    harness, source = harness_figure(a.variant, vdir, a.metrics or benchmark_json(a.variant), a.batch_size,
                                     a.fresh, params)
    after = measure_independently()
    runs = [r for r in (before, after) if r is not None]
    if not runs or (a.fresh and len(runs) < 2):
        return 1
    median_ms = statistics.fmean(r["median_ms"] for r in runs)
    ratio = median_ms / harness["p50_ms"]
    print(f"variant {a.variant}, batch {a.batch_size}, device {device}, threads {threads}")
    print(f"  harness ({source}): p50 {harness['p50_ms']:.3f} ms, mean {harness['mean_ms']:.3f} ms, "
          f"{harness['throughput_sps']:.1f} samples/s ({harness['iters']} iters)")
    for when, r in zip(("before", "after") if before else ("",), runs):
        print(f"  independent{' ' + when if when else ''} ({r['method']}, own process): median {r['median_ms']:.3f} ms "
              f"per call, min {r['min_ms']:.3f} ms")
    print(f"  independent: {median_ms:.3f} ms per call, {a.batch_size / median_ms * 1e3:.1f} samples/s")
    print(f"  ratio independent / harness p50 = {ratio:.3f}  ({'agree' if abs(ratio - 1) <= 0.15 else 'DISAGREE'} "
          f"within 15%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
