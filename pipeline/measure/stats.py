"""Small value objects for measurements: they summarise raw samples and render themselves."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from pipeline.core.numbers import rounded


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q} is outside [0, 100]")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class LatencySummary:
    """Per-call latencies at one batch size, in seconds inside, in ms when rendered."""
    batch_size: int
    iters: int
    total_s: float          # wall time of the measured calls (sum of the samples)
    p50_s: float
    p90_s: float
    p99_s: float
    mean_s: float
    stdev_s: float
    samples_s: tuple[float, ...] = field(default=(), repr=False, compare=False)   # kept for pooling rounds

    @classmethod
    def from_samples(cls, samples_s: Sequence[float], batch_size: int) -> "LatencySummary":
        if not samples_s:
            raise ValueError("no latency samples to summarise")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        return cls(
            batch_size=batch_size,
            iters=len(samples_s),
            total_s=float(sum(samples_s)),
            p50_s=percentile(samples_s, 50),
            p90_s=percentile(samples_s, 90),
            p99_s=percentile(samples_s, 99),
            mean_s=statistics.fmean(samples_s),
            # sample stdev; one sample has no spread
            stdev_s=statistics.stdev(samples_s) if len(samples_s) > 1 else 0.0,
            samples_s=tuple(float(x) for x in samples_s),
        )

    @property
    def cv(self) -> float:
        """Coefficient of variation (stdev / mean): the noise figure."""
        return self.stdev_s / self.mean_s if self.mean_s > 0 else 0.0

    @property
    def throughput_sps(self) -> float:
        """Samples per second when calls run back to back."""
        return self.batch_size * self.iters / self.total_s if self.total_s > 0 else float("inf")

    @property
    def p99_ms(self) -> float:
        return self.p99_s * 1e3

    def as_dict(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "p50_ms": rounded(self.p50_s * 1e3),
            "p90_ms": rounded(self.p90_s * 1e3),
            "p99_ms": rounded(self.p99_s * 1e3),
            "mean_ms": rounded(self.mean_s * 1e3),
            "stdev_ms": rounded(self.stdev_s * 1e3),
            "cv": rounded(self.cv, 4),
            "throughput_sps": rounded(self.throughput_sps, 2),
            "iters": self.iters,
        }

    def render(self) -> str:
        return (f"batch {self.batch_size:>4}: p50 {self.p50_s * 1e3:8.2f} ms  p99 {self.p99_s * 1e3:8.2f} ms  "
                f"cv {self.cv:5.1%}  {self.throughput_sps:9.1f} samples/s  ({self.iters} iters)")


@dataclass(frozen=True)
class RepeatedLatency:
    """One batch size measured in several rounds, each in its own fresh process at a different time.

    The figures pool every round's samples. `spread` is how far the rounds' p50s disagree: noise
    that no single process shows (its memory placement, allocator state, what the host did
    meanwhile) and the honest uncertainty of the p50 when comparing variants or repeating a run.
    """
    rounds: tuple[LatencySummary, ...]

    def __post_init__(self):
        if not self.rounds:
            raise ValueError("no rounds to combine")
        if len({r.batch_size for r in self.rounds}) != 1:
            raise ValueError(f"rounds of different batch sizes: {sorted({r.batch_size for r in self.rounds})}")
        if any(not r.samples_s for r in self.rounds):
            raise ValueError("a round without its samples cannot be pooled")

    @property
    def pooled(self) -> LatencySummary:
        return LatencySummary.from_samples([x for r in self.rounds for x in r.samples_s], self.rounds[0].batch_size)

    @property
    def spread(self) -> float:
        """(max - min) / median of the rounds' p50s; 0 for a single round."""
        p50s = [r.p50_s for r in self.rounds]
        mid = statistics.median(p50s)
        return (max(p50s) - min(p50s)) / mid if mid > 0 else 0.0

    def as_dict(self) -> dict:
        return {**self.pooled.as_dict(), "rounds": len(self.rounds),
                "round_p50_ms": [rounded(r.p50_s * 1e3) for r in self.rounds], "spread": rounded(self.spread, 4)}

    def render(self) -> str:
        p50s = ", ".join(f"{r.p50_s * 1e3:.2f}" for r in self.rounds)
        return f"{self.pooled.render()}  rounds p50 [{p50s}] ms, spread {self.spread:.1%}"


@dataclass(frozen=True)
class PhaseSummary:
    """One cold-load phase over N fresh processes."""
    name: str
    median_s: float
    max_s: float

    @classmethod
    def from_samples(cls, name: str, samples_s: Iterable[float]) -> "PhaseSummary":
        xs = list(samples_s)
        if not xs:
            raise ValueError(f"no samples for phase {name!r}")
        return cls(name, statistics.median(xs), max(xs))

    def as_dict(self) -> dict:
        return {"median": rounded(self.median_s * 1e3), "max": rounded(self.max_s * 1e3)}


# Phases a cold start goes through, in order: interpreter start, import of the runtime, read of the
# artifact, deserialize / create session, move to device, build the task adapter + example inputs,
# first call. `total` is the child's wall time from spawn to its first answer; `phases_sum` what the
# phases account for (the gap is loader overhead no phase names, reported as `other` when known).
LOAD_PHASES = ("interpreter", "import", "read", "deserialize", "to_device", "adapter", "first_call")
# The load after imports: read the artifact's bytes, turn them into a runnable model, move it.
LOAD_AFTER_IMPORTS = ("read", "deserialize", "to_device")


