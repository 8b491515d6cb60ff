"""The operating point: the batch to serve at (and its batch delay) on a variant's measured
latency-vs-batch curve, bounded by what the expected load fills and by the latency SLO.

Used by `pipeline/decide/serve_config.py` (the derivation), `pipeline/decide/selection.py` (a variant
is judged at exactly the point it will be served at) and `pipeline/serve/tune/candidates.py` (the tune
stage's alternatives). The curve is in rows (one model call of `batch_size` rows); a request of a
multi-row task (rerank) is many rows, and every figure that a request sees is computed through
`pipeline/decide/rows.py`: the SLO is judged on a request's latency (all model calls of its batch +
the batch delay), the delay on the time a batch of requests takes to fill.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from pipeline.decide.rows import (fill_limit_rows, fill_wait_ms, model_calls, multi_row, request_work_ms,
                                  requests_per_batch)

# --------------------------------------------------------------------------- value objects
@dataclass(frozen=True)
class CurvePoint:
    """One measured batch size of the steady-state curve (metrics/benchmark/<v>.json `steady`)."""
    batch_size: int
    p50_ms: float
    p99_ms: float
    throughput_sps: float
    cv: float = 0.0                 # per-call coefficient of variation
    peak_rss_mb: Optional[float] = None
    peak_gpu_mb: Optional[float] = None
    noisy: bool = False
    spread: float = 0.0             # how far the p50s of the rounds (fresh processes) disagree

    @property
    def noise(self) -> float:
        """The relative uncertainty of this point's figures: per-call CV or cross-process spread,
        whichever is larger."""
        return max(self.cv, self.spread)


@dataclass(frozen=True)
class OperatingPoint:
    """Where a variant will be served: batch size (rows per model call), batch delay and the figures
    measured there."""
    batch_size: int
    delay_ms: int
    batch_p99_ms: float
    request_p99_ms: float           # the model calls of a request's batch (p99 each) + the batch delay
    throughput_sps: float           # rows/s (= requests/s for a one-row task)
    noise: float                    # the served point's CurvePoint.noise
    fits_slo: bool
    steps: list = field(default_factory=list)   # why this batch: one line per measured batch
    batch_requests: Optional[int] = None        # TorchServe's batchSize (requests); None: = batch_size (one row each)
    rows_per_request: float = 1.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)



def noise_between(a: CurvePoint, b: CurvePoint, floor: float) -> float:
    """Relative difference two throughput figures of ONE variant must exceed to count as real.

    The per-call CV is taken as the uncertainty: deliberately conservative (whole-run means differ
    by more than their standard error suggests). Not the rounds' spread: a variant's batch sizes
    were measured in the same rounds, interleaved, so host drift moves them together; the spread
    matters when comparing variants measured at different times (selection). Independent errors
    add in quadrature."""
    return max(floor, math.hypot(a.cv, b.cv))


# Where no wait can meet the SLO: the longest wait for a batch to fill, as a share of the batch's p99.
OUT_OF_SLO_WAIT_SHARE = 0.1


def batch_delay_ms(point: CurvePoint, slo_ms: float, headroom_share: float, workers: int = 1, *,
                   rows_per_request: float = 1.0, batch_requests: Optional[int] = None) -> tuple[int, dict]:
    """maxBatchDelay for a batch: at most a share of the SLO headroom left by a request's model time
    (its batch's calls, p99 each; one row per request: the batch's p99), at most the time the batch
    takes to fill when the workers run at that batch's throughput (waiting longer only adds latency
    under load), and at least 1 ms (TorchServe turns 0 into 100 ms). Where the batch's own time leaves
    no headroom, the fill time capped at OUT_OF_SLO_WAIT_SHARE of its p99. `batch_requests`: TorchServe's
    batch in requests (default: what fills `point.batch_size` rows)."""
    r = rows_per_request
    requests = batch_requests if batch_requests is not None else requests_per_batch(point.batch_size, r)
    work = request_work_ms(point.p99_ms, requests, r, point.batch_size)
    headroom = slo_ms - work
    fill_ms = fill_wait_ms(requests, r, point.throughput_sps, workers)
    inputs = {"slo_ms": slo_ms, "batch_p99_ms": point.p99_ms, "headroom_ms": round(headroom, 3),
              "headroom_share": headroom_share, "fill_ms": round(fill_ms, 3), "workers": workers,
              "throughput_sps": point.throughput_sps, "batch_size": point.batch_size}
    if headroom > 0:
        delay = max(1, int(math.floor(min(headroom * headroom_share, fill_ms))))
    else:
        # The SLO is out of reach at this batch whatever the wait. A 1 ms wait is shorter than the
        # answered clients take to send their next requests, so batches leave part-full and the
        # workers run small batches (bert-large at batch 8: 4.7 requests a batch, 0.76 of the model
        # alone's rate). Wait for the batch to fill instead, at most a share of its own time.
        cap = point.p99_ms * OUT_OF_SLO_WAIT_SHARE
        delay = max(1, int(math.floor(min(fill_ms, cap))))
        inputs.update(slo_out_of_reach=True, wait_cap_ms=round(cap, 3), wait_share_of_batch=OUT_OF_SLO_WAIT_SHARE)
    if multi_row(r):
        inputs.update(rows_per_request=r, batch_requests=requests, request_work_ms=round(work, 3),
                      model_calls=model_calls(requests, r, point.batch_size),
                      units="batch_size and throughput_sps in rows; batch_requests, fill_ms in requests")
    return delay, inputs


def choose_operating_point(curve: list[CurvePoint], slo_ms: float, *, objective: str = "throughput",
                           min_gain: float = 0.05, noise_floor: float = 0.03,
                           headroom_share: float = 0.5, workers: int = 1,
                           max_batch: Optional[int] = None, rows_per_request: float = 1.0,
                           fill_requests: Optional[int] = None) -> OperatingPoint:
    """The batch (rows per model call) to serve at.

    max_batch: the largest batch the expected load can fill on every worker at once (`fill_limit`,
    in rows); bigger measured batches are skipped: under that load they would only ever leave partly
    full, after waiting maxBatchDelay. The smallest measured batch stays a candidate whatever the limit.
    throughput / cold_load objectives: walk the measured batches upwards; a batch that fits the SLO
    (a request's model time + its delay) replaces the current choice only if its throughput beats the
    CURRENT CHOICE by more than max(min_gain, noise). Comparing with the choice, not the neighbour,
    handles a non-monotonic curve: 1:100, 2:200, 4:150, 8:205 stays at 2. latency objective: the
    smallest measured batch with no wait (several rows per request: the batch whose calls answer a
    request soonest). Nothing fits: the batch with the lowest request time (fits_slo False).
    rows_per_request, fill_requests: a request's rows and the requests a worker can hold at once
    (pipeline/decide/rows.py); one row per request by default."""
    steps = []
    r, many = rows_per_request, multi_row(rows_per_request)

    def requests_at(p: CurvePoint) -> int:
        return requests_per_batch(p.batch_size, r, fill_requests)

    def work(p: CurvePoint) -> float:
        return request_work_ms(p.p99_ms, requests_at(p), r, p.batch_size)

    def point_at(p: CurvePoint) -> tuple[int, float]:
        d, _ = batch_delay_ms(p, slo_ms, headroom_share, workers, rows_per_request=r, batch_requests=requests_at(p))
        return d, work(p) + d

    def op(p: CurvePoint, delay: int, request_ms: float, fits: bool) -> OperatingPoint:
        return OperatingPoint(p.batch_size, delay, p.p99_ms, request_ms, p.throughput_sps, p.noise, fits, steps,
                              batch_requests=requests_at(p), rows_per_request=r)

    def name(p: CurvePoint) -> str:
        return f"batch {p.batch_size}" + (" rows" if many else "")

    if max_batch is not None:
        over = [p for p in curve[1:] if p.batch_size > max_batch]
        if over:
            steps.append(f"batch {', '.join(str(p.batch_size) for p in over)}: above {max_batch}, the largest batch "
                         f"the expected concurrent requests fill on each of {workers} worker(s)"
                         + (f" at {r:g} rows per request" if many else "") + ": skipped")
        curve = curve[:1] + [p for p in curve[1:] if p.batch_size <= max_batch]
    fitting = []
    for p in curve:
        ok = work(p) + 1 <= slo_ms          # with the 1 ms minimum delay
        if ok:
            fitting.append(p)
        elif many:
            steps.append(f"{name(p)}: a request's {model_calls(requests_at(p), r, p.batch_size)} call(s) × p99 "
                         f"{p.p99_ms:.1f} ms + 1 ms delay exceeds the SLO {slo_ms:g} ms")
        else:
            steps.append(f"batch {p.batch_size}: p99 {p.p99_ms:.1f} ms + 1 ms delay exceeds the SLO {slo_ms:g} ms")
    if not fitting:
        best = min(curve, key=work)
        steps.append(f"no batch fits: lowest {'request time' if many else 'p99'} is {name(best)}")
        return op(best, 1, work(best) + 1, False)
    if objective == "latency":
        chosen = min(fitting, key=work) if many else fitting[0]
        steps.append(f"objective latency: {'fastest answer' if many else 'smallest batch'} {chosen.batch_size}, no wait")
        return op(chosen, 1, work(chosen) + 1, True)
    chosen = fitting[0]
    steps.append(f"{name(chosen)}: fits, {chosen.throughput_sps:.1f} {'rows' if many else 'samples'}/s (start)")
    for p in fitting[1:]:
        need = noise_between(chosen, p, max(min_gain, noise_floor))
        gain = p.throughput_sps / chosen.throughput_sps - 1 if chosen.throughput_sps > 0 else math.inf
        if gain > need:
            steps.append(f"{name(p)}: +{gain:.1%} over batch {chosen.batch_size} > {need:.1%}: taken")
            chosen = p
        else:
            steps.append(f"{name(p)}: {gain:+.1%} over batch {chosen.batch_size} <= {need:.1%}: not worth it")
    d, req = point_at(chosen)
    return op(chosen, d, req, True)


def fill_limit(expected_concurrency: int, workers: int, rows_per_request: float = 1.0) -> int:
    """The largest batch (rows) every worker can fill at once when `expected_concurrency` requests
    are in flight: TorchServe splits the queue between its workers, so a bigger batch only ever
    leaves after maxBatchDelay, part full, and the workers idle while it waits."""
    return fill_limit_rows(expected_concurrency, workers, rows_per_request)
