"""pipeline/serve/reference/handtuned.py: the hand-tuned reference built from a real onnx variant of the committed
tensor example (examples/tensor), its four settings over the configure stage's others, its timeouts
derived for its own batch (a rerank batch of 8 queries is 8 × R rows, not the winner's batch), the
records saying why it could not be built, and a real TorchServe serving it as configured. The archive
stage writes its recipe; the .mar is packed from it as serve_check packs it (pipeline/serve/reference/reference_archives.py)."""
from __future__ import annotations

import json
import shutil
import zipfile

import numpy as np
import pytest
import torch
import yaml

from pipeline.core.params import ServeParams
from pipeline.decide.serve_config import derivation_as_dict, derive_serve_config
from pipeline.model.checkpoint import load_model
from pipeline.serve.archive import ArchiveError
from pipeline.serve.mar import archive_contents
from pipeline.serve.reference.handtuned import RECORD, SETTINGS, VARIANT, build_handtuned, read_handtuned
from pipeline.serve.reference.reference_archives import RECIPE, build_reference
from pipeline.serve.server.torchserve_http import read_properties
from tests.build.test_variants import convert, tensor_case
from tests.decide.test_serve_config import bench
from tests.serve.test_archive import build_stage_inputs, tensor_request
from tests.serve.test_torchserve import DERIVED

TENSOR_MODEL = {"name": "signalnet", "source": "state_dict", "checkpoint": "examples/tensor/weights.safetensors",
                "factory": "examples/tensor/model.py:build", "task": "tensor", "input_shape": [16, 32]}
# The configure stage's figures the reference keeps (everything but its four settings and its timeouts).
KEPT = {"response_timeout_s": 7, "startup_timeout_s": 23, "job_queue_size": 37, "max_request_size": 65536,
        "max_response_size": 65536, "max_request_bytes": 65536}
# The onnx variant's benchmark (metrics/benchmark/onnx.json): {rows per call: (p99 ms, rows/s)}.
ONNX_CURVE = {1: (10.0, 110.0), 2: (16.0, 135.0), 4: (31.0, 140.0), 8: (60.0, 145.0), 16: (118.0, 148.0)}


