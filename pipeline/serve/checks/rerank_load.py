"""The rerank load (issue 26): rows/s served against the rows/s the model gives alone on the same
requests, measured in the same run.

A rerank request is one query and N texts: ONE HTTP request, N model rows. TorchServe's batch counts
requests; the handler fans a batch's rows out over model calls of at most `batch_rows` rows
(pipeline/decide/rows.py). So serve_check, for task rerank, serves a load of `serve_check.rerank_texts`
texts per query from `serve_check.rerank_clients` keep-alive clients against the winner and records:

- served rows/s = rows answered / wall (rows answered = requests answered 200 × texts per query);
- offline rows/s = the model alone, measured in this run right after the load (server stopped) on
  the load's OWN requests (pipeline/serve/checks/model_alone.py): the served variant in `workers` processes
  at once, with the served threads, each of these queries decoded by the task's adapter, server
  batches of the size that carried the load's requests (TorchServe's PredictionTime lines) fanned
  out into model calls of `batch_rows` rows as the handler does, one common timed window. Like with
  like: same run, same rows, same calls;
- `offline_benchmark`, kept beside it: the benchmark stage's figure at the calls the server made
  (every batch TorchServe formed is k × texts rows, split into calls of batch_rows; each call of b rows
  takes b / throughput_sps(b) in metrics/benchmark/<variant>.json's steady state, interpolated between
  measured sizes), offline = workers × Σ rows / Σ call time. Another hour, other rows (the benchmark's
  feeds): the ratio uses it only when the in-run measurement could not be made, and says so;
- their ratio, served / offline (issue 26's target 0.7: measured and shown, never asserted).
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

from pipeline.core.numbers import rounded
from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.checks.load import run_load
from pipeline.serve.serve_check import ServerSpec
from pipeline.serve.server.torchserve import ModelNotReady, TorchServe, TorchServeError

log = logging.getLogger(__name__)

TARGET = 0.7            # issue 26: served rows/s >= 0.7 x the model's own offline rows/s at the served batch
CASES = 16              # distinct queries the load cycles through


def rerank_cases(golden_dir: Path, texts: int, n: int = CASES, seed: int = 1) -> list[HttpCase]:
    """`n` rerank requests of exactly `texts` texts each, from the task's adapter over the golden
    set's tokenizer (query 5-15 words, passages 30-80 words: handlers/tasks/rerank.py)."""
    from handlers.tasks import make_adapter
    golden_dir = Path(golden_dir)
    task = json.loads((golden_dir / "golden.json").read_text())["task"]
    adapter = make_adapter(golden_dir, task)
    return [HttpCase(f"rerank-{texts}-{i}", ct, body)
            for i, (body, ct) in enumerate(adapter.example_requests(n, seed=seed, texts=texts))]


def rows_of(case: HttpCase) -> int:
    return len(json.loads(case.body)["texts"])


# --------------------------------------------------------------------------- rows arithmetic
def model_calls_formed(batches_seen: dict, rows_per_request: int, batch_rows: int) -> dict[int, int]:
    """{rows per call: calls} the handler makes for TorchServe's batches {requests: count}: a batch
    of k requests is k × rows_per_request rows, run in calls of batch_rows and one of the rest."""
    calls: dict[int, int] = {}
    for k, count in batches_seen.items():
        rows = int(k) * int(rows_per_request)
        full, rest = divmod(rows, int(batch_rows))
        if full:
            calls[batch_rows] = calls.get(batch_rows, 0) + full * int(count)
        if rest:
            calls[rest] = calls.get(rest, 0) + int(count)
    return dict(sorted(calls.items()))


def call_ms(steady: dict, rows: int) -> tuple[Optional[float], str]:
    """A model call of `rows` rows, in ms, from the benchmark's steady points (b / throughput_sps(b)):
    measured, linearly interpolated between the measured sizes around it, or beyond the largest at
    its per-row time; (None, why) without a usable curve."""
    times = {int(k): 1000.0 * int(k) / float(p["throughput_sps"])
             for k, p in (steady or {}).items() if isinstance(p, dict) and p.get("throughput_sps")}
    if not times:
        return None, "no steady-state throughput in the benchmark"
    sizes = sorted(times)
    if rows in times:
        return times[rows], "measured"
    if rows < sizes[0]:
        return times[sizes[0]], f"below the smallest measured batch {sizes[0]}: its call time"
    if rows > sizes[-1]:
        return times[sizes[-1]] * rows / sizes[-1], f"above the largest measured batch {sizes[-1]}: its per-row time"
    lo = max(s for s in sizes if s < rows)
    hi = min(s for s in sizes if s > rows)
    return times[lo] + (times[hi] - times[lo]) * (rows - lo) / (hi - lo), f"interpolated between {lo} and {hi}"


