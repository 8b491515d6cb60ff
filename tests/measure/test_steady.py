"""Stop rule (iterations AND duration), CV re-measure-then-flag, and the batch sweep's early stop.

Timing is driven by a fake clock, so the assertions are exact and independent of machine load.
"""
import time

import pytest
import torch

from pipeline.measure.stats import LatencySummary
from pipeline.measure.steady import (StableMeasurement, StopRule, SweepPolicy, measure_latency, measure_stable,
                                     sweep)


class FakeClock:
    """Time advances only when the measured call runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def call(self, cost_s):
        def run():
            self.now += cost_s
        return run


def test_stop_rule_needs_both_iterations_and_duration():
    rule = StopRule(min_iters=10, min_duration_s=1.0)
    assert not rule.done(9, 5.0)       # long enough, too few calls
    assert not rule.done(100, 0.5)     # many calls, too short
    assert rule.done(10, 1.0)
    with pytest.raises(ValueError):
        StopRule(0, 1.0)


def test_a_time_cap_ends_slow_points_after_three_calls_and_never_fast_ones():
    """point_max_s: a 1.5-s call stops after 3 calls (4.5 s) instead of min_iters' 6 (9 s); a fast
    one still takes its min_iters; the interleaved windows share the cap and the floor."""
    capped = StopRule(min_iters=6, min_duration_s=0.3, max_s=2.0)
    def iters(call_s, rule):
        clock = FakeClock()
        return measure_latency(clock.call(call_s), 1, rule, clock=clock).iters
    assert iters(1.5, capped) == 3
    assert iters(0.5, capped) == 4                          # 2 s reached after 4 calls
    assert iters(0.05, capped) == 6
    assert iters(1.5, StopRule(6, 0.3)) == 6                # no cap: as before
    window = capped.per_pass(4)
    assert (window.min_iters, window.max_s, window.floor_iters) == (2, 0.5, 1)
    assert window.done(1, 0.9) and not window.done(1, 0.4)
    with pytest.raises(ValueError):
        StopRule(6, 0.3, max_s=0.0)


def test_measure_latency_duration_binds_when_calls_are_fast():
    clock = FakeClock()
    s = measure_latency(clock.call(0.1), 2, StopRule(min_iters=5, min_duration_s=1.0), warmup_iters=3, clock=clock)
    assert s.iters == 10                    # 5 iterations would take only 0.5 s
    assert s.p50_s == pytest.approx(0.1) and s.throughput_sps == pytest.approx(20.0)
    assert clock.now == pytest.approx(1.3)  # + 3 warm-up calls, not timed


def test_measure_latency_iterations_bind_when_calls_are_slow():
    clock = FakeClock()
    s = measure_latency(clock.call(0.5), 1, StopRule(min_iters=7, min_duration_s=1.0), clock=clock)
    assert s.iters == 7                     # 1 s was reached after 2 calls


def test_measure_latency_syncs_inside_the_timed_interval():
    clock = FakeClock()
    # a "device" whose queued work only shows up at synchronisation: 0.01 s launch + 0.09 s sync
    s = measure_latency(clock.call(0.01), 1, StopRule(3, 0.0), sync=clock.call(0.09), clock=clock)
    assert s.p50_s == pytest.approx(0.1)


def test_measure_latency_on_a_real_tiny_torch_model():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    x = torch.randn(8, 16)
    t0 = time.perf_counter()
    with torch.inference_mode():
        s = measure_latency(lambda: model(x), 8, StopRule(min_iters=30, min_duration_s=0.05), warmup_iters=2)
    wall_s = time.perf_counter() - t0
    assert s.iters >= 30 and len(s.samples_s) == s.iters
    # total_s is the timed calls themselves: their sum, at least iters x the fastest, and inside
    # the wall time of the whole measurement (warm-up and loop overhead are not in it).
    assert s.total_s == pytest.approx(sum(s.samples_s))
    assert 0 < s.iters * min(s.samples_s) <= s.total_s <= wall_s
    assert 0 < s.p50_s <= s.p90_s <= s.p99_s
    assert s.throughput_sps == pytest.approx(8 * s.iters / s.total_s)


def _summary(ms, batch=1, jitter=0.0):
    samples = [ms / 1e3 * (1 + (jitter if i % 2 else -jitter)) for i in range(20)]
    return LatencySummary.from_samples(samples, batch)


def test_quiet_run_is_not_remeasured():
    calls = iter([_summary(10, jitter=0.01)])
    m = measure_stable(lambda: next(calls), max_cv=0.15)
    assert not m.remeasured and not m.noisy


def test_noisy_run_is_remeasured_once_and_kept_when_it_settles():
    runs = [_summary(10, jitter=0.5), _summary(10, jitter=0.02)]
    calls = iter(runs)
    m = measure_stable(lambda: next(calls), max_cv=0.15)
    assert m.remeasured and not m.noisy and m.summary is runs[1]
    assert m.first_cv > 0.15


def test_still_noisy_after_remeasure_is_flagged():
    calls = iter([_summary(10, jitter=0.5), _summary(10, jitter=0.4), _summary(10)])
    m = measure_stable(lambda: next(calls), max_cv=0.15)
    assert m.remeasured and m.noisy and m.summary.cv > 0.15
    assert next(calls).cv == 0.0            # measured exactly twice, not three times


def _sweep_table(latency_ms_by_batch, max_cv=0.15):
    measured = []

    def measure_at(b):
        measured.append(b)
        return StableMeasurement(_summary(latency_ms_by_batch[b], b), noisy=False, remeasured=False, first_cv=0.0)
    return measure_at, measured


def test_sweep_stops_when_throughput_gain_falls_under_min_gain():
    # throughput: 100, 166.7, 173.9 (+4.3 %), ...
    measure_at, measured = _sweep_table({1: 10, 2: 12, 4: 23, 8: 40})
    r = sweep(measure_at, [1, 2, 4, 8], SweepPolicy(min_gain=0.05, latency_cap_ms=1000))
    assert measured == [1, 2, 4] and list(r.points) == [1, 2, 4]
    assert r.stopped_early["after_batch"] == 4 and "min_gain" in r.stopped_early["why"]


def test_sweep_patience_survives_one_flat_point_on_a_non_monotonic_curve():
    # throughput: 100, 166.7, 173.9 (+4 %: flat), 200 (+20 %), 195.1, 193.9 (both below the best 200)
    table = {1: 10, 2: 12, 4: 23, 8: 40, 16: 82, 32: 165, 64: 400}
    measure_at, measured = _sweep_table(table)
    r = sweep(measure_at, list(table), SweepPolicy(min_gain=0.05, latency_cap_ms=1000, patience=2))
    assert measured == [1, 2, 4, 8, 16, 32]
    assert r.stopped_early["after_batch"] == 32 and "batch 16, 32" in r.stopped_early["why"]
    measure_at, measured = _sweep_table(table)
    sweep(measure_at, list(table), SweepPolicy(min_gain=0.05, latency_cap_ms=1000, patience=1))
    assert measured == [1, 2, 4]
    with pytest.raises(ValueError, match="sweep_patience"):
        SweepPolicy(0.05, 1000, patience=0)


def test_sweep_stops_when_p99_passes_the_latency_cap():
    measure_at, measured = _sweep_table({1: 10, 2: 12, 4: 20, 8: 30})
    r = sweep(measure_at, [1, 2, 4, 8], SweepPolicy(min_gain=0.0, latency_cap_ms=15))
    assert measured == [1, 2, 4]
    assert r.stopped_early == {"after_batch": 4, "why": "p99 20.0 ms > latency_cap_ms 15"}


def test_sweep_runs_every_size_when_gains_hold_and_keeps_json_keys_as_strings():
    measure_at, measured = _sweep_table({1: 10, 2: 12, 4: 14, 8: 16})
    r = sweep(measure_at, [1, 2, 4, 8], SweepPolicy(min_gain=0.05, latency_cap_ms=1000))
    assert measured == [1, 2, 4, 8] and r.stopped_early is None
    d = r.as_dict()
    assert list(d) == ["1", "2", "4", "8"] and d["8"]["batch_size"] == 8 and d["8"]["noisy"] is False


def test_sweep_stops_at_out_of_memory_but_keeps_measured_sizes():
    def measure_at(b):
        if b >= 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return StableMeasurement(_summary(10, b), False, False, 0.0)
    r = sweep(measure_at, [1, 2, 4, 8], SweepPolicy(min_gain=0.0, latency_cap_ms=1000))
    assert list(r.points) == [1, 2] and r.stopped_early["after_batch"] == 2
    assert "out of memory at batch 4" in r.stopped_early["why"]


def test_sweep_reraises_other_errors():
    def measure_at(b):
        raise ValueError("shape mismatch")
    with pytest.raises(ValueError, match="shape mismatch"):
        sweep(measure_at, [1, 2], SweepPolicy(0.05, 1000))


def test_warm_up_is_cut_short_for_slow_calls_but_never_below_two():
    from pipeline.measure.steady import warm_up
    clock = FakeClock()
    assert warm_up(clock.call(1.5), 5, max_s=1.0, clock=clock) == 2      # a 1.5-s call: two warm-ups
    assert warm_up(clock.call(0.1), 5, max_s=1.0, clock=clock) == 5      # fast calls: all five
    assert warm_up(clock.call(0.4), 5, max_s=1.0, clock=clock) == 3      # stops once 1 s has passed
    assert warm_up(clock.call(0.4), 5, max_s=None, clock=clock) == 5
    assert warm_up(clock.call(0.4), 0, max_s=1.0, clock=clock) == 0


def test_a_sweep_without_policy_measures_every_size():
    sizes = []

    def at(b):
        sizes.append(b)
        return StableMeasurement(LatencySummary.from_samples([b * 1.0], b), False, False, 0.0)
    r = sweep(at, [1, 2, 4, 8], None)
    assert sizes == [1, 2, 4, 8] and r.stopped_early is None


def test_interleaved_windows_visit_every_size_in_turn_and_add_up_to_the_rule():
    from pipeline.measure.steady import measure_interleaved
    clock = FakeClock()
    order = []

    def call(b, cost):
        def run():
            order.append(b)
            clock.now += cost
        return run
    # min 8 calls AND 0.4 s per size, in 2 passes: each pass 4 calls and 0.2 s
    out = measure_interleaved({1: call(1, 0.01), 4: call(4, 0.1)}, StopRule(8, 0.4), passes=2, warmup_iters=3,
                              clock=clock)
    assert out[1].iters == 40 and out[4].iters == 8          # 0.2 s per pass binds for the fast size
    assert sum(out[1].samples_s) >= 0.4 and out[4].iters >= 8
    runs = [b for i, b in enumerate(order) if i == 0 or order[i - 1] != b]
    assert runs == [1, 4, 1, 4]                               # round-robin, not size after size
    # warm-ups: 3 on the first visit, 1 when coming back
    assert order.count(4) == 8 + 3 + 1 and order.count(1) == 40 + 3 + 1
    with pytest.raises(ValueError):
        measure_interleaved({1: call(1, 0.01)}, StopRule(1, 0.0), passes=0)
    # a hook between passes (the host reference), outside the timed calls
    marks = []
    measure_interleaved({1: call(1, 0.01)}, StopRule(2, 0.0), passes=3, clock=clock,
                        after_pass=lambda: marks.append(len(order)))
    assert len(marks) == 3 and len(set(marks)) == 3


def test_interleaved_passes_stop_within_the_time_allowance():
    """A repeat round with `max_s` (what the variant's budget leaves it): no pass is started that
    would end past it by the longest pass so far; the first always runs (issue 30)."""
    from pipeline.measure.steady import measure_interleaved
    clock = FakeClock()

    def call(cost):
        def run():
            clock.now += cost
        return run
    # each pass: 1 (the first: 3) warm-up + 2 calls of 0.5 s at each of two sizes: 5 s, then 3 s each;
    # after two passes (8 s) a third, priced at the longest (5 s), would end past 11 s
    done = {}
    out = measure_interleaved({1: call(0.5), 2: call(0.5)}, StopRule(8, 0.0), passes=4, warmup_iters=3,
                              clock=clock, max_s=11.0, done=done)
    assert done == {"passes": 2} and out[1].iters == 4 and clock.now == 8.0
    done = {}
    measure_interleaved({1: call(0.5)}, StopRule(8, 0.0), passes=4, warmup_iters=3, clock=clock, max_s=0.0, done=done)
    assert done == {"passes": 1}                     # every size still gets its samples
    done = {}
    measure_interleaved({1: call(0.5)}, StopRule(8, 0.0), passes=4, clock=clock, done=done)
    assert done == {"passes": 4}                     # no allowance: every pass
