"""Rows vs requests (pipeline/decide/rows.py) and what they change in the operating point, the
derivation, model-config.yaml, the tune stage's candidates and selection: a rerank request of R texts
is R model rows, TorchServe's batchSize counts requests, the curve counts rows. One row per request
gives exactly what the pipeline always did."""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline.core.params import ParamsError, ServeParams, parse_params
from pipeline.decide.operating_point import CurvePoint, batch_delay_ms, choose_operating_point, fill_limit
from pipeline.decide.properties import model_config_dict
from pipeline.decide.rows import (fill_limit_rows, fill_wait_ms, model_calls, request_work_ms, requests_per_batch,
                                  rows_of_cases)
from pipeline.decide.serve_config import curve_from_benchmark, derive_serve_config
from pipeline.serve.tune.candidates import candidates_from_curve
from tests.decide.test_serve_config import CPU_ENV, bench

# A cross-encoder on 2 cores: rows/s grows with the rows per call; p99 per call in ms.
RERANK = {1: (4.0, 300.0), 4: (9.0, 520.0), 8: (15.0, 600.0), 16: (28.0, 640.0), 32: (54.0, 660.0), 64: (110.0, 665.0)}


# --------------------------------------------------------------------------- the arithmetic
def test_one_row_per_request_is_what_the_pipeline_always_did():
    for b in (1, 3, 8, 32):
        assert requests_per_batch(b, 1.0) == b and requests_per_batch(b, 1.0, fill_requests=2) == b
        assert model_calls(b, 1.0, b) == 1
    assert fill_limit_rows(16, 2) == fill_limit(16, 2) == 8 and fill_limit_rows(3, 4) == 1
    assert fill_wait_ms(8, 1.0, 400.0, 2) == pytest.approx(7 * 1000 / 800)
    assert request_work_ms(12.5, 8, 1.0, 8) == 12.5


def test_requests_per_batch_and_model_calls_for_many_rows():
    # 20 texts per query: a 32-row call holds one request (its 20 rows), a 64-row call three.
    assert requests_per_batch(32, 20.0) == 1 and model_calls(1, 20.0, 32) == 1
    assert requests_per_batch(64, 20.0) == 3 and model_calls(3, 20.0, 64) == 1
    # A batch smaller than one request: one request, split over calls (16 + 4 rows).
    assert requests_per_batch(16, 20.0) == 1 and model_calls(1, 20.0, 16) == 2
    # The load bounds the requests: 4 clients on 2 workers fill 2 requests each.
    assert requests_per_batch(64, 3.0, fill_requests=2) == 2 and model_calls(2, 3.0, 64) == 1
    # In-flight rows bound the batch: 4 requests × 20 rows / 2 workers = 40 rows each.
    assert fill_limit_rows(4, 2, 20.0) == 40
    # A request waits for every call of its batch; a batch of 3 requests fills in 2 × 20 rows / rows/s.
    assert request_work_ms(10.0, 1, 20.0, 8) == 30.0                                  # 8 + 8 + 4 rows
    assert fill_wait_ms(3, 20.0, 500.0, 2) == pytest.approx(2 * 20 * 1000 / 1000)


