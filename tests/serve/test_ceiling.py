"""The speed the host allows (pipeline/serve/reference/ceiling.py): the bound from the server's ceiling and the
model alone, and the serve_check stage serving a do-nothing model exactly as the winner, in the same
interleaved rounds, to measure that ceiling."""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline.serve.reference.ceiling import model_alone_rps, served_bound, served_size_answer
from tests.serve.test_torchserve import DERIVED

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")

BENCH = {"threads": 1, "steady": {"4": {"throughput_sps": 800.0}, "8": {"throughput_sps": 795.0}}}


def test_bound_adds_the_server_and_the_model_costs():
    model = model_alone_rps(BENCH, 8, 2)
    assert model["value"] == 1590.0 and model["per_process_sps"] == 795.0 and model["workers"] == 2
    b = served_bound(680.0, 3400.0, model)
    assert b["bound_rps"] == pytest.approx(1 / (1 / 3400 + 1 / 1590), abs=0.01)
    assert b["served_vs_bound"] == pytest.approx(680.0 / b["bound_rps"], abs=1e-3)
    assert 0.62 < b["served_vs_bound"] < 0.64           # the AMX host's figures: the winner reached 0.63


def test_served_size_answer_is_the_median_golden_answer_as_the_handler_writes_it():
    expected = [{"embedding": [0.1, -0.25, 1 / 3]}, {"embedding": [0.5] * 8}, None, [{"label": "a", "score": 0.9}]]
    answer = served_size_answer(expected)
    # Sizes: 3 floats, 8 floats, the label list: the median is the 3-float embedding, in float32's shortest form.
    assert json.loads(answer) == {"embedding": [0.1, -0.25, 0.33333334]}
    assert served_size_answer([None]) == b"{}"


def test_bound_is_none_without_its_inputs():
    assert model_alone_rps(BENCH, 16, 2) is None                    # that batch size was never measured
    assert served_bound(100.0, None, model_alone_rps(BENCH, 4, 1))["bound_rps"] is None
    assert served_bound(100.0, 500.0, None)["served_vs_bound"] is None


@pytest.mark.torchserve
@needs_java
def test_stage_serves_the_ceiling_beside_the_winner(tmp_path, monkeypatch, tensor_params):
    import stages.serve_check as stage
    from pipeline.decide.properties import write_config_properties
    from pipeline.model.checkpoint import load_model
    from pipeline.model.golden import write_golden
    from pipeline.serve.archive import build_archive
    from tests.serve.test_archive import build_stage_inputs

    art = tmp_path / "artifacts"
    inputs = build_stage_inputs(art, tensor_params)
    store, golden = art / "model_store", art / "golden"
    build_archive(tensor_params, export_dir=store, **inputs)
    write_golden(tensor_params, load_model(tensor_params), golden)
    derived = {**DERIVED, "max_batch_delay_ms": 5, "startup_timeout_s": 60, "response_timeout_s": 30,
               "job_queue_size": 1000, "max_request_size": 200000, "max_request_bytes": 200000}
    serve_dir = inputs["serve_dir"]
    write_config_properties(serve_dir / "config.properties", derived, model_name="signalnet", model_store=store)
    (serve_dir / "derivation.json").write_text(json.dumps({"batch_size": {"value": 4}, "workers": {"value": 1}}))
    assert (serve_dir / "model-config.yaml").is_file()
    import zipfile
    with zipfile.ZipFile(store / "signalnet.mar") as mar:
        variant = json.loads(mar.read("variant.json"))["variant"]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({
        "model": {"name": "signalnet", "source": "state_dict", "checkpoint": "examples/tensor/weights.safetensors",
                  "factory": "examples/tensor/model.py:build", "task": "tensor", "input_shape": [16, 32]},
        "serve_check": {"requests": 48, "concurrency": 4, "time_cap_s": 60, "rounds": 1, "warmup_s": 1, "baseline": False,
                        "handtuned": False}}))
    out = tmp_path / "serve_check.json"
    monkeypatch.setenv("PIPELINE_PARAMS", str(params))
    for name, value in (("MODEL_STORE", store), ("SERVE_DIR", serve_dir), ("GOLDEN_DIR", golden),
                        ("SERVE_CHECK_JSON", out)):
        monkeypatch.setattr(stage, name, value)
    monkeypatch.setattr(stage, "benchmark_json", lambda v: bench)
    monkeypatch.setattr(stage, "variant_dir", lambda v: art / "variants" / v)

    rc = stage.main([])
    rec = json.loads(out.read_text())
    assert rc == 0, rec["failures"]
    refs = rec["references"]
    ceiling, winner = refs["setups"]["ceiling"], refs["setups"]["winner"]
    (round1,) = ceiling["rounds"]
    assert round1["ok"] and ceiling["throughput_rps"] and ceiling["ready_s"]
    # Served as the model is: its model-config.yaml's batch size bounds the batches it formed.
    seen = {int(k) for k in (round1["batch_sizes_seen"] or {})}
    assert seen and max(seen) <= DERIVED["batch_size"]
    b = refs["bound"]
    assert b["variant"] == variant
    assert b["ceiling_rps"] == round(ceiling["throughput_rps"], 2) and b["served_rps"] == round(winner["throughput_rps"], 2)
    # The model alone measured now, on the served requests, in the workers' layout (1 worker, batch 4);
    # the benchmark's figure kept beside it.
    alone = b["model_alone"]
    assert alone["workers"] == 1 and alone["batch_size"] == 4 and alone["measured"]["ok"]
    assert len(alone["samples_rps"]) == 2 and alone["value"] == max(alone["samples_rps"])   # before / after the rounds
    assert b["model_alone_rps"] == round(alone["measured"]["requests_per_s"], 2) > 0
    assert b["model_alone_benchmark"]["value"] == 800.0                     # batch 4 x 1 worker
    assert b["bound_rps"] == pytest.approx(1 / (1 / ceiling["throughput_rps"] + 1 / alone["value"]), abs=0.01)
    assert b["served_vs_bound"] == pytest.approx(winner["throughput_rps"] / b["bound_rps"], abs=2e-3)
    assert refs["load"]["clients"] == 4 and "keep-alive" in refs["load"]["connections"]
    # The ceiling answers the served answer's bytes; the empty-answer one is measured beside it.
    golden_cases = stage.load_http_cases(golden / "http_cases.json")
    assert b["ceiling_answer_bytes"] == len(served_size_answer([c.expected for c in golden_cases])) > 2
    empty = refs["setups"]["ceiling_empty"]
    assert empty["rounds"][0]["ok"] and b["ceiling_empty_rps"] == round(empty["throughput_rps"], 2)
