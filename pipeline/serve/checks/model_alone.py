"""The model alone on the served requests, measured in the same run as the server.

The benchmark stage's steady rate comes from another hour (a cached stage may be days old) and from
synthetic feeds; on a shared host the speed drifts 10–25% between hours, so a bound built from it
does not compare with a served rate measured now. Here the served variant runs as the workers run
it — `workers` processes at once, each with the served threads, the same runtime loader — on the
served requests themselves: each request decoded by the task's adapter, a server batch of
`batch_size` requests fanned out into rows and run in model calls of at most `batch_rows` rows,
exactly as handlers/serving.py does, without the server and without decoding or answering (timed
separately: the handler's own share).

Each process loads, warms up and says so; once all have, the parent sends them one start time, and
each times calls over that same window, so the rate is that of the workers sharing the host.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from pipeline.core.numbers import rounded

# Between the last child's "ready" and the common window: time for the start line to reach them all.
START_MARGIN_S = 0.2


def server_batches(adapter, cases, batch_size: int, batch_rows: int) -> list[tuple[int, list]]:
    """(requests, rows) of each model call when the cases arrive in order, `batch_size` requests per
    server batch, rows split into calls of at most `batch_rows` (handlers/serving.py's fan-out)."""
    decoded = [adapter.decode_request(c.body, c.content_type) for c in cases]
    calls = []
    for start in range(0, len(decoded), batch_size):
        group = decoded[start:start + batch_size]
        rows = [row for d in group for row in d.rows]
        chunks = [rows[k:k + batch_rows] for k in range(0, len(rows), batch_rows)]
        for n, chunk in enumerate(chunks):
            # A server batch's requests are counted on its last call: requests/s = server batches done.
            calls.append((len(group) if n == len(chunks) - 1 else 0, chunk))
    return calls


def measure(variant_dir: Path, cases_path: Path, *, batch_size: int, batch_rows: int, workers: int,
            threads: Optional[int], device: str = "cpu", seconds: float = 3.0, warmup_s: float = 1.0,
            timeout_s: float = 300.0) -> dict:
    """`workers` processes run the variant on the served requests over one common window of
    `seconds`; → rows/s and requests/s summed over them, and each process's figures."""
    spec = {"variant_dir": str(variant_dir), "cases": str(cases_path), "batch_size": batch_size,
            "batch_rows": batch_rows, "threads": threads, "device": device, "seconds": seconds,
            "warmup_s": warmup_s}
    env_threads = {} if threads is None else {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    import os
    env = {**os.environ, **env_threads}
    procs = [subprocess.Popen([sys.executable, "-m", "pipeline.serve.checks.model_alone", json.dumps(spec)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=str(Path(__file__).resolve().parents[3]))
             for _ in range(max(1, workers))]
    # Each child prints "ready" once loaded and warm (or exits on failure): then one start time for all.
    deadline = time.monotonic() + timeout_s
    for p in procs:
        _wait_ready(p, deadline)
    start_at = f"{time.time() + START_MARGIN_S}\n"
    for p in procs:
        try:
            p.stdin.write(start_at)
            p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
    per, errors = [], []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            errors.append(f"timed out after {timeout_s:.0f} s")
            continue
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            errors.append(f"exit {p.returncode}: {err.strip().splitlines()[-1] if err.strip() else 'no output'}")
            continue
        per.append(json.loads(lines[-1]))
    if errors or not per:
        return {"ok": False, "errors": errors, "processes": per}
    late = [p for p in per if p["late_s"] > 0]
    return {"ok": True, "rows_per_s": rounded(sum(p["rows"] / p["seconds"] for p in per), 2),
            "requests_per_s": rounded(sum(p["requests"] / p["seconds"] for p in per), 2),
            "workers": len(per), "threads_per_process": threads, "batch_size": batch_size,
            "batch_rows": batch_rows, "window_s": seconds,
            "overlap": "every process timed the same window" if not late else
                       f"{len(late)} process(es) loaded after the window opened (late by "
                       f"{max(p['late_s'] for p in late):.1f} s): their windows only partly overlap",
            "processes": per,
            "formula": "sum over the worker processes of rows (requests) run / their common window"}


def measure_cases(variant_dir: Path, cases: list, **kw) -> dict:
    """`measure` on requests given in hand (pipeline.serve.checks.http_cases.HttpCase, text bodies) rather than
    a cases file: a load's own requests (the rerank load's queries). Same keywords as `measure`."""
    import tempfile
    from pipeline.serve.checks.http_cases import write_http_cases
    with tempfile.TemporaryDirectory(prefix="model_alone-") as d:
        return measure(variant_dir, write_http_cases(Path(d) / "cases.json", cases), **kw)


def _wait_ready(p: subprocess.Popen, deadline: float) -> None:
    """Until `p` printed "ready" or ended (its figures or error come with communicate())."""
    import selectors
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                return
            line = p.stdout.readline()
            if not line or line.strip() == "ready":
                return


def _child(spec: dict) -> dict:
    from handlers.runtimes import load_runtime
    from handlers.tasks import make_adapter
    from pipeline.measure.feeds import read_variant
    from pipeline.serve.checks.http_cases import load_http_cases

    variant_dir = Path(spec["variant_dir"])
    adapter = make_adapter(str(variant_dir), read_variant(variant_dir).get("task", {}))
    calls = server_batches(adapter, load_http_cases(Path(spec["cases"])), spec["batch_size"], spec["batch_rows"])
    t0 = time.perf_counter()
    feeds = [(requests, len(rows), adapter.collate(rows)) for requests, rows in calls]
    collate_s = time.perf_counter() - t0
    runtime = load_runtime(variant_dir, device=spec["device"], threads=spec["threads"])
    warm_end = time.perf_counter() + spec["warmup_s"]
    k = 0
    while time.perf_counter() < warm_end or k < 2:
        runtime.run(feeds[k % len(feeds)][2])
        k += 1
    print("ready", flush=True)
    late = time.time() - float(sys.stdin.readline())
    if late < 0:
        time.sleep(-late)
    rows = requests = n = 0
    t0 = time.perf_counter()
    end = t0 + spec["seconds"]
    while True:
        req, nrows, f = feeds[n % len(feeds)]
        runtime.run(f)
        n += 1
        rows += nrows
        requests += req
        if time.perf_counter() >= end:
            break
    seconds = time.perf_counter() - t0
    return {"rows": rows, "requests": requests, "calls": n, "seconds": round(seconds, 4),
            "late_s": round(max(0.0, late), 3), "collate_us_per_row": round(1e6 * collate_s / max(1, sum(c[1] for c in feeds)), 1)}


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
