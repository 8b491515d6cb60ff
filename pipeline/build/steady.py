"""Batch-1 calls timed at their steady state, for the plan's screen (pipeline/build/plan.py).

A first call says little about a variant: TorchScript's profiling executor runs its first calls
instrumented (`torch._C._jit_get_num_profiled_runs()` of them) and compiles the optimised graph on
the next, so a TorchScript variant that ends up faster than eager is many times slower on its first
calls; ONNX Runtime allocates its arena on its first. Each side (eager, the variant) therefore
warms up until its calls settle — the last `SETTLE_CALLS` within `SETTLE_SPREAD` of the fastest of
them, and never before the runtime's own warm-up calls and the JIT's profiled runs are done — and
its figure is the median of `TIMED_CALLS` calls after that.

A time cap bounds a variant's screen (eager's calls and its own together): an emulated fp16 call
of a large model costs tens of seconds, and the screen exists to spare minutes, not to spend them.
A series the cap ends records that it did (`capped`), and its figure is the best it has.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

SETTLE_CALLS = 3          # the last this many warm-up calls must agree...
SETTLE_SPREAD = 0.25      # ...within this fraction of the fastest of them (a shared host's jitter passes)
MAX_WARMUPS = 20          # calls that never settle are timed anyway after this many (the record says so)
TIMED_CALLS = 7           # the median of these is a side's figure
CAP_S = 30.0              # seconds of calls per variant's screen, eager's included


def jit_warmup_calls() -> int:
    """Calls before a TorchScript graph runs optimised: its profiled runs, then the optimising call."""
    import torch
    profiled = getattr(torch._C, "_jit_get_num_profiled_runs", None)
    return (profiled() if profiled is not None else 1) + 1


@dataclass
class Series:
    """One side's calls in order: warm-ups until they settle (or `MAX_WARMUPS`), then timed calls."""
    min_warmups: int
    warmups: list[float] = field(default_factory=list)
    timed: list[float] = field(default_factory=list)
    capped: bool = False      # the time cap ended it before `TIMED_CALLS` timed calls

    def add(self, seconds: float) -> None:
        (self.timed if self.warm else self.warmups).append(seconds)

    @property
    def settled(self) -> bool:
        last = self.warmups[-SETTLE_CALLS:]
        return (len(self.warmups) >= max(self.min_warmups, SETTLE_CALLS)
                and max(last) <= (1 + SETTLE_SPREAD) * min(last))

    @property
    def warm(self) -> bool:
        return self.settled or len(self.warmups) >= MAX_WARMUPS

    @property
    def done(self) -> bool:
        return len(self.timed) >= TIMED_CALLS

    @property
    def calls(self) -> list[float]:
        return self.warmups + self.timed

    @property
    def steady(self) -> bool:
        """Its figure is a median of timed calls (after settling or `MAX_WARMUPS`)."""
        return bool(self.timed)

    @property
    def past_warmups(self) -> bool:
        """It has calls after the runtime's and the JIT's own warm-up calls."""
        return len(self.calls) > self.min_warmups

    def figure(self) -> float:
        """The median of the timed calls; before any (the cap came first), the fastest call after the
        minimum warm-ups, or of all calls when there is none."""
        if self.timed:
            return statistics.median(self.timed)
        return min(self.warmups[self.min_warmups:] or self.warmups)

    def describe(self, cap_s: float) -> str:
        """How the figure was measured, for the screen's reason."""
        cap = f"time cap of {cap_s:g} s hit: " if self.capped else ""
        if not self.timed:
            n = len(self.warmups)
            return (f"time cap of {cap_s:g} s hit after {n} call{'s' if n != 1 else ''}, before a steady state: "
                    + ("fastest after warm-up" if self.past_warmups else "fastest cold call"))
        settled = "steady-state median" if self.settled else "median (calls never settled)"
        return f"{cap}{settled} of {len(self.timed)} calls after {len(self.warmups)} warm-ups"

    def as_dict(self) -> dict:
        return {"calls_s": [round(c, 5) for c in self.calls], "warmups": len(self.warmups),
                "timed": len(self.timed), "settled": self.settled, "capped": self.capped}


def time_call(fn: Callable[[], object]) -> Callable[[], float]:
    """`fn` as a call that returns its own seconds."""
    def timed() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return timed


def measure(variant_call: Callable[[], float], variant_warmups: int,
            eager_call: Optional[Callable[[], float]] = None, eager: Optional[Series] = None,
            eager_warmups: int = 1, cap_s: float = CAP_S) -> tuple[Series, Series]:
    """Both sides to their steady state under one cap. Eager's and the variant's calls alternate, so a
    busy spell on a shared host slows both alike; `eager` given instead of `eager_call` is a series
    measured before (its module is gone by now)."""
    variant = Series(variant_warmups)
    eager = eager if eager is not None else Series(eager_warmups)
    deadline = time.perf_counter() + cap_s

    def alternating_done() -> bool:
        return variant.done and (eager_call is None or eager.done)
    while True:                   # one round at least, whatever the cap
        if eager_call is not None and not eager.done:
            eager.add(eager_call())
        if not variant.done:
            variant.add(variant_call())
        if alternating_done() or time.perf_counter() >= deadline:
            break
    variant.capped = not variant.done
    if eager_call is not None:
        eager.capped = not eager.done
    return variant, eager


def measure_alone(call: Callable[[], float], min_warmups: int = 1, cap_s: float = CAP_S) -> Series:
    """One side to its steady state under the cap (eager's, before a build that drops its module)."""
    series, _ = measure(call, min_warmups, cap_s=cap_s)
    return series
