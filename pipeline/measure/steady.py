"""Steady-state latency: warm-up, then measure until BOTH enough iterations AND enough time;
a batch sweep that stops once bigger batches stop paying. Generic over a callable: it never
knows what runs (a tiny torch model in tests, a variant's Runtime in the benchmark stage).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from pipeline.measure.stats import LatencySummary

Clock = Callable[[], float]


@dataclass(frozen=True)
class StopRule:
    """Stop measuring once BOTH min_iters calls were timed AND min_duration_s elapsed — or, with
    `max_s`, once that long has passed and at least `floor_iters` calls were timed: a big model's
    1.5-s call reaches its min_iters only after 9 s at one size, where three calls already give
    the figure as well as its round-to-round spread allows."""
    min_iters: int
    min_duration_s: float
    max_s: Optional[float] = None
    floor_iters: int = 3

    def __post_init__(self):
        if self.min_iters < 1:
            raise ValueError(f"min_iters must be >= 1, got {self.min_iters}")
        if self.min_duration_s < 0:
            raise ValueError(f"min_duration_s must be >= 0, got {self.min_duration_s}")
        if self.max_s is not None and self.max_s <= 0:
            raise ValueError(f"max_s must be > 0 or None, got {self.max_s}")

    def done(self, iters: int, elapsed_s: float) -> bool:
        if iters >= self.min_iters and elapsed_s >= self.min_duration_s:
            return True
        return self.max_s is not None and elapsed_s >= self.max_s and iters >= min(self.floor_iters, self.min_iters)

    def per_pass(self, passes: int) -> "StopRule":
        """The share of this rule one of `passes` interleaved windows gets."""
        return StopRule(-(-self.min_iters // passes), self.min_duration_s / passes,
                        None if self.max_s is None else self.max_s / passes, -(-self.floor_iters // passes))


# JIT runtimes (TorchScript's profiling executor) specialise on the 2nd call: warm-up never stops before it
MIN_WARMUP_CALLS = 2


def warm_up(call: Callable[[], Any], iters: int, max_s: Optional[float] = None, clock: Clock = time.perf_counter) -> int:
    """`iters` untimed calls, cut short once `max_s` has passed after at least MIN_WARMUP_CALLS (a
    1.4-s call does not need five warm-ups). Returns the calls made."""
    start, done = clock(), 0
    while done < iters:
        if max_s is not None and done >= MIN_WARMUP_CALLS and clock() - start >= max_s:
            break
        call()
        done += 1
    return done


def measure_latency(call: Callable[[], Any], batch_size: int, rule: StopRule, warmup_iters: int = 0,
                    sync: Optional[Callable[[], None]] = None, clock: Clock = time.perf_counter,
                    after_call: Optional[Callable[[], None]] = None,
                    warmup_max_s: Optional[float] = None) -> LatencySummary:
    """Time `call()` back to back. `sync` (GPU) runs inside each timed interval so queued device
    work is counted; `after_call` (e.g. a memory sample) runs outside it."""
    warm_up(call, warmup_iters, warmup_max_s, clock)
    if sync:
        sync()
    samples: list[float] = []
    start = clock()
    while not rule.done(len(samples), clock() - start):
        t0 = clock()
        call()
        if sync:
            sync()
        samples.append(clock() - t0)
        if after_call:
            after_call()
    return LatencySummary.from_samples(samples, batch_size)


@dataclass(frozen=True)
class StableMeasurement:
    summary: LatencySummary
    noisy: bool                 # CV stayed above max_cv after one re-measurement
    remeasured: bool
    first_cv: float


def measure_stable(measure: Callable[[], LatencySummary], max_cv: float) -> StableMeasurement:
    """Measure; if CV > max_cv measure once more and keep the quieter run, flagged noisy if it
    is still above max_cv (a one-off disturbance is dropped, lasting noise is reported)."""
    first = measure()
    if first.cv <= max_cv:
        return StableMeasurement(first, noisy=False, remeasured=False, first_cv=first.cv)
    second = measure()
    best = min((first, second), key=lambda s: s.cv)
    return StableMeasurement(best, noisy=best.cv > max_cv, remeasured=True, first_cv=first.cv)


@dataclass(frozen=True)
class SweepPolicy:
    """When a bigger batch is not worth measuring any more: p99 past the cap, or `patience` sizes
    in a row that do not beat the best throughput so far by `min_gain` (the curve need not be
    monotonic, and one noisy point must not end the sweep)."""
    min_gain: float             # relative throughput gain over the best so far that counts as progress
    latency_cap_ms: float       # stop when p99(b) > this
    patience: int = 1           # consecutive sizes without progress before stopping

    def __post_init__(self):
        if self.patience < 1:
            raise ValueError(f"benchmark.sweep_patience must be >= 1, got {self.patience}")

    def why_stop(self, history: Sequence[LatencySummary]) -> Optional[str]:
        """Why to stop after the last point of `history` (points in measuring order), or None."""
        cur = history[-1]
        if cur.p99_ms > self.latency_cap_ms:
            return f"p99 {cur.p99_ms:.1f} ms > latency_cap_ms {self.latency_cap_ms:g}"
        if len(history) <= self.patience:
            return None
        best = max(h.throughput_sps for h in history[:-self.patience])
        recent = history[-self.patience:]
        gains = [h.throughput_sps / best - 1.0 for h in recent]
        if all(g < self.min_gain for g in gains):
            sizes = ", ".join(str(h.batch_size) for h in recent)
            return (f"throughput gain {max(gains):+.1%} at most (batch {sizes}) over the best before "
                    f"< min_gain {self.min_gain:.0%}")
        return None


@dataclass
class SweepResult:
    points: dict[int, StableMeasurement] = field(default_factory=dict)
    stopped_early: Optional[dict] = None      # {"after_batch", "why"}

    def as_dict(self) -> dict:
        return {str(b): {**m.summary.as_dict(), "noisy": m.noisy, "remeasured": m.remeasured}
                for b, m in self.points.items()}


def _is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "out of memory" in str(e).lower()


def sweep(measure_at: Callable[[int], StableMeasurement], batch_sizes: Sequence[int], policy: Optional[SweepPolicy],
          on_point: Optional[Callable[[int, StableMeasurement], None]] = None) -> SweepResult:
    """Measure batch sizes in the given order until the policy says stop (no policy: every size).
    Running out of memory at a size ends the sweep there (recorded) instead of failing the sizes
    already measured."""
    result = SweepResult()
    history: list[LatencySummary] = []
    sizes = list(batch_sizes)
    for i, b in enumerate(sizes):
        try:
            m = measure_at(b)
        except Exception as e:
            if not _is_out_of_memory(e) or not result.points:
                raise
            result.stopped_early = {"after_batch": history[-1].batch_size,
                                    "why": f"out of memory at batch {b}: {type(e).__name__}: {str(e)[:200]}"}
            break
        result.points[b] = m
        if on_point:
            on_point(b, m)
        history.append(m.summary)
        why = policy.why_stop(history) if policy else None
        if why and i < len(sizes) - 1:
            result.stopped_early = {"after_batch": b, "why": why}
            break
    return result


def measure_interleaved(calls: dict[int, Callable[[], Any]], rule: StopRule, passes: int, warmup_iters: int = 0,
                        warmup_max_s: Optional[float] = None, sync: Optional[Callable[[], None]] = None,
                        clock: Clock = time.perf_counter,
                        after_call: Optional[Callable[[], None]] = None,
                        after_pass: Optional[Callable[[], None]] = None, max_s: Optional[float] = None,
                        done: Optional[dict] = None) -> dict[int, LatencySummary]:
    """Every batch size in `passes` short windows, round-robin, so each size's samples span the
    whole measurement: host noise that comes and goes over seconds (another tenant, frequency)
    then weighs on every size alike instead of on whichever one it happened to coincide with.
    Each size still gets the rule's iterations and duration in total; one warm-up call when
    coming back to a size (shapes change between sizes), the full warm-up on the first visit.
    `after_pass` runs between passes (untimed), e.g. to time the host reference.
    `max_s`: no pass is started that would end past this many seconds from the start, by the
    longest pass so far (the first, with its full warm-up, on the safe side); the first always
    runs, so every size has samples. `done` (a dict), if given, receives {"passes": passes run}."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    per_pass = rule.per_pass(passes)
    samples: dict[int, list[float]] = {b: [] for b in calls}
    start, longest, ran = clock(), 0.0, 0
    for i in range(passes):
        if i > 0 and max_s is not None and clock() - start + longest > max_s:
            break
        t_pass = clock()
        for b, call in calls.items():
            s = measure_latency(call, b, per_pass, warmup_iters if i == 0 else 1, sync=sync, clock=clock,
                                after_call=after_call, warmup_max_s=warmup_max_s)
            samples[b].extend(s.samples_s)
        if after_pass:
            after_pass()
        longest, ran = max(longest, clock() - t_pass), ran + 1
    if done is not None:
        done["passes"] = ran
    return {b: LatencySummary.from_samples(xs, b) for b, xs in samples.items()}


@dataclass(frozen=True)
class RoundSpec:
    """What one steady-state round measures. Plain data: it crosses into a fresh process as JSON.
    The first round sweeps (stops early by the policy); later rounds re-measure the sizes it kept,
    interleaved in `passes` windows each."""
    batch_sizes: tuple[int, ...]
    sweep: bool
    passes: int
    warmup_iters: int
    warmup_max_s: float
    min_iters: int
    min_duration_s: float
    max_cv: float
    min_gain: float
    patience: int
    latency_cap_ms: float
    point_max_s: Optional[float] = None
    max_s: Optional[float] = None       # a repeat round's time allowance (measure_interleaved's max_s)

    def stop_rule(self) -> StopRule:
        return StopRule(self.min_iters, self.min_duration_s, self.point_max_s)

    def policy(self) -> Optional[SweepPolicy]:
        return SweepPolicy(self.min_gain, self.latency_cap_ms, self.patience) if self.sweep else None

    def as_dict(self) -> dict:
        return {**self.__dict__, "batch_sizes": list(self.batch_sizes)}

    @classmethod
    def from_dict(cls, d: dict) -> "RoundSpec":
        return cls(**{**d, "batch_sizes": tuple(d["batch_sizes"])})