def write_onnx_benchmark(folder, curve=ONNX_CURVE):
    """`folder`/onnx.json, as the benchmark stage leaves it; returns `folder` (benchmarks_dir)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{VARIANT}.json").write_text(json.dumps(bench(curve, variant=VARIANT, cold=(400.0, 450.0))))
    return folder


@pytest.fixture(scope="module")
def tensor_onnx_params(make_params):
    return make_params(TENSOR_MODEL, variants=["eager", "onnx"])


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory, tensor_onnx_params):
    """artifacts/ after configure: the tensor example's variants (onnx converted for real), a
    derivation whose batching/worker figures differ from the hand-tuned ones."""
    params = tensor_onnx_params
    root = tmp_path_factory.mktemp("handtuned")
    inputs = build_stage_inputs(root / "artifacts", params)
    loaded, golden = tensor_case(load_model(params).module, tuple(params.model.input_shape))
    record = convert(VARIANT, params, loaded, golden, inputs["variants_dir"] / VARIANT)
    assert record["status"] == "converted", record["reason"]
    derivation_dir = root / "artifacts" / "configure"
    derivation_dir.mkdir()
    (derivation_dir / "derivation.json").write_text(json.dumps({**DERIVED, **KEPT}))
    return dict(selection_path=inputs["selection_path"], variants_dir=inputs["variants_dir"],
                derivation_dir=derivation_dir, env_path=inputs["env_path"],
                benchmarks_dir=write_onnx_benchmark(root / "metrics" / "benchmark"))


@pytest.fixture(scope="module")
def built(tmp_path_factory, tensor_onnx_params, stage_inputs):
    root = tmp_path_factory.mktemp("handtuned_out")
    out = root / "handtuned"
    recipe = build_handtuned(tensor_onnx_params, out_dir=out, **stage_inputs)
    assert recipe is not None and recipe.mar == "signalnet.mar"
    return build_reference(out, root / "scratch", "signalnet"), out


def test_the_reference_is_the_onnx_variant_with_four_settings_changed(built, stage_inputs):
    result, out = built
    # The archive stage keeps the recipe, not the .mar: the onnx variant's big files are named where they lie.
    assert not list(out.rglob("*.mar")) and (out / RECIPE).is_file()
    recipe = json.loads((out / RECIPE).read_text())
    assert recipe["handler"] == "onnx_handler.py" and recipe["serialized_file"] == "model.onnx"
    assert result.mar.name == "signalnet.mar"
    contents = archive_contents(result.mar)
    manifest = json.loads(contents["MAR-INF/MANIFEST.json"])["model"]
    assert manifest["handler"] == "onnx_handler.py" and manifest["serializedFile"] == "model.onnx"
    assert json.loads(contents["provenance.json"])["variant"] == VARIANT
    # The packed yaml and the one beside the .mar: hand-tuned batching and workers, the rest configured.
    packed = yaml.safe_load(contents["model-config.yaml"])
    assert yaml.safe_load((out / "model-config.yaml").read_text()) == packed
    assert (packed["batchSize"], packed["maxBatchDelay"]) == (SETTINGS["batch_size"], SETTINGS["max_batch_delay_ms"])
    assert (packed["minWorkers"], packed["maxWorkers"]) == (SETTINGS["workers"], SETTINGS["workers"])
    assert packed["handler"]["threads"] == SETTINGS["threads_per_worker"]
    assert packed["handler"]["warmup_batch_size"] == 1        # warm-up in initialize, the pipeline's (1 row on a CPU)
    # Its timeouts: derived for its batch (8 rows per call on the onnx curve), here their floors (5 s, 30 s).
    timeouts = read_handtuned(out)["timeouts"]
    assert (packed["responseTimeout"], packed["startupTimeout"]) == (timeouts["response_timeout_s"]["value"],
                                                                     timeouts["startup_timeout_s"]["value"]) == (5, 30)
    assert timeouts["startup_timeout_s"]["inputs"]["warmup_ms"] == ONNX_CURVE[8][0]   # the warm-up at 8 rows
    assert packed["handler"]["max_request_bytes"] == KEPT["max_request_bytes"]
    assert "model_store" not in read_properties(out / "config.properties")      # set when it is packed
    props = read_properties(result.config)
    assert props["load_models"] == "signalnet=signalnet.mar" and props["model_store"] == result.store.resolve().as_posix()
    assert props["default_workers_per_model"] == str(SETTINGS["workers"])
    assert props["job_queue_size"] == str(KEPT["job_queue_size"])
    # The configure stage's own record is read, never rewritten.
    assert json.loads((stage_inputs["derivation_dir"] / "derivation.json").read_text())["batch_size"] == \
        DERIVED["batch_size"]


def test_the_record_says_what_was_built(built):
    _, out = built
    record = read_handtuned(out)
    assert record == json.loads((out / RECORD).read_text())
    assert record["available"] is True
    assert (record["model"], record["variant"], record["mar"]) == ("signalnet", VARIANT, "signalnet.mar")
    assert record["settings"] == SETTINGS
    assert "batchSize 8, maxBatchDelay 5 ms, 2 workers × 1 thread" in record["what"]
    for key in ("response_timeout_s", "startup_timeout_s"):
        assert {"value", "formula", "inputs", "overridden"} <= set(record["timeouts"][key])
        assert record["timeouts"][key]["inputs"]["hand_tuned_batch"]["batch_size"] == SETTINGS["batch_size"]


def rerank_stage_inputs(root, params) -> dict:
    """artifacts/ for a reference whose expected load is rerank queries of 20 texts: the configure
    stage's real derivation for it (the winner served 1 query per batch, 32 rows per call), a
    stand-in onnx variant (its format does not matter here) and the onnx variant's benchmark."""
    inputs = build_stage_inputs(root / "artifacts", params)
    onnx = inputs["variants_dir"] / VARIANT
    shutil.copytree(inputs["variants_dir"] / "torchscript", onnx)
    record = json.loads((onnx / "variant.json").read_text())
    (onnx / "variant.json").write_text(json.dumps({**record, "variant": VARIANT}))
    env = {"device": "cpu", "cpu": {"model": "x", "physical_cores": 2, "logical_cores": 2}, "memory_mb": 8000}
    inputs["env_path"].write_text(json.dumps(env))
    winner = bench({8: (25.0, 320.0), 16: (45.0, 355.0), 32: (85.0, 376.0)}, variant="torchscript")
    derivation = derive_serve_config(winner, env, params.serve, task={"kind": "rerank", "max_length": 128},
                                     rows={"rows_per_request": 20.0, "min": 20, "max": 20, "requests": 4})
    configured = root / "artifacts" / "serve"
    (configured / "derivation.json").write_text(json.dumps(derivation_as_dict(derivation)))
    return dict(selection_path=inputs["selection_path"], variants_dir=inputs["variants_dir"],
                derivation_dir=configured, env_path=inputs["env_path"],
                benchmarks_dir=write_onnx_benchmark(root / "metrics" / "benchmark"))