# --------------------------------------------------------------------------- the operating point
def test_operating_point_judges_a_request_by_all_its_calls():
    curve = curve_from_benchmark(bench(RERANK))
    one = choose_operating_point(curve, 60.0, max_batch=fill_limit(16, 2), workers=2)
    # One row per request: the load fills 16 // 2 = 8 per worker, and a request waits for one call.
    assert one.batch_size == 8 and one.request_p99_ms == 15.0 + one.delay_ms
    many = choose_operating_point(curve, 60.0, workers=2, max_batch=fill_limit(16, 2, 30.0),
                                  rows_per_request=30.0, fill_requests=8)
    # 30 rows per request: batch 1 answers a request in 30 calls (120 ms), 4 in 8 × 9 = 72 ms: past the
    # SLO; 8 rows: 4 calls × 15 = 60 + 1 > 60 too; 16: 2 × 28 = 56 ms fits; 32: one call of 54 ms fits
    # and +3% is not worth it; 64 rows (2 requests): 110 ms, past.
    assert many.batch_size == 16 and many.batch_requests == 1 and many.fits_slo
    assert many.request_p99_ms == pytest.approx(2 * 28.0 + many.delay_ms)
    assert any("batch 1 rows: a request's 30 call(s)" in s for s in many.steps)
    latency = choose_operating_point(curve, 200.0, objective="latency", rows_per_request=30.0, fill_requests=8)
    assert latency.batch_size == 32 and latency.request_p99_ms == 55.0      # the fastest answer, not batch 1


def test_batch_delay_fills_requests_not_rows():
    p = CurvePoint(64, p50_ms=100.0, p99_ms=110.0, throughput_sps=660.0)
    d, inputs = batch_delay_ms(p, 400.0, 0.5, workers=2, rows_per_request=20.0, batch_requests=3)
    # fill: (3 - 1) × 20 rows / (2 × 660 rows/s) = 30.3 ms; headroom (400 - 110) × 0.5 = 145 ms
    assert d == 30 and inputs["batch_requests"] == 3 and inputs["model_calls"] == 1
    d1, _ = batch_delay_ms(p, 400.0, 0.5, workers=2, rows_per_request=20.0, batch_requests=1)
    assert d1 == 1                                   # one request per batch: nothing to wait for


# --------------------------------------------------------------------------- the derivation
def _derive(rows_per_request: float, **serve):
    serve.setdefault("expected_concurrency", 16)
    return derive_serve_config(bench(RERANK, threads=1), {**CPU_ENV, "cpu": {"physical_cores": 2, "usable_cpus": 2}},
                               ServeParams(**serve), task={"kind": "rerank", "max_length": 128},
                               rows={"rows_per_request": rows_per_request, "min": 10, "max": 50, "requests": 5})


def test_derivation_separates_requests_from_rows():
    d = _derive(30.0, latency_slo_ms=200.0)
    assert d["workers"].value == 2 and d["rows_per_request"].value == 30.0
    # Rows: the curve's batch, bounded by 16 requests × 30 rows / 2 workers = 240 rows (64 fits).
    assert d["batch_rows"].value == 16 and d["batch_rows"].inputs["max_batch"] == 240
    # Requests: what fills a 16-row call — one request (its 30 rows in 2 calls).
    assert d["batch_size"].value == 1 and "requests" in d["batch_size"].formula
    assert d["max_batch_delay_ms"].value == 1                  # a batch of one request waits for nobody
    assert d["response_timeout_s"].inputs["model_calls"] == 2
    yaml = model_config_dict(d)
    assert yaml["batchSize"] == 1 and yaml["handler"]["batch_rows"] == 16
    assert yaml["handler"]["warmup_batch_size"] == 1                 # a CPU warms up on one row
    # Overridden rows per call: the requests follow.
    d = _derive(3.0, overrides={"batch_rows": 32})
    assert d["batch_rows"].value == 32 and d["batch_rows"].overridden and d["batch_size"].value == 8   # min(10, 16 // 2)


def test_one_row_derivation_writes_no_batch_rows():
    d = _derive(1.0)
    assert d["batch_rows"].value == d["batch_size"].value == 8 and d["rows_per_request"].value == 1.0
    yaml = model_config_dict(d)
    assert "batch_rows" not in yaml["handler"] and yaml["batchSize"] == 8 and yaml["handler"]["warmup_batch_size"] == 1


