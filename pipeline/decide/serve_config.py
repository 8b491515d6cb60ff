"""TorchServe settings derived from the winner's measurements.

Every value is a `Derived` record — value, formula, the inputs it was computed from, and whether
`serve.overrides.*` replaced it — so `artifacts/serve/derivation.json` explains each setting.
Plain data in (benchmark / env dicts as in docs/artifacts.md, serve params as a dict or ServeParams),
plain data out; the writers in `pipeline/decide/properties.py` turn the result into files.

The operating point (batch size + batch delay on a latency-vs-batch curve) comes from
`pipeline/decide/operating_point.py`, which `pipeline/decide/selection.py` uses too, so the variant is
chosen at exactly the point it will be served at. Units (`pipeline/decide/rows.py`): `batch_size` is
TorchServe's batchSize, in requests; `batch_rows` the rows per model call, the curve's batch; for a
one-row task they are equal.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from pipeline.decide.operating_point import (CurvePoint, OperatingPoint, batch_delay_ms,  # noqa: F401 (re-exported)
                                             choose_operating_point, fill_limit, noise_between)
from pipeline.decide.rows import model_calls, multi_row, requests_per_batch
from pipeline.decide.serve_inputs import (REFERENCE_DISK_MB_S, DerivationError, Derived, cold_load_ms,
                                          curve_from_benchmark, from_disk, plan_workers, request_limits, serve_dict)
# The derivation's importers take these from here too.
from pipeline.decide.serve_inputs import (TS_DEFAULT_MAX_REQUEST_SIZE, derivation_as_dict,  # noqa: F401 (re-exported)
                                          served_workers, usable_cores, values, worker_memory_mb)
from pipeline.decide.store_form import choose_store_form


def derive_serve_config(benchmark: dict, env: dict, serve: Any, *, task: Optional[dict] = None,
                        sample_elements: Optional[dict] = None, rows: Optional[dict] = None) -> dict[str, Derived]:
    """All TorchServe settings for the winner. Keys match `serve.overrides.*` (but `device` and
    `rows_per_request`). rows: the expected load's rows per request (`pipeline.decide.rows.rows_of_cases`);
    None: one row per request."""
    s = serve_dict(serve)
    overrides = s.get("overrides") or {}
    slo = float(s["latency_slo_ms"])
    curve = curve_from_benchmark(benchmark)
    device = benchmark.get("device") or env.get("device") or "cpu"
    out: dict[str, Derived] = {}

    def put(key: str, d: Derived) -> Derived:
        ov = overrides.get(key)
        if ov is not None:
            d = Derived(ov, d.formula, d.inputs, overridden=True, derived_value=d.value)
        out[key] = d
        return d

    out["device"] = Derived(device, "the device the winner was benchmarked on", {"benchmark.device": device})

    # ---- workers × threads first: how many workers share the queue bounds the batch they can fill
    workers_d, threads_d = plan_workers(benchmark, env, s, curve)
    workers = put("workers", workers_d).value
    threads = int(put("threads_per_worker", threads_d).value)

    # ---- the batch: rows per model call on the curve, then TorchServe's batchSize in requests
    conc = int(s.get("expected_concurrency", 16))
    r = float((rows or {}).get("rows_per_request") or 1.0)
    many, fill_req = multi_row(r), max(1, conc // max(1, workers))
    out["rows_per_request"] = Derived(r, "mean model rows per request of the expected load (the golden HTTP cases, "
                                         "decoded by the task's adapter); 1: one row per request",
                                      dict(rows or {"source": "not given: one row per request"}))
    max_batch = fill_limit(conc, workers, r)
    op = choose_operating_point(curve, slo, objective=s.get("objective", "throughput"),
                                min_gain=s.get("min_batch_gain", 0.05), noise_floor=s.get("noise_floor", 0.03),
                                headroom_share=s.get("delay_headroom_share", 0.5), workers=workers,
                                max_batch=max_batch, rows_per_request=r, fill_requests=fill_req)
    chosen = Derived(op.batch_size,
        ("largest measured batch (rows per model call) whose model calls for a request (p99 each) + delay <= SLO "
         "and batch <= expected_concurrency × rows_per_request // workers" if many else
         "largest measured batch with p99 + delay <= SLO and batch <= expected_concurrency // workers") +
        " whose throughput beats the current choice by more than max(min_batch_gain, noise); objective latency: "
        + ("the batch that answers a request soonest" if many else "smallest batch"),
        {"slo_ms": slo, "objective": s.get("objective"), "fits_slo": op.fits_slo,
         "expected_concurrency": conc, "workers": workers, "max_batch": max_batch, "rows_per_request": r,
         "steps": op.steps,
         "curve": {p.batch_size: {"p99_ms": p.p99_ms, "throughput_sps": p.throughput_sps, "cv": p.cv,
                                   "spread": p.spread}
                   for p in curve}})
    if many:
        batch_rows = put("batch_rows", chosen).value
        batch = put("batch_size", Derived(requests_per_batch(batch_rows, r, fill_req),
            "requests (TorchServe's batchSize) whose rows fill one model call: "
            "max(1, min(floor(batch_rows / rows_per_request), expected_concurrency // workers))",
            {"batch_rows": batch_rows, "rows_per_request": r, "expected_concurrency": conc, "workers": workers})).value
    else:
        batch = put("batch_size", chosen).value
        batch_rows = put("batch_rows", Derived(batch, "one row per request: = batch_size", {"batch_size": batch})).value
    point = _point_for(batch_rows, curve)
    calls = model_calls(batch, r, batch_rows)

    # ---- batch delay, now that the number of workers sharing the queue is known
    if s.get("objective") == "latency" and not overrides.get("batch_size") and not overrides.get("batch_rows"):
        delay, dinputs = 1, {"objective": "latency"}
        dformula = "objective latency: 1 ms (no wait; 0 would become 100 ms)"
    else:
        delay, dinputs = batch_delay_ms(point, slo, float(s.get("delay_headroom_share", 0.5)), workers,
                                        rows_per_request=r, batch_requests=batch)
        if batch == 1:
            dformula = "batch 1: 1 ms (nothing to wait for; 0 would become 100 ms)"
        elif many:
            dformula = ("max(1, floor(min(delay_headroom_share × (SLO − model calls × p99(batch_rows)), "
                        "(batch_size − 1) × rows_per_request × 1000 / (workers × rows/s(batch_rows)))))")
        else:
            dformula = ("max(1, floor(min(delay_headroom_share × (SLO − p99(batch)), "
                        "(batch − 1) × 1000 / (workers × throughput(batch)))))")
    delay = put("max_batch_delay_ms", Derived(delay, dformula, dinputs)).value
    if delay <= 0:
        raise DerivationError(f"serve.overrides.max_batch_delay_ms = {delay}: TorchServe turns 0 into 100 ms; "
                              f"use 1 for 'no wait'")

    # ---- timeouts, for a worker with fewer intra-op threads than the curve was measured with (a
    # workers × threads layout other than the benchmark's) on a slower call: at most threads-fold
    # (threads speed a call up at most linearly).
    bench_threads = int(benchmark.get("threads") or 1)
    thread_scale = bench_threads / threads if device == "cpu" and 0 < threads < bench_threads else 1.0
    tpoint = dataclasses.replace(point, p99_ms=point.p99_ms * thread_scale) if thread_scale != 1.0 else point
    scaled = ({"benchmark_threads": bench_threads, "threads_per_worker": threads,
               "curve_p99_ms": point.p99_ms, "thread_scale": round(thread_scale, 3)} if thread_scale != 1.0 else {})
    tnote = " (p99 × benchmark threads / threads_per_worker)" if scaled else ""
    med_ms, max_ms = cold_load_ms(benchmark)
    disk = from_disk(benchmark)
    # The first start on a host reads the artifact from the disk; every later one from memory.
    worst_ms = max(max_ms, disk["total_ms"]) if disk else max_ms
    safety, margin = float(s["startup_safety"]), float(s["startup_margin_s"])
    worker_import = float(s.get("worker_import_s", 1.3))
    warmup_s = tpoint.p99_ms / 1000.0
    artifact_bytes = int(benchmark.get("artifact_bytes") or 0)
    raw_read_ms = (benchmark.get("cold_load") or {}).get("raw_read_ms")
    read_ms = disk["raw_read_ms"] if disk else raw_read_ms      # this host's disk, when it was measured
    measured_mb_s = (artifact_bytes / 1e6) / (read_ms / 1000.0) if read_ms and artifact_bytes else None
    target = s.get("target_disk_read_mb_s")
    base_s = (worst_ms / 1000.0 + worker_import + warmup_s) * safety + margin

    def slower_disk_s(mb_s: Optional[float]) -> float:
        return artifact_bytes / 1e6 / float(mb_s) if mb_s and artifact_bytes and (
            measured_mb_s is None or mb_s < measured_mb_s) else 0.0

    def timeout_for(extra_s: float) -> int:
        return max(int(s["startup_floor_s"]), int(math.ceil(base_s + extra_s)))
    disk_s = slower_disk_s(target)
    raw = base_s + disk_s
    put("startup_timeout_s", Derived(timeout_for(disk_s),
        "max(startup_floor_s, ceil((worst cold load, from the page cache or the disk + worker torch import "
        "+ warm-up call at batchSize) × startup_safety + startup_margin_s + [artifact MB / "
        "target_disk_read_mb_s when that disk is slower than the measured read]))" + tnote,
        {"cold_load_max_ms": max_ms, "cold_load_median_ms": med_ms,
         "cold_load_from_disk_ms": disk["total_ms"] if disk else None, "worst_cold_load_ms": worst_ms,
         "worker_import_s": worker_import,
         "warmup_ms": tpoint.p99_ms, "startup_safety": safety, "startup_margin_s": margin, **scaled,
         "artifact_bytes": artifact_bytes, "raw_read_ms": raw_read_ms,
         "disk_raw_read_ms": disk["raw_read_ms"] if disk else None,
         "measured_read_mb_s": round(measured_mb_s, 1) if measured_mb_s else None,
         "target_disk_read_mb_s": target, "disk_read_s": round(disk_s, 3),
         "startup_floor_s": s["startup_floor_s"], "unrounded_s": round(raw, 3),
         # What a plain 200 MB/s disk (a cloud volume, a cold host) would need, whatever the target.
         "at_reference_disk": {"read_mb_s": REFERENCE_DISK_MB_S,
                               "disk_read_s": round(slower_disk_s(REFERENCE_DISK_MB_S), 3),
                               "startup_timeout_s": timeout_for(slower_disk_s(REFERENCE_DISK_MB_S))}}))

    # ---- how the model sits in the model store: .mar, or the .mar unpacked into a folder
    form, fformula, finputs = choose_store_form(artifact_bytes or None, raw_read_ms,
                                                float(s.get("folder_store_min_mb", 500.0)))
    put("store_form", Derived(form, fformula, finputs))
    rsafety = float(s["response_safety"])
    rraw = (tpoint.p99_ms * calls * rsafety + delay) / 1000.0
    put("response_timeout_s", Derived(max(int(s["response_floor_s"]), int(math.ceil(rraw))),
        ("max(response_floor_s, ceil((p99(batchSize) × response_safety + maxBatchDelay) / 1000))" if calls == 1 else
         "max(response_floor_s, ceil((model calls per batch × p99(batch_rows) × response_safety + maxBatchDelay) / 1000))")
        + tnote,
        {"batch_p99_ms": tpoint.p99_ms, "response_safety": rsafety, "max_batch_delay_ms": delay,
         "response_floor_s": s["response_floor_s"], "unrounded_s": round(rraw, 3),
         **({"model_calls": calls} if calls > 1 else {}), **scaled}))

    # ---- queue and size limits
    put("job_queue_size", Derived(max(2 * conc, 2 * workers * batch),
        "max(2 × expected_concurrency, 2 × workers × batchSize): every expected in-flight request plus "
        "a burst; beyond it TorchServe answers 503 instead of letting requests wait past the SLO",
        {"expected_concurrency": conc, "workers": workers, "batch_size": batch}))
    req, resp = request_limits(task, sample_elements)
    handler_req = put("max_request_bytes", req).value
    # The frontend limit sits above the handler's, so an oversized body gets the handler's clear
    # JSON 413 rather than Netty's bare one; far larger bodies are still cut off by the frontend.
    put("max_request_size", Derived(int(handler_req) * 2, "2 × max_request_bytes (the handler's own limit)",
                                    {"max_request_bytes": handler_req}))
    put("max_response_size", resp)
    return out


# --------------------------------------------------------------------------- another operating point
# The settings that make an operating point (derivation keys), and the timeouts that follow from it.
POINT_KEYS = ("batch_size", "batch_rows", "max_batch_delay_ms", "workers", "threads_per_worker")
TIMEOUT_KEYS = ("response_timeout_s", "startup_timeout_s")


def rows_of_derivation(derivation: dict) -> Optional[dict]:
    """The expected load's rows per request a derivation.json was derived with, as `derive_serve_config`'s
    `rows` argument (None: one row per request)."""
    entry = derivation.get("rows_per_request")
    if not isinstance(entry, dict) or entry.get("value") is None:
        return None
    return {**(entry.get("inputs") or {}), "rows_per_request": entry["value"]}


def point_timeouts(benchmark: dict, env: dict, serve: Any, point: dict, *, rows: Optional[dict] = None,
                   label: str = "point", about: Optional[dict] = None) -> dict[str, Derived]:
    """responseTimeout and startupTimeout for an operating point other than the one configure chose
    (a tuner candidate, the hand-tuned reference): `derive_serve_config` on `benchmark` with the point's
    settings (POINT_KEYS present in `point`; batch_rows defaults to batch_size) entering as overrides
    over the user's serve.overrides, which still win for the timeouts themselves. rows: the expected
    load's rows per request (`rows_of_derivation`). Each Derived's inputs also name the point, under
    `label`: its settings, the rows per request and `about` (e.g. which benchmark)."""
    s = serve_dict(serve)
    pt = {k: point[k] for k in POINT_KEYS if point.get(k) is not None}
    if "batch_size" in pt:
        pt.setdefault("batch_rows", pt["batch_size"])
    s["overrides"] = {**{k: v for k, v in (s.get("overrides") or {}).items() if v is not None}, **pt}
    derived = derive_serve_config(benchmark, env, s, rows=rows)
    named = {**pt, "rows_per_request": derived["rows_per_request"].value, **(about or {})}
    return {k: dataclasses.replace(derived[k], inputs={**derived[k].inputs, label: named}) for k in TIMEOUT_KEYS}


def _point_for(batch: int, curve: list[CurvePoint]) -> CurvePoint:
    """The measured point for `batch`; for an override that was not measured, the next larger
    measured batch (conservative) or a linear extrapolation of the largest one."""
    for p in curve:
        if p.batch_size >= batch:
            if p.batch_size == batch:
                return p
            return dataclasses.replace(p, batch_size=batch)
    top = curve[-1]
    k = batch / top.batch_size
    return dataclasses.replace(top, batch_size=batch, p50_ms=top.p50_ms * k, p99_ms=top.p99_ms * k)

