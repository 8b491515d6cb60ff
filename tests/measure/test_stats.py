"""Statistics of the measurement value objects, on known samples."""
import statistics

import numpy as np
import pytest

from pipeline.measure.stats import ColdLoadSummary, LatencySummary, PhaseSummary, percentile


def test_percentiles_match_numpy_linear_interpolation():
    xs = [0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 1.5, 0.4]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 101)


def test_latency_summary_on_known_samples():
    # 100 samples: 1..100 ms
    samples = [i / 1000 for i in range(1, 101)]
    s = LatencySummary.from_samples(samples, batch_size=4)
    assert s.iters == 100
    assert s.p50_s == pytest.approx(0.0505)
    assert s.p90_s == pytest.approx(0.0901)
    assert s.p99_s == pytest.approx(0.09901)
    assert s.mean_s == pytest.approx(0.0505)
    assert s.stdev_s == pytest.approx(statistics.stdev(samples))
    assert s.cv == pytest.approx(statistics.stdev(samples) / 0.0505)
    # 4 samples per call, 100 calls in sum(samples) seconds
    assert s.throughput_sps == pytest.approx(400 / sum(samples))
    d = s.as_dict()
    assert d["p50_ms"] == 50.5 and d["p99_ms"] == 99.01 and d["batch_size"] == 4 and d["iters"] == 100
    assert set(d) >= {"p50_ms", "p90_ms", "p99_ms", "mean_ms", "stdev_ms", "cv", "throughput_sps", "iters"}
    assert "batch    4" in s.render() and "samples/s" in s.render()


def test_constant_samples_have_zero_cv_and_single_sample_no_spread():
    s = LatencySummary.from_samples([0.01] * 10, 1)
    assert s.cv == 0.0 and s.p99_s == pytest.approx(0.01) and s.throughput_sps == pytest.approx(100.0)
    one = LatencySummary.from_samples([0.02], 2)
    assert one.stdev_s == 0.0 and one.cv == 0.0


def test_latency_summary_rejects_empty_and_bad_batch():
    with pytest.raises(ValueError):
        LatencySummary.from_samples([], 1)
    with pytest.raises(ValueError, match="batch_size"):
        LatencySummary.from_samples([0.1], 0)


def test_cold_load_summary_median_max_sum_and_floor_ratio():
    runs = [
        {"interpreter": 0.02, "import": 0.10, "read": 0.010, "deserialize": 0.05, "to_device": 0.0,
         "adapter": 0.01, "first_call": 0.02, "other": 0.001, "total": 0.215},
        {"interpreter": 0.03, "import": 0.30, "read": 0.030, "deserialize": 0.07, "to_device": 0.0,
         "adapter": 0.01, "first_call": 0.04, "other": 0.001, "total": 0.485},
        {"interpreter": 0.02, "import": 0.20, "read": 0.020, "deserialize": 0.06, "to_device": 0.0,
         "adapter": 0.01, "first_call": 0.03, "other": 0.001, "total": 0.345},
    ]
    c = ColdLoadSummary.from_runs(runs, raw_read_s=0.005, artifact_bytes=10 * 2**20)
    assert c.runs == 3
    assert c.phases["import"].median_s == pytest.approx(0.20) and c.phases["import"].max_s == pytest.approx(0.30)
    assert c.phases["total"].median_s == pytest.approx(0.345)
    assert c.phases["phases_sum"].max_s == pytest.approx(0.481)
    # (read + deserialize + to_device) medians / raw read = (0.02 + 0.06) / 0.005
    assert c.floor_ratios() == {"read": 4.0, "load": 16.0}
    d = c.as_dict()
    assert d["load_floor_ratio"] == 16.0 and d["raw_read_ms"] == 5.0 and d["raw_read_mb_s"] == 2000.0
    assert d["phases_ms"]["first_call"] == {"median": 30.0, "max": 40.0}
    assert {"import", "read", "deserialize", "to_device", "first_call", "total"} <= set(d["phases_ms"])
    assert "raw read" in c.render()


def test_phase_summary():
    p = PhaseSummary.from_samples("read", [0.003, 0.001, 0.002, 0.010])
    assert p.median_s == pytest.approx(0.0025) and p.max_s == pytest.approx(0.010)
    assert p.as_dict() == {"median": 2.5, "max": 10.0}


def test_repeated_latency_pools_rounds_and_measures_their_spread():
    from pipeline.measure.stats import RepeatedLatency
    a = LatencySummary.from_samples([0.010, 0.011, 0.012], 4)
    b = LatencySummary.from_samples([0.012, 0.013], 4)
    rep = RepeatedLatency((a, b))
    assert rep.pooled.iters == 5 and rep.pooled.p50_s == pytest.approx(0.012)
    assert rep.pooled.throughput_sps == pytest.approx(4 * 5 / 0.058)
    assert rep.spread == pytest.approx((0.0125 - 0.011) / 0.01175)        # median of two p50s is their mean
    d = rep.as_dict()
    assert d["rounds"] == 2 and d["round_p50_ms"] == [11.0, 12.5] and d["iters"] == 5
    assert RepeatedLatency((a,)).spread == 0.0
    with pytest.raises(ValueError, match="different batch sizes"):
        RepeatedLatency((a, LatencySummary.from_samples([0.01], 8)))
    with pytest.raises(ValueError, match="no rounds"):
        RepeatedLatency(())