def test_rerank_timeout_covers_eight_queries_of_many_texts(tmp_path, make_params):
    """Issue 26: the reference kept the winner's responseTimeout, derived for 1 query (20 rows in one
    call): its batch of 8 queries × 20 texts, in calls of 8 rows, ran past it under load (5xx)."""
    params = make_params(TENSOR_MODEL, variants=["eager", "torchscript", VARIANT])
    inputs = rerank_stage_inputs(tmp_path, params)
    configured = json.loads((inputs["derivation_dir"] / "derivation.json").read_text())
    assert (configured["batch_size"]["value"], configured["batch_rows"]["value"]) == (1, 32)   # 1 query per batch
    out = tmp_path / "handtuned"
    assert build_handtuned(params, out_dir=out, **inputs) is not None
    packed = yaml.safe_load((out / "model-config.yaml").read_text())
    assert packed["batchSize"] == 8 and "batch_rows" not in packed["handler"]      # calls of 8 rows
    # 8 queries × 20 texts = 160 rows at the onnx variant's p99 per row at 8 rows, × response_safety.
    p99_8, safety = ONNX_CURVE[8][0], params.serve.response_safety
    need_s = 8 * 20 * (p99_8 / 8) * safety / 1000.0
    assert packed["responseTimeout"] >= need_s > configured["response_timeout_s"]["value"]
    record = read_handtuned(out)["timeouts"]["response_timeout_s"]
    assert record["value"] == packed["responseTimeout"] == 7        # ceil((20 × 60 × 5 + 5) / 1000)
    assert record["inputs"]["model_calls"] == 20 and record["inputs"]["batch_p99_ms"] == p99_8
    assert record["inputs"]["hand_tuned_batch"]["rows_per_request"] == 20.0
    assert "model calls per batch" in record["formula"]
    props = read_properties(out / "config.properties")
    assert props["default_response_timeout"] == str(packed["responseTimeout"])
    # The naive baseline sets no timeout: TorchServe's 120 s (one request per batch, one model call).


def test_missing_onnx_benchmark_is_recorded_not_raised(tmp_path, make_params):
    params = make_params(TENSOR_MODEL, variants=["eager", "torchscript", VARIANT])
    inputs = rerank_stage_inputs(tmp_path, params)
    (inputs["benchmarks_dir"] / f"{VARIANT}.json").unlink()
    assert build_handtuned(params, out_dir=tmp_path / "a", **inputs) is None
    assert "was not benchmarked" in read_handtuned(tmp_path / "a")["reason"]
    (inputs["benchmarks_dir"] / f"{VARIANT}.json").write_text(json.dumps(
        {"variant": VARIANT, "status": "failed", "reason": "boom"}))
    assert build_handtuned(params, out_dir=tmp_path / "b", **inputs) is None
    assert "status 'failed'" in read_handtuned(tmp_path / "b")["reason"]


