"""The candidate operating points the tuner serves: from the offline curve (pipeline/decide/serve_config.py)
the offline choice, larger measured batches up to what the load fills, a shorter delay, the other
workers × threads layout on the same cores; and the frontend alternatives tried on the chosen point."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from pipeline.decide.serve_config import CurvePoint, batch_delay_ms, choose_operating_point, fill_limit

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
    origin: str                                   # offline | larger batch | layout | frontend
    frontend: dict = field(default_factory=dict)  # extra config.properties settings
    predicted: Optional[dict] = None              # offline figures {request_p99_ms, throughput_rps} or None

    def key(self) -> tuple:
        return (self.batch_size, self.delay_ms, self.workers, self.threads, tuple(sorted(self.frontend.items())))

    def settings(self) -> dict:
        return {"batch_size": self.batch_size, "max_batch_delay_ms": self.delay_ms, "workers": self.workers,
                "threads_per_worker": self.threads, **({"frontend": dict(self.frontend)} if self.frontend else {})}

    def describe(self) -> str:
        fe = "".join(f", {k}={v}" for k, v in sorted(self.frontend.items()))
        return f"batch {self.batch_size}, delay {self.delay_ms} ms, {self.workers}×{self.threads}{fe}"


def _prediction(p: CurvePoint, delay: int, workers: int, threads: int, bench_threads: int) -> Optional[dict]:
    """What the offline model predicts for the point: per-request p99 = batch p99 + delay, throughput
    = workers × per-process samples/s. Only for the thread count the curve was measured with."""
    if threads != bench_threads:
        return None
    return {"request_p99_ms": round(p.p99_ms + delay, 3), "throughput_rps": round(p.throughput_sps * workers, 1)}


def candidates_from_curve(curve: list[CurvePoint], offline: dict, *, slo_ms: float, headroom_share: float,
                          expected_concurrency: int, cores: int, bench_threads: int,
                          overridden: frozenset = frozenset(), max_candidates: int = 5) -> list[OperatingCandidate]:
    """The offline choice first, then larger measured batches up to the fill bound (each with the
    delay the offline formula gives it), then the other workers × threads layout on the same cores
    with its own offline batch choice. Settings under serve.overrides stay as overridden."""
    by_batch = {p.batch_size: p for p in curve}
    w0, t0 = int(offline["workers"]), int(offline["threads_per_worker"])
    b0, d0 = int(offline["batch_size"]), int(offline["max_batch_delay_ms"])
    p0 = by_batch.get(b0)
    out = [OperatingCandidate("offline choice", b0, d0, w0, t0, "offline",
                              predicted=_prediction(p0, d0, w0, t0, bench_threads) if p0 else None)]

    def add(c: OperatingCandidate) -> None:
        if c.key() not in {o.key() for o in out} and len(out) < max_candidates:
            out.append(c)

    if not {"batch_size", "max_batch_delay_ms"} & overridden:
        bound = fill_limit(expected_concurrency, w0)
        for p in curve:
            if b0 < p.batch_size <= bound:
                d, _ = batch_delay_ms(p, slo_ms, headroom_share, w0)
                add(OperatingCandidate(f"batch {p.batch_size}", p.batch_size, d, w0, t0, "larger batch",
                                       predicted=_prediction(p, d, w0, t0, bench_threads)))
    if "max_batch_delay_ms" not in overridden and b0 > 1 and d0 > 2:
        # The same batch with half the wait: under a load that fills batches, a long delay only adds latency.
        add(OperatingCandidate(f"batch {b0}, delay {d0 // 2} ms", b0, d0 // 2, w0, t0, "shorter delay",
                               predicted=_prediction(p0, d0 // 2, w0, t0, bench_threads) if p0 else None))
    if not {"workers", "threads_per_worker"} & overridden and cores >= 2 and w0 * t0 == cores:
        # The other extreme of the same cores: one worker with every core, or one worker per core.
        w1, t1 = (1, cores) if w0 > 1 else (cores, 1)
        bound = fill_limit(expected_concurrency, w1)
        if "batch_size" in overridden:
            b1, d1 = b0, d0
        else:
            op = choose_operating_point(curve, slo_ms, workers=w1, max_batch=bound, headroom_share=headroom_share)
            b1, d1 = op.batch_size, op.delay_ms
        p1 = by_batch.get(b1)
        add(OperatingCandidate(f"{w1} worker(s) × {t1} thread(s)", b1, d1, w1, t1, "layout",
                               predicted=_prediction(p1, d1, w1, t1, bench_threads) if p1 else None))
    return out


def frontend_candidates(base: OperatingCandidate) -> list[OperatingCandidate]:
    """The chosen point with TorchServe's default frontend, then with each frontend alternative."""
    plain = dataclasses.replace(base, frontend={})
    return [plain] + [dataclasses.replace(base, name=f"{base.name} + {label}", origin="frontend",
                                          frontend={**base.frontend, **settings})
                      for label, settings in FRONTEND_CANDIDATES]
