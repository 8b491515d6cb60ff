"""The host reference kernel and the figures normalised by it."""
from __future__ import annotations

import pytest

from pipeline.measure.reference import HostReference, per_reference, reference_window_ms


def test_reference_window_times_the_kernel_at_least_three_times():
    ms = reference_window_ms(0.0)
    assert 0 < ms < 1000
    ticks = iter(range(1000))
    calls = []

    def clock():
        calls.append(1)
        return next(ticks) * 0.01          # every call of the clock 10 ms later
    assert reference_window_ms(0.05, clock=clock) == pytest.approx(10.0)
    assert len(calls) >= 2 * 3


def test_host_reference_summarises_rounds_and_their_drift():
    ref = HostReference(((1.0, 1.0, 1.2), (1.1, 1.1), ()))
    assert ref.median_ms == 1.1
    assert ref.drift == pytest.approx((1.1 - 1.0) / 1.05)     # medians 1.0 and 1.1
    d = ref.as_dict()
    assert d["round_median_ms"] == [1.0, 1.1] and "matmul" in d["kernel"]
    assert HostReference(((), ())).median_ms is None and HostReference(((1.0,),)).drift == 0.0


def test_times_in_reference_units():
    assert per_reference(20.0, 0.5) == 40.0 and per_reference(20.0, None) is None