def test_missing_onnx_variant_is_recorded_not_raised(tmp_path, make_params, stage_inputs):
    no_onnx = make_params(TENSOR_MODEL, variants=["eager", "torchscript"])
    assert build_handtuned(no_onnx, out_dir=tmp_path / "a", **stage_inputs) is None
    record = read_handtuned(tmp_path / "a")
    assert record["available"] is False and "not in `variants`" in record["reason"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [RECORD]      # no archive, no config


def test_unconverted_onnx_variant_is_recorded_with_its_status(tmp_path, tensor_onnx_params, stage_inputs):
    variants = tmp_path / "variants"
    shutil.copytree(stage_inputs["variants_dir"], variants)
    inputs = {**stage_inputs, "variants_dir": variants}
    conversion = variants / VARIANT / "conversion.json"
    record = json.loads(conversion.read_text())
    conversion.write_text(json.dumps({**record, "status": "rejected"}))
    assert build_handtuned(tensor_onnx_params, out_dir=tmp_path / "a", **inputs) is None
    assert "status 'rejected'" in read_handtuned(tmp_path / "a")["reason"]
    conversion.unlink()
    assert build_handtuned(tensor_onnx_params, out_dir=tmp_path / "b", **inputs) is None
    assert "was not converted" in read_handtuned(tmp_path / "b")["reason"]


def test_missing_derivation_is_an_error_and_an_unbuilt_reference_is_reported(tmp_path, tensor_onnx_params,
                                                                            stage_inputs):
    with pytest.raises(ArchiveError, match="derivation.json is missing; run the configure stage"):
        build_handtuned(tensor_onnx_params, out_dir=tmp_path / "a",
                        **{**stage_inputs, "derivation_dir": tmp_path / "no-configure"})
    record = read_handtuned(tmp_path / "never-built")
    assert record["available"] is False and "run the archive stage" in record["reason"]


@pytest.mark.torchserve
@pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")
def test_torchserve_serves_the_reference_as_configured(tmp_path, built, tensor_onnx_params):
    from pipeline.serve.server.torchserve import TorchServe
    body, x = tensor_request(tensor_onnx_params, seed=5)
    with torch.no_grad():
        want = load_model(tensor_onnx_params).module(torch.from_numpy(x)[None])[0].numpy()
    # The reference's own config.properties and store, as serve_check starts it.
    with TorchServe(built[0].config, built[0].store, "signalnet", workdir=tmp_path / "ts") as ts:
        d = ts.api.describe_model()
        assert (d["batchSize"], d["maxBatchDelay"]) == (8, 5)
        assert (d["minWorkers"], d["maxWorkers"]) == (2, 2)
        assert [w["status"] for w in d["workers"]] == ["READY", "READY"]
        r = ts.api.predict(body.encode(), "application/json")
        assert r.status == 200, r.body[:500]
        np.testing.assert_allclose(r.json(), want, atol=1e-5)
        loads = (ts.logs / "model_log.log").read_text()
        # The torch-free ONNX handler warmed up in each worker, on one row as the pipeline's does on a CPU.
        assert loads.count("[load] variant=onnx family=onnx") == 2 and loads.count("warmup_bs1=") == 2


def test_the_recipe_is_the_same_bytes_under_another_slo_selection_or_commit(tmp_path, tensor_onnx_params, stage_inputs):
    """The references stage re-serves the hand-tuned setup only when its recipe's bytes change: a serve.*
    experiment (the winner's selection names the SLO) or a new commit must leave them as they were."""
    first, second = tmp_path / "a", tmp_path / "b"
    assert build_handtuned(tensor_onnx_params, out_dir=first, **stage_inputs) is not None
    selection = json.loads(stage_inputs["selection_path"].read_text())
    other = tmp_path / "selection.json"
    other.write_text(json.dumps({**selection, "latency_slo_ms": 150.0, "message": "another SLO"}))
    assert build_handtuned(tensor_onnx_params, out_dir=second, **{**stage_inputs, "selection_path": other}) is not None
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for name in files:
        if name.name in ("config.properties", "recipe.json"):
            continue          # they name the folder they lie in (model_store)
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    provenance = json.loads((first / "files" / "provenance.json").read_text())
    assert provenance["git"] is None and provenance["selection"] is None     # nothing of the commit or the winner
