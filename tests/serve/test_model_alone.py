"""pipeline/serve/checks/model_alone.py: the served variant alone on the served requests, this run — the
server batches it forms (fan-out as handlers/serving.py does) and the common timed window of its
worker processes."""
from __future__ import annotations

import json

import pytest

from handlers.tasks import make_adapter
from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.checks.model_alone import measure, server_batches
from tests.handlers.text_task_models import DOCUMENTS, QUERY, make_models


@pytest.fixture(scope="module")
def rerank_folder(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("alone"))["rerank"]


def _rerank_case(i: int, n: int) -> HttpCase:
    return HttpCase(f"q{i}", "application/json", json.dumps({"query": QUERY, "texts": DOCUMENTS[:n]}).encode())


def test_server_batches_fan_rows_out_as_the_handler_does(rerank_folder):
    adapter = make_adapter(rerank_folder, {"kind": "rerank", "max_length": 64, "max_texts": 12})
    cases = [_rerank_case(i, n) for i, n in enumerate((3, 5, 2, 4, 1))]
    calls = server_batches(adapter, cases, batch_size=2, batch_rows=4)
    # Server batches of 2 requests: 3+5 rows -> calls of 4, 4; 2+4 -> 4, 2; 1 -> 1.
    assert [len(rows) for _, rows in calls] == [4, 4, 4, 2, 1]
    # Requests are counted once, on their batch's last call.
    assert [req for req, _ in calls] == [0, 2, 0, 2, 1]
    assert sum(len(rows) for _, rows in calls) == 15
    plain = server_batches(make_adapter(rerank_folder, {"kind": "rerank", "max_length": 64, "max_texts": 12}),
                           cases[:2], batch_size=8, batch_rows=8)
    assert [(req, len(rows)) for req, rows in plain] == [(2, 8)]


def test_processes_time_one_common_window(tmp_path):
    """Two worker processes on a tiny tensor variant: both report, rows/s is the sum of their rates."""
    from pipeline.core.params import parse_params
    from pipeline.model.checkpoint import load_model
    from pipeline.model.golden import write_golden
    from tests.serve.test_archive import build_stage_inputs

    params = parse_params({"model": {"name": "signalnet", "source": "state_dict",
                                     "checkpoint": "examples/tensor/weights.safetensors",
                                     "factory": "examples/tensor/model.py:build", "task": "tensor",
                                     "input_shape": [16, 32]}, "variants": ["eager", "torchscript"],
                           "benchmark": {"batch_sizes": [1, 4]}})
    build_stage_inputs(tmp_path / "art", params)
    write_golden(params, load_model(params), tmp_path / "golden")
    r = measure(tmp_path / "art" / "variants" / "torchscript", tmp_path / "golden" / "http_cases.json",
                batch_size=4, batch_rows=4, workers=2, threads=1, seconds=0.5, warmup_s=0.1)
    assert r["ok"], r
    (a, b) = r["processes"]
    assert r["rows_per_s"] == pytest.approx(a["rows"] / a["seconds"] + b["rows"] / b["seconds"], rel=1e-3)
    assert r["requests_per_s"] == r["rows_per_s"]          # one row per tensor request
    assert all(p["seconds"] >= 0.5 and p["calls"] >= 1 and p["rows"] <= 4 * p["calls"] for p in (a, b))
    broken = measure(tmp_path / "missing", tmp_path / "golden" / "http_cases.json", batch_size=4, batch_rows=4,
                     workers=1, threads=1, seconds=0.2)
    assert not broken["ok"] and broken["errors"] and "exit" in broken["errors"][0]


def test_measure_cases_runs_the_requests_given_in_hand(tmp_path, monkeypatch):
    """A load's own requests (the rerank load's queries) reach `measure` as a cases file it reads back
    unchanged, with the keywords passed through; the file is gone afterwards."""
    import pipeline.serve.checks.model_alone as alone
    from pipeline.serve.checks.http_cases import load_http_cases
    seen = {}

    def fake_measure(variant_dir, cases_path, **kw):
        seen.update(variant=variant_dir, cases=load_http_cases(cases_path), path=cases_path, kw=kw)
        return {"ok": True}
    monkeypatch.setattr(alone, "measure", fake_measure)
    cases = [_rerank_case(i, n) for i, n in enumerate((3, 5))]
    assert alone.measure_cases(tmp_path / "v", cases, batch_size=1, batch_rows=4, workers=2, threads=1) == {"ok": True}
    assert [(c.id, c.content_type, c.body) for c in seen["cases"]] == [(c.id, c.content_type, c.body) for c in cases]
    assert seen["kw"] == {"batch_size": 1, "batch_rows": 4, "workers": 2, "threads": 1} and not seen["path"].exists()