def offline_rows_per_s(benchmark: dict, calls: dict[int, int], workers: int) -> Optional[dict]:
    """workers × Σ rows / Σ call time over the calls the server made; None when the curve cannot say."""
    steady = benchmark.get("steady") or {}
    detail, rows_total, ms_total = [], 0, 0.0
    for rows, count in sorted(calls.items()):
        ms, how = call_ms(steady, rows)
        if ms is None:
            return None
        detail.append({"rows": rows, "calls": count, "call_ms": rounded(ms, 3), "from": how})
        rows_total += rows * count
        ms_total += ms * count
    if not rows_total or ms_total <= 0:
        return None
    per_process = rows_total / (ms_total / 1000.0)
    return {"source": "benchmark", "value": per_process * workers, "per_process_rows_per_s": per_process,
            "workers": workers,
            "threads_per_process": benchmark.get("threads"), "calls": detail,
            "formula": "workers x sum(rows) / sum(call time) over the model calls the server made, each call of "
                       "b rows taking b / throughput_sps(b) of the benchmark's steady state"}


def alone_batch(seen: dict, configured: Optional[int] = None) -> tuple[int, str]:
    """Requests per server batch for the model alone: the size of TorchServe's batches that carried
    most of the load's requests (ties: the larger), else the configured batchSize, else 1."""
    carried = {int(k): int(k) * int(n) for k, n in (seen or {}).items() if int(n) > 0 and int(k) > 0}
    if carried:
        k = max(carried, key=lambda b: (carried[b], b))
        share = carried[k] / sum(carried.values())
        return k, (f"the batches TorchServe formed under the load: {k} request(s), "
                   f"{100 * share:.0f}% of its requests")
    if configured:
        return int(configured), "the configured batchSize (no batch was seen in the logs)"
    return 1, "one request per batch (no batch seen, no batchSize known)"


