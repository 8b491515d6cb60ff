"""The rerank load (issue 26): rows/s served against the rows/s the model gives offline at the batches
the server really forms.

A rerank request is one query and N texts: ONE HTTP request, N model rows. TorchServe's batch counts
requests; the handler fans a batch's rows out over model calls of at most `batch_rows` rows
(pipeline/decide/rows.py). So serve_check, for task rerank, serves a load of `serve_check.rerank_texts`
texts per query from `serve_check.rerank_clients` keep-alive clients against the winner and records:

- served rows/s = rows answered / wall (rows answered = requests answered 200 × texts per query);
- offline rows/s = what the model alone gives for the model calls the server made: every batch
  TorchServe formed (its PredictionTime lines, in requests) is k × texts rows, split into calls of
  batch_rows; each call of b rows takes b / throughput_sps(b) in metrics/benchmark/<variant>.json's
  steady state (interpolated between measured batch sizes when b was not measured), so
  offline = workers × Σ rows / Σ call time — with every call at one measured batch B, exactly
  workers × throughput_sps(B), as `pipeline.serve.ceiling.model_alone_rps`;
- their ratio, served / offline (issue 26's target 0.7: measured and shown, never asserted).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from pipeline.core.numbers import rounded
from pipeline.serve.http_cases import HttpCase
from pipeline.serve.load import run_load
from pipeline.serve.serve_check import ServerSpec
from pipeline.serve.torchserve import ModelNotReady, TorchServe, TorchServeError

log = logging.getLogger(__name__)

TARGET = 0.7            # issue 26: served rows/s >= 0.7 x the model's own offline rows/s at the served batch
CASES = 16              # distinct queries the load cycles through


def rerank_cases(golden_dir: Path, texts: int, n: int = CASES, seed: int = 1) -> list[HttpCase]:
    """`n` rerank requests of exactly `texts` texts each, from the task's adapter over the golden
    set's tokenizer (query 5-15 words, passages 30-80 words: handlers/task_rerank.py)."""
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
    return {"value": per_process * workers, "per_process_rows_per_s": per_process, "workers": workers,
            "threads_per_process": benchmark.get("threads"), "calls": detail,
            "formula": "workers x sum(rows) / sum(call time) over the model calls the server made, each call of "
                       "b rows taking b / throughput_sps(b) of the benchmark's steady state"}


def rerank_figure(load: dict, *, texts: int, clients: int, batch_rows: int, workers: int, benchmark: dict,
                  variant: Optional[str], configured_batch: Optional[int] = None) -> dict:
    """The record of one rerank load: served rows/s, offline rows/s at the calls it formed, ratio."""
    ok, wall = int(load.get("requests_ok") or 0), float(load.get("wall_s") or 0.0)
    rows_answered = ok * texts
    served = rows_answered / wall if wall > 0 else None
    seen = load.get("batch_sizes_seen") or {}
    basis = "the batches TorchServe formed under this load (its PredictionTime lines)"
    if not seen and configured_batch:
        seen, basis = {str(configured_batch): 1}, "the configured batchSize (no batch was seen in the logs)"
    calls = model_calls_formed(seen, texts, batch_rows)
    offline = offline_rows_per_s(benchmark, calls, workers) if calls else None
    alone = offline["value"] if offline else None
    ratio = served / alone if served and alone else None
    return {"texts_per_query": texts, "clients": clients, "rows_per_request": texts, "batch_rows": batch_rows,
            "workers": workers, "variant": variant,
            "requests_ok": ok, "rows_answered": rows_answered, "wall_s": rounded(wall, 4),
            "served_rows_per_s": rounded(served, 2), "served_requests_per_s": rounded(load.get("throughput_rps"), 2),
            "p50_ms": rounded(load.get("p50_ms")), "p99_ms": rounded(load.get("p99_ms")),
            "batches_formed": seen, "batches_basis": basis,
            "model_calls": {str(k): v for k, v in calls.items()},
            "offline_rows_per_s": rounded(alone, 2), "offline": offline,
            "served_vs_offline": rounded(ratio, 4), "target": TARGET,
            "meets_target": None if ratio is None else ratio >= TARGET,
            "units": {"rows": "query-text pairs (one model row each)", "batches_formed": "requests per TorchServe batch",
                      "model_calls": "rows per model call: number of calls", "p50_ms/p99_ms": "per request"},
            "load": load}


# --------------------------------------------------------------------------- the served load
def measure_rerank_load(spec: ServerSpec, cases: list[HttpCase], *, clients: int, requests: int, time_cap_s: float,
                        warmup_s: float, batch_rows: int, workers: int, benchmark: dict, variant: Optional[str],
                        configured_batch: Optional[int] = None, workdir: Optional[Path] = None) -> dict:
    """Start `spec`, warm it up with the same load for `warmup_s`, serve `requests` (or `time_cap_s`)
    of `cases` from `clients` keep-alive clients, stop it; the figure (`rerank_figure`) or an error."""
    counts = {rows_of(c) for c in cases}
    if len(counts) != 1:
        raise ValueError(f"the rerank load needs one texts count per request, got {sorted(counts)}")
    texts = counts.pop()
    ts = TorchServe(spec.config, spec.model_store, spec.name, models=spec.models, workdir=workdir, env=spec.env)
    try:
        with ts:
            warm = run_load(ts, cases, 10 ** 9, clients, warmup_s) if warmup_s > 0 else None
            load = run_load(ts, cases, requests, clients, time_cap_s)
            out: dict[str, Any] = rerank_figure(asdict(load), texts=texts, clients=clients, batch_rows=batch_rows,
                                                workers=workers, benchmark=benchmark, variant=variant,
                                                configured_batch=configured_batch)
            out["warmup"] = {"seconds": warmup_s, "requests_ok": warm.requests_ok} if warm else None
            out["ready_s"] = ts.readiness.ready_s
    except (ModelNotReady, TorchServeError) as e:
        return {"error": str(e)[:2000], "texts_per_query": texts, "clients": clients}
    ts.cleanup()
    log.info("rerank load: %s texts/query from %d clients: %s rows/s served, %s rows/s offline at the calls it "
             "formed %s: %s (target %.1f)", out["texts_per_query"], clients, out["served_rows_per_s"],
             out["offline_rows_per_s"], out["model_calls"], out["served_vs_offline"], TARGET)
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