def test_tune_candidates_carry_rows_and_predict_requests_per_second():
    curve = curve_from_benchmark(bench(RERANK))
    offline = {"batch_size": 1, "batch_rows": 16, "max_batch_delay_ms": 1, "workers": 2, "threads_per_worker": 1}
    cands = candidates_from_curve(curve, offline, slo_ms=200, headroom_share=0.5, expected_concurrency=16, cores=2,
                                  bench_threads=1, rows_per_request=30.0)
    first = cands[0]
    assert (first.batch_size, first.rows) == (1, 16) and first.settings()["batch_rows"] == 16
    # 2 calls of 16 rows (28 ms each) + 1 ms; 2 workers × 640 rows/s ÷ 30 rows per request.
    assert first.predicted == {"request_p99_ms": 57.0, "throughput_rps": round(2 * 640 / 30, 1), "rows_per_s": 1280.0}
    larger = [(c.rows, c.batch_size) for c in cands if c.origin == "larger batch"]
    assert larger == [(32, 1), (64, 2)]          # bounded by 240 rows, each with the requests that fill it
    assert "(32 rows per model call)" in cands[1].describe()


def test_rerank_load_params_are_checked():
    # A default rerank_texts over a smaller served cap is not an error: serve_check's load is capped.
    base = {"model": {"name": "r", "source": "hf", "checkpoint": "x", "task": "rerank",
                      "text": {"max_texts": 12}}, "variants": ["eager"]}
    assert parse_params(base).serve_check.rerank_texts == 20
    with pytest.raises(ParamsError, match="rerank_texts"):
        parse_params({**base, "serve_check": {"rerank_texts": 0}})
    assert parse_params({**base, "serve_check": {"rerank_texts": 12, "rerank_clients": 4}}).serve_check.rerank_texts == 12
    with pytest.raises(ParamsError, match="rerank_clients"):
        parse_params({**base, "serve_check": {"rerank_texts": 12, "rerank_clients": 0}})


# --------------------------------------------------------------------------- the expected load's rows
def test_rows_of_cases_decodes_each_golden_request(tmp_path):
    from scripts.make_text_task_model import minilm_folder
    shutil.copyfile(minilm_folder() / "tokenizer.json", tmp_path / "tokenizer.json")
    task = {"kind": "rerank", "max_length": 128, "max_texts": 64, "tokenizer": "tokenizer.json"}
    (tmp_path / "golden.json").write_text(json.dumps({"task": task}))
    bodies = [{"query": "q", "texts": ["a"] * n} for n in (10, 20, 45)]
    (tmp_path / "http_cases.json").write_text(json.dumps(
        [{"id": str(i), "content_type": "application/json", "body": json.dumps(b)} for i, b in enumerate(bodies)]))
    rows = rows_of_cases(tmp_path)
    assert rows["rows_per_request"] == 25.0 and (rows["min"], rows["max"], rows["requests"]) == (10, 45, 3)
    assert rows_of_cases(tmp_path / "absent")["rows_per_request"] == 1.0


def test_selection_judges_a_variant_at_its_served_rows():
    """The same curve and load as the derivation above: selection's point is configure's (rows per
    call, the requests that fill it), so the variant is chosen where it will be served."""
    from pipeline.decide.selection import Criteria, select
    from tests.decide.test_selection import CONVERTED
    d = select(["onnx"], {"onnx": CONVERTED}, {"onnx": bench(RERANK)},
               Criteria(expected_concurrency=16, rows_per_request=30.0), workers_for=lambda b: 2)
    f = d["variants"]["onnx"]["figures"]
    assert (f["batch_size"], f["batch_requests"], f["rows_per_request"]) == (16, 1, 30.0)
    assert f["request_p99_ms"] == pytest.approx(2 * 28.0 + f["max_batch_delay_ms"])
    one = select(["onnx"], {"onnx": CONVERTED}, {"onnx": bench(RERANK)}, Criteria(expected_concurrency=16),
                 workers_for=lambda b: 2)["variants"]["onnx"]["figures"]
    assert one["batch_size"] == 8 and "rows_per_request" not in one          # one row per request: as before
