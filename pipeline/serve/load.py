"""The load generator: a bounded number of requests from keep-alive clients against a running
TorchServe, with the latencies, throughput and the batch sizes TorchServe actually formed.

Batch sizes come from TorchServe itself: every batch the backend runs logs one PredictionTime
metric carrying all of its request ids, and every response carries its `x-request-id`, so the
load's own requests are matched to the batches that served them.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from pipeline.serve.http_cases import HttpCase
from pipeline.serve.torchserve import TorchServe

# One request's outcome: (index, HTTP status or None when lost, ms, x-request-id, error text).
_Record = tuple[int, Optional[int], float, Optional[str], Optional[str]]


@dataclass
class LoadResult:
    requests_planned: int
    requests_sent: int
    requests_answered: int
    requests_ok: int
    errors_4xx: int
    errors_5xx: int
    lost: int                       # sent but never answered (connection error / timeout)
    p50_ms: Optional[float]
    p99_ms: Optional[float]
    mean_ms: Optional[float]
    throughput_rps: Optional[float]
    wall_s: float
    concurrency: int
    stopped_by_time_cap: bool
    batch_sizes_seen: dict = field(default_factory=dict)   # {"<size>": number of batches}
    mean_batch_size: Optional[float] = None
    failures: list = field(default_factory=list)            # first few non-200 / lost, for the log


def run_load(ts: TorchServe, cases: list[HttpCase], requests: int, concurrency: int,
             time_cap_s: float, request_timeout_s: Optional[float] = None) -> LoadResult:
    """A fixed number of requests from `concurrency` keep-alive clients, cycling through the
    cases; no new request after `time_cap_s`, and no request waits longer than that (or than
    `request_timeout_s` when given: a short timed window must not count slow answers as lost)."""
    lock = threading.Lock()
    counter = iter(range(requests))
    records: list[_Record] = []
    t0 = time.perf_counter()
    deadline = t0 + time_cap_s
    capped = [False]

    def worker():
        client = ts.api.client(timeout_s=request_timeout_s or time_cap_s, retry_stale=False)
        try:
            while True:
                with lock:
                    if time.perf_counter() > deadline:
                        capped[0] = True
                        return
                    i = next(counter, None)
                if i is None:
                    return
                case = cases[i % len(cases)]
                try:
                    r = client.request("POST", ts.api.predictions_path(), case.body, case.content_type)
                    rec = (i, r.status, r.ms, r.request_id, None if r.status == 200 else r.error_text())
                except Exception as e:   # noqa: BLE001 — a lost request is a result, recorded
                    client.close()
                    rec = (i, None, 0.0, None, f"{type(e).__name__}: {e}")
                with lock:
                    records.append(rec)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(time_cap_s + (request_timeout_s or time_cap_s) + 30)
    wall = time.perf_counter() - t0
    return _result(ts, records, requests=requests, concurrency=concurrency, wall=wall, capped=capped[0])


def _result(ts: TorchServe, records: list[_Record], *, requests: int, concurrency: int, wall: float,
            capped: bool) -> LoadResult:
    """The figures of the load's records, with the batches TorchServe formed for its answered requests."""
    answered = [r for r in records if r[1] is not None]
    ok = [r for r in answered if r[1] == 200]
    lat = np.asarray([r[2] for r in ok], dtype=np.float64)
    sizes = ts.log.batch_sizes_for(r[3] for r in ok)
    n_batches = sum(sizes.values())
    return LoadResult(
        requests_planned=requests, requests_sent=len(records), requests_answered=len(answered),
        requests_ok=len(ok), errors_4xx=sum(1 for r in answered if 400 <= r[1] < 500),
        errors_5xx=sum(1 for r in answered if r[1] >= 500), lost=len(records) - len(answered),
        p50_ms=_pct(lat, 50), p99_ms=_pct(lat, 99), mean_ms=float(lat.mean()) if lat.size else None,
        throughput_rps=len(ok) / wall if wall > 0 else None, wall_s=wall, concurrency=concurrency,
        stopped_by_time_cap=capped,
        batch_sizes_seen={str(k): v for k, v in sorted(sizes.items())},
        mean_batch_size=(sum(k * v for k, v in sizes.items()) / n_batches) if n_batches else None,
        failures=[{"i": r[0], "status": r[1], "error": r[4]} for r in records if r[1] != 200][:5])


def _pct(a: np.ndarray, q: float) -> Optional[float]:
    return float(np.percentile(a, q)) if a.size else None
