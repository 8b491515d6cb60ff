"""The candidate operating points the tuner serves: from the offline curve (pipeline/decide/serve_config.py)
the offline choice, larger measured batches up to what the load fills, half the batch the load fills
(a batch queued behind each worker's running one), a shorter delay, the other
workers × threads layout on the same cores; and the frontend alternatives tried on the chosen point.

Units (pipeline/decide/rows.py): a candidate's `batch_size` is TorchServe's batchSize in requests,
its `batch_rows` the rows per model call (the curve's batch); predicted `throughput_rps` is requests/s
(rows/s ÷ rows per request) and `request_p99_ms` a request's model calls + the delay."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from pipeline.decide.operating_point import CurvePoint, batch_delay_ms, choose_operating_point, fill_limit
from pipeline.decide.rows import model_calls, multi_row, requests_per_batch
from pipeline.decide.serve_config import point_timeouts

# Frontend settings tried on the chosen point (config.properties keys; TorchServe 0.12 defaults:
# system metrics collected every minute by a Python subprocess, netty threads = logical cores).
FRONTEND_CANDIDATES: tuple[tuple[str, dict], ...] = (
    ("no system metrics", {"disable_system_metrics": True}),
    ("1 netty thread each", {"number_of_netty_threads": 1, "netty_client_threads": 1}),
)


@dataclass(frozen=True)
class OperatingCandidate:
    name: str
    batch_size: int
    delay_ms: int
    workers: int
    threads: int
    origin: str                                   # offline | larger batch | queued batch | shorter delay | layout | frontend
    frontend: dict = field(default_factory=dict)  # extra config.properties settings
    predicted: Optional[dict] = None              # offline figures {request_p99_ms, throughput_rps} or None
    batch_rows: Optional[int] = None              # rows per model call; None: batch_size (one row per request)
    # responseTimeout / startupTimeout derived for this point (`with_timeouts`): {derivation key: derivation
    # entry}; empty: the configure stage's, from the served model's base model-config.yaml.
    timeouts: dict = field(default_factory=dict, compare=False)

    @property
    def rows(self) -> int:
        return self.batch_rows or self.batch_size

    def point_key(self) -> tuple:
        """The operating point without the frontend settings."""
        return (self.batch_size, self.rows, self.delay_ms, self.workers, self.threads)

    def key(self) -> tuple:
        return self.point_key() + (tuple(sorted(self.frontend.items())),)

    def settings(self) -> dict:
        return {"batch_size": self.batch_size, "batch_rows": self.rows, "max_batch_delay_ms": self.delay_ms,
                "workers": self.workers, "threads_per_worker": self.threads,
                **{k: d["value"] for k, d in self.timeouts.items()},
                **({"frontend": dict(self.frontend)} if self.frontend else {})}

    def describe(self) -> str:
        fe = "".join(f", {k}={v}" for k, v in sorted(self.frontend.items()))
        rows = f" ({self.rows} rows per model call)" if self.rows != self.batch_size else ""
        return f"batch {self.batch_size}{rows}, delay {self.delay_ms} ms, {self.workers}×{self.threads}{fe}"


def _prediction(p: CurvePoint, delay: int, workers: int, threads: int, bench_threads: int,
                requests: Optional[int] = None, rows_per_request: float = 1.0) -> Optional[dict]:
    """What the offline model predicts for the point: per-request p99 = the model calls of a batch of
    `requests` requests (p99 each) + delay; throughput = workers × per-process rows/s ÷ rows per
    request (requests/s). Only for the thread count the curve was measured with."""
    if threads != bench_threads:
        return None
    r = rows_per_request
    calls = model_calls(requests if requests is not None else requests_per_batch(p.batch_size, r), r, p.batch_size)
    out = {"request_p99_ms": round(calls * p.p99_ms + delay, 3), "throughput_rps": round(p.throughput_sps * workers / r, 1)}
    if multi_row(r):
        out["rows_per_s"] = round(p.throughput_sps * workers, 1)
    return out


def candidates_from_curve(curve: list[CurvePoint], offline: dict, *, slo_ms: float, headroom_share: float,
                          expected_concurrency: int, cores: int, bench_threads: int,
                          overridden: frozenset = frozenset(), max_candidates: int = 5,
                          rows_per_request: float = 1.0) -> list[OperatingCandidate]:
    """The offline choice first, then larger measured batches up to the fill bound (each with the
    delay the offline formula gives it), then the other workers × threads layout on the same cores
    with its own offline batch choice. Settings under serve.overrides stay as overridden.
    rows_per_request: the load's rows per request (derivation `rows_per_request`): the curve's batches
    are rows, each candidate's TorchServe batch the requests that fill it (pipeline/decide/rows.py)."""
    r = rows_per_request
    by_batch = {p.batch_size: p for p in curve}
    w0, t0 = int(offline["workers"]), int(offline["threads_per_worker"])
    b0, d0 = int(offline["batch_size"]), int(offline["max_batch_delay_ms"])
    r0 = int(offline.get("batch_rows") or b0)
    p0 = by_batch.get(r0)

    def candidate(name: str, b: int, rows: int, d: int, w: int, t: int, origin: str, p) -> OperatingCandidate:
        return OperatingCandidate(name, b, d, w, t, origin, batch_rows=rows,
                                  predicted=_prediction(p, d, w, t, bench_threads, b, r) if p else None)

    out = [candidate("offline choice", b0, r0, d0, w0, t0, "offline", p0)]

    def add(c: OperatingCandidate) -> None:
        if c.key() not in {o.key() for o in out} and len(out) < max_candidates:
            out.append(c)

    if not {"batch_size", "batch_rows", "max_batch_delay_ms"} & overridden:
        bound, fill = fill_limit(expected_concurrency, w0, r), max(1, expected_concurrency // w0)
        for p in curve:
            if r0 < p.batch_size <= bound:
                b = requests_per_batch(p.batch_size, r, fill)
                d, _ = batch_delay_ms(p, slo_ms, headroom_share, w0, rows_per_request=r, batch_requests=b)
                add(candidate(f"batch {p.batch_size}" + (" rows" if multi_row(r) else ""), b, p.batch_size, d,
                              w0, t0, "larger batch", p))
    if not {"batch_size", "batch_rows", "max_batch_delay_ms"} & overridden and not multi_row(r) \
            and b0 >= max(2, expected_concurrency // w0) and (b0 // 2) in by_batch:
        # Half the batch the load fills: closed-loop clients refill a worker's batch only after its
        # answers, so at the fill bound each worker idles while the next batch forms; at half of it,
        # each worker's next batch waits queued while it computes.
        p = by_batch[b0 // 2]
        d, _ = batch_delay_ms(p, slo_ms, headroom_share, w0, rows_per_request=r, batch_requests=b0 // 2)
        add(candidate(f"batch {b0 // 2} (next batch queued)", b0 // 2, b0 // 2, d, w0, t0, "queued batch", p))
    if "max_batch_delay_ms" not in overridden and b0 > 1 and d0 > 2:
        # The same batch with half the wait: under a load that fills batches, a long delay only adds latency.
        add(candidate(f"batch {b0}, delay {d0 // 2} ms", b0, r0, d0 // 2, w0, t0, "shorter delay", p0))
    if not {"workers", "threads_per_worker"} & overridden and cores >= 2 and w0 * t0 == cores:
        # The other extreme of the same cores: one worker with every core, or one worker per core.
        w1, t1 = (1, cores) if w0 > 1 else (cores, 1)
        if {"batch_size", "batch_rows"} & overridden:
            b1, rows1, d1 = b0, r0, d0
        else:
            op = choose_operating_point(curve, slo_ms, workers=w1, max_batch=fill_limit(expected_concurrency, w1, r),
                                        headroom_share=headroom_share, rows_per_request=r,
                                        fill_requests=max(1, expected_concurrency // w1))
            b1, rows1, d1 = op.batch_requests or op.batch_size, op.batch_size, op.delay_ms
        add(candidate(f"{w1} worker(s) × {t1} thread(s)", b1, rows1, d1, w1, t1, "layout", by_batch.get(rows1)))
    return out


def with_timeouts(candidates: list[OperatingCandidate], benchmark: dict, env: dict, serve,
                  rows: Optional[dict] = None) -> list[OperatingCandidate]:
    """Each candidate with responseTimeout and startupTimeout derived for its own batch, rows per call,
    delay, workers and threads by the configure stage's formulas on `benchmark` (the curve the
    candidates come from; `pipeline.decide.serve_config.point_timeouts`): a larger batch, or fewer threads
    per worker, runs longer than configure's offline point, whose timeouts it would otherwise keep.
    serve.overrides of a timeout still win. rows: the expected load's rows per request
    (`rows_of_derivation` of the configure proposal)."""
    out = []
    for c in candidates:
        derived = point_timeouts(benchmark, env, serve, {
            "batch_size": c.batch_size, "batch_rows": c.rows, "max_batch_delay_ms": c.delay_ms,
            "workers": c.workers, "threads_per_worker": c.threads}, rows=rows, label="candidate")
        out.append(dataclasses.replace(c, timeouts={k: d.as_dict() for k, d in derived.items()}))
    return out


def frontend_candidates(base: OperatingCandidate) -> list[OperatingCandidate]:
    """The chosen point with TorchServe's default frontend, then with each frontend alternative."""
    plain = dataclasses.replace(base, frontend={})
    return [plain] + [dataclasses.replace(base, name=f"{base.name} + {label}", origin="frontend",
                                          frontend={**base.frontend, **settings})
                      for label, settings in FRONTEND_CANDIDATES]
