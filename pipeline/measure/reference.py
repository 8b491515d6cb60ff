"""The host's speed while a variant is measured: a fixed workload timed beside the model.

On shared virtual machines the same code runs 10–25% slower for minutes at a time (the physical
core's other tenants; the guest sees no steal time), so two benchmark runs can differ by more than
their own noise. A fixed single-threaded matmul, timed in short windows between the model's calls in
the same process, shows how fast the host ran meanwhile: when two runs disagree, their references
say whether the host did. An indicator, not a correction: here it tracked a cache-resident model
(bf16 MiniLM, r = 0.93 over ~30 s windows) but not a memory-bound one (fp32 eager, r = 0.5), so
figures are never rescaled by it; `p50_ref` (p50 / reference) is reported beside the p50.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

KERNEL = "float32 256x256 matmul (numpy BLAS, the benchmark's thread count)"
SIZE = 256
WINDOW_S = 0.1          # one reference window; a round takes a few (≈ 1% of its time)


def reference_window_ms(duration_s: float = WINDOW_S, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of the reference kernel over `duration_s` (at least 3 calls), in ms."""
    import numpy as np
    rng = np.random.default_rng(0)
    a = rng.standard_normal((SIZE, SIZE), dtype=np.float32)
    b = rng.standard_normal((SIZE, SIZE), dtype=np.float32)
    a @ b                                               # first call: BLAS thread pool, page faults
    samples = []
    end = clock() + duration_s
    while len(samples) < 3 or clock() < end:
        t0 = clock()
        a @ b
        samples.append(clock() - t0)
    return statistics.median(samples) * 1e3


@dataclass(frozen=True)
class HostReference:
    """The reference windows of one benchmark, grouped by round (fresh process)."""
    rounds_ms: tuple[tuple[float, ...], ...]

    @property
    def median_ms(self) -> Optional[float]:
        xs = [x for r in self.rounds_ms for x in r]
        return statistics.median(xs) if xs else None

    @property
    def drift(self) -> float:
        """(max − min) / median of the rounds' medians: how much the host's speed moved meanwhile."""
        meds = [statistics.median(r) for r in self.rounds_ms if r]
        if len(meds) < 2:
            return 0.0
        mid = statistics.median(meds)
        return (max(meds) - min(meds)) / mid if mid > 0 else 0.0

    def as_dict(self) -> dict:
        med = self.median_ms
        return {"kernel": KERNEL, "median_ms": None if med is None else round(med, 4),
                "round_median_ms": [round(statistics.median(r), 4) for r in self.rounds_ms if r],
                "drift": round(self.drift, 4)}


def per_reference(value_ms: float, reference_median_ms: Optional[float]) -> Optional[float]:
    """A time in units of the reference kernel (dimensionless; comparable across runs and hosts'
    moods, not across different CPUs)."""
    return round(value_ms / reference_median_ms, 4) if reference_median_ms else None