@dataclass(frozen=True)
class ColdLoadSummary:
    runs: int
    phases: dict[str, PhaseSummary]     # LOAD_PHASES + "phases_sum" + "total" (+ any extra the loader reports)
    raw_read_s: float                   # median time to read the artifact's bytes: the physical floor
    artifact_bytes: int

    @classmethod
    def from_runs(cls, runs: Sequence[dict[str, float]], raw_read_s: float, artifact_bytes: int) -> "ColdLoadSummary":
        """`runs`: one dict of phase → seconds per fresh process."""
        if not runs:
            raise ValueError("no cold-load runs to summarise")
        names = list(LOAD_PHASES) + sorted({k for r in runs for k in r} - set(LOAD_PHASES) - {"total"})
        phases = {n: PhaseSummary.from_samples(n, [r.get(n, 0.0) for r in runs]) for n in names}
        phases["phases_sum"] = PhaseSummary.from_samples(
            "phases_sum", [sum(v for k, v in r.items() if k != "total") for r in runs])
        phases["total"] = PhaseSummary.from_samples("total", [r["total"] for r in runs])
        return cls(len(runs), phases, raw_read_s, artifact_bytes)

    @property
    def load_s(self) -> float:
        """Median time spent getting the artifact's bytes into a runnable model."""
        return sum(self.phases[p].median_s for p in LOAD_AFTER_IMPORTS)

    def floor_ratios(self) -> dict[str, float | None]:
        if self.raw_read_s <= 0:
            return {"read": None, "load": None}
        return {"read": rounded(self.phases["read"].median_s / self.raw_read_s, 2),
                "load": rounded(self.load_s / self.raw_read_s, 2)}

    def as_dict(self) -> dict:
        mb_s = (self.artifact_bytes / 2**20 / self.raw_read_s) if self.raw_read_s > 0 else None
        return {
            "runs": self.runs,
            "phases_ms": {n: p.as_dict() for n, p in self.phases.items()},
            "raw_read_ms": rounded(self.raw_read_s * 1e3),
            "raw_read_mb_s": rounded(mb_s, 1),
            # (read + deserialize + to_device) / raw read of the same bytes: how far loading is from the floor
            "load_floor_ratio": self.floor_ratios()["load"],
            "floor_ratios": self.floor_ratios(),
        }

    def render(self) -> str:
        parts = [f"{n} {p.median_s * 1e3:.1f} ms (max {p.max_s * 1e3:.1f})" for n, p in self.phases.items()]
        return (f"cold load over {self.runs} fresh processes: " + "; ".join(parts)
                + f"; raw read {self.raw_read_s * 1e3:.2f} ms, load/floor {self.floor_ratios()['load']}")


@dataclass(frozen=True)
class DiskLoad:
    """One cold start with the artifact's bytes dropped from the page cache first: what a worker
    pays on a host that has not read the model yet (a fresh deployment, a rebooted node), against
    the same bytes read from the disk. The page-cache figures (ColdLoadSummary) price a load's CPU
    work against a memory copy; this one prices it against the disk it is deployed from.
    `reason` is set (and the figures empty) when the bytes could not be dropped here."""
    phases: dict[str, float]            # phase → seconds (with `total`), as a FreshRun's
    raw_read_s: Optional[float]         # the same bytes read straight after dropping them
    artifact_bytes: int
    resident_share: Optional[float]     # share of the bytes still cached after dropping them (≈ 0)
    reason: Optional[str] = None
    raw_read_bytes: Optional[int] = None  # bytes the disk read timed (a sample of a big artifact; None: all)

    @classmethod
    def unavailable(cls, reason: str, artifact_bytes: int,
                    resident_share: Optional[float] = None) -> "DiskLoad":
        return cls({}, None, artifact_bytes, resident_share, reason)

    @property
    def load_s(self) -> float:
        return sum(self.phases.get(p, 0.0) for p in LOAD_AFTER_IMPORTS)

    @property
    def load_ratio(self) -> Optional[float]:
        return rounded(self.load_s / self.raw_read_s, 2) if self.raw_read_s and not self.reason else None

    def as_dict(self) -> dict:
        if self.reason:
            return {"measured": False, "reason": self.reason, "resident_after_drop": rounded(self.resident_share)}
        mb_s = self.artifact_bytes / 2**20 / self.raw_read_s if self.raw_read_s else None
        return {"measured": True,
                "phases_ms": {n: rounded(v * 1e3) for n, v in self.phases.items()},
                "load_ms": rounded(self.load_s * 1e3),
                "total_ms": rounded(self.phases.get("total", 0.0) * 1e3),
                "raw_read_ms": rounded(self.raw_read_s * 1e3 if self.raw_read_s else None),
                "raw_read_mb_s": rounded(mb_s, 1),
                # bytes read to time it: raw_read_ms is their time scaled to the artifact's size
                "raw_read_sampled_bytes": (self.raw_read_bytes if self.raw_read_bytes is not None
                                           and self.raw_read_bytes < self.artifact_bytes else None),
                # (read + deserialize + to_device) / the disk read of the same bytes
                "load_floor_ratio": self.load_ratio,
                "resident_after_drop": rounded(self.resident_share)}

    def render(self) -> str:
        if self.reason:
            return f"cold load from disk not measured: {self.reason}"
        return (f"cold load from disk (page cache dropped, {100 * (self.resident_share or 0):.0f}% left): "
                f"load {self.load_s * 1e3:.1f} ms, total {self.phases.get('total', 0.0) * 1e3:.1f} ms; disk read "
                f"{(self.raw_read_s or 0) * 1e3:.1f} ms, load/floor {self.load_ratio}")