def whole_batches(cases: list[HttpCase], batch: int) -> list[HttpCase]:
    """`cases` repeated until their count is a multiple of `batch`: every server batch the model alone
    runs (model_alone.server_batches) then holds exactly `batch` requests."""
    return list(cases) * (max(1, batch) // math.gcd(len(cases), max(1, batch)))


def offline_alone(alone: Optional[dict], texts: int) -> Optional[dict]:
    """The model-alone figure in rows/s from model_alone.measure's record (`batch_basis` added by
    measure_rerank_load); None when it did not measure."""
    if not alone or not alone.get("ok") or not alone.get("rows_per_s"):
        return None
    batch, rows = int(alone["batch_size"]), int(alone["batch_rows"])
    return {"source": "model_alone", "value": alone["rows_per_s"], "requests_per_s": alone.get("requests_per_s"),
            "workers": alone.get("workers"), "threads_per_process": alone.get("threads_per_process"),
            "batch_size": batch, "batch_basis": alone.get("batch_basis"), "batch_rows": rows,
            "rows_per_request": texts,
            "model_calls_per_batch": {str(k): v for k, v in model_calls_formed({batch: 1}, texts, rows).items()},
            "window_s": alone.get("window_s"), "overlap": alone.get("overlap"), "measured": alone,
            "formula": "the served variant alone in `workers` processes at once, this run, on the rerank load's own "
                       "requests (server batches of batch_size requests fanned out into model calls of batch_rows "
                       "rows, as the handler does): sum over the processes of rows run / their common window"}


def rerank_figure(load: dict, *, texts: int, clients: int, batch_rows: int, workers: int, benchmark: dict,
                  variant: Optional[str], configured_batch: Optional[int] = None,
                  alone: Optional[dict] = None) -> dict:
    """The record of one rerank load: served rows/s, offline rows/s, ratio. `alone`: model_alone.measure
    on this load's requests (its `ok` false, or None: not measured — the benchmark's figure stands in)."""
    ok, wall = int(load.get("requests_ok") or 0), float(load.get("wall_s") or 0.0)
    rows_answered = ok * texts
    served = rows_answered / wall if wall > 0 else None
    seen = load.get("batch_sizes_seen") or {}
    basis = "the batches TorchServe formed under this load (its PredictionTime lines)"
    if not seen and configured_batch:
        seen, basis = {str(configured_batch): 1}, "the configured batchSize (no batch was seen in the logs)"
    calls = model_calls_formed(seen, texts, batch_rows)
    benchmarked = offline_rows_per_s(benchmark, calls, workers) if calls else None
    measured = offline_alone(alone, texts)
    offline = measured or benchmarked
    value = offline["value"] if offline else None
    ratio = served / value if served and value else None
    bench_value = benchmarked["value"] if benchmarked else None
    if measured:
        why = ("the model alone measured in this run on this load's own requests: same run, same rows, the "
               "same model calls (the benchmark's figure is another hour's, on its synthetic feeds: "
               "`offline_benchmark`, for comparison only)")
    else:
        failed = "; ".join(str(e) for e in ((alone or {}).get("errors") or [])) or "not measured"
        why = (f"the model alone could not be measured in this run ({failed[:300]}): the benchmark's figure at "
               f"the calls the server made stands in (another hour, its synthetic feeds)" if benchmarked else
               f"none: the model alone could not be measured in this run ({failed[:300]}) and the benchmark "
               f"has no steady-state curve")
    return {"texts_per_query": texts, "clients": clients, "rows_per_request": texts, "batch_rows": batch_rows,
            "workers": workers, "variant": variant,
            "requests_ok": ok, "rows_answered": rows_answered, "wall_s": rounded(wall, 4),
            "served_rows_per_s": rounded(served, 2), "served_requests_per_s": rounded(load.get("throughput_rps"), 2),
            "p50_ms": rounded(load.get("p50_ms")), "p99_ms": rounded(load.get("p99_ms")),
            "batches_formed": seen, "batches_basis": basis,
            "model_calls": {str(k): v for k, v in calls.items()},
            "offline_rows_per_s": rounded(value, 2), "offline": offline,
            "offline_source": offline["source"] if offline else None, "offline_why": why,
            "offline_benchmark": benchmarked,
            "model_alone_errors": None if measured or alone is None else (alone.get("errors") or ["not measured"]),
            "served_vs_offline": rounded(ratio, 4),
            "served_vs_offline_benchmark": rounded(served / bench_value if served and bench_value else None, 4),
            "ratio_formula": "served_rows_per_s / offline_rows_per_s, offline = " + (
                "the model alone on this load's own requests, this run (offline_source model_alone)" if measured else
                "the benchmark's figure at the calls the server made (offline_source benchmark: see offline_why)"),
            "target": TARGET,
            "meets_target": None if ratio is None else ratio >= TARGET,
            "units": {"rows": "query-text pairs (one model row each)", "batches_formed": "requests per TorchServe batch",
                      "model_calls": "rows per model call: number of calls", "p50_ms/p99_ms": "per request"},
            "load": load}


# --------------------------------------------------------------------------- the served load
def measure_rerank_load(spec: ServerSpec, cases: list[HttpCase], *, clients: int, requests: int, time_cap_s: float,
                        warmup_s: float, batch_rows: int, workers: int, benchmark: dict, variant: Optional[str],
                        configured_batch: Optional[int] = None, workdir: Optional[Path] = None,
                        model_alone: Optional[Callable[[list[HttpCase], int], dict]] = None) -> dict:
    """Start `spec`, warm it up with the same load for `warmup_s`, serve `requests` (or `time_cap_s`)
    of `cases` from `clients` keep-alive clients, stop it; then, the server stopped, the model alone on
    the same `cases` (`model_alone(cases, requests per server batch)` → model_alone.measure's record,
    run as the workers run it; None: not measured); the figure (`rerank_figure`) or an error."""
    counts = {rows_of(c) for c in cases}
    if len(counts) != 1:
        raise ValueError(f"the rerank load needs one texts count per request, got {sorted(counts)}")
    texts = counts.pop()
    ts = TorchServe(spec.config, spec.model_store, spec.name, models=spec.models, workdir=workdir, env=spec.env)
    try:
        with ts:
            warm = run_load(ts, cases, 10 ** 9, clients, warmup_s) if warmup_s > 0 else None
            load = asdict(run_load(ts, cases, requests, clients, time_cap_s))
            ready_s = ts.readiness.ready_s
    except (ModelNotReady, TorchServeError) as e:
        return {"error": str(e)[:2000], "texts_per_query": texts, "clients": clients}
    ts.cleanup()
    alone = None
    if model_alone is not None:
        batch, batch_basis = alone_batch(load.get("batch_sizes_seen") or {}, configured_batch)
        try:
            alone = model_alone(whole_batches(cases, batch), batch)
        except Exception as e:   # a measurement, not a check: the record says why and the benchmark stands in
            alone = {"ok": False, "errors": [f"{type(e).__name__}: {e}"]}
        alone = {**alone, "batch_basis": batch_basis}
        if not alone.get("ok"):
            log.warning("rerank load: the model alone was not measured in this run (%s): the ratio uses the "
                        "benchmark's figure", alone.get("errors"))
    out: dict[str, Any] = rerank_figure(load, texts=texts, clients=clients, batch_rows=batch_rows, workers=workers,
                                        benchmark=benchmark, variant=variant, configured_batch=configured_batch,
                                        alone=alone)
    out["warmup"] = {"seconds": warmup_s, "requests_ok": warm.requests_ok} if warm else None
    out["ready_s"] = ready_s
    log.info("rerank load: %s texts/query from %d clients: %s rows/s served, %s rows/s offline (%s; benchmark %s) "
             "at the calls it formed %s: %s (target %.1f)", out["texts_per_query"], clients, out["served_rows_per_s"],
             out["offline_rows_per_s"], out["offline_source"], rounded((out["offline_benchmark"] or {}).get("value"), 2),
             out["model_calls"], out["served_vs_offline"], TARGET)
    return out


def failures_of(figure: dict) -> list[str]:
    """What makes the load itself a failure (not the ratio: measured, not asserted)."""
    if figure.get("error"):
        return [f"rerank load: the winner could not be served: {figure['error'][:300]}"]
    load = figure.get("load") or {}
    out = []
    if load.get("errors_5xx") or load.get("lost") or load.get("errors_4xx"):
        out.append(f"rerank load: {load.get('errors_4xx')} 4xx, {load.get('errors_5xx')} 5xx, {load.get('lost')} lost "
                   f"of {load.get('requests_sent')}: {load.get('failures')}")
    if not figure.get("requests_ok"):
        out.append("rerank load: no request succeeded")
    return out
