"""The verification rule (pipeline/accuracy/verify.py) on hand-made outputs, plus the stage's exit-code rule,
the isolated conversion process and its timeout."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from pipeline.core.params import REPO_ROOT, Tolerance, load_params
from pipeline.build.builder import stage_exit_code
from pipeline.accuracy.verify import compare

TOL = Tolerance(atol=1e-3, rtol=1e-2, min_cosine=0.999)


def ref_batches(seed=0):
    rng = np.random.default_rng(seed)
    return [(b, rng.standard_normal((b, 6)).astype(np.float32)) for b in (1, 4, 8)]


def test_identical_outputs_pass_with_zero_error():
    results = [(b, [r.copy()], [r]) for b, r in ref_batches()]
    v = compare(results, ["y"], TOL, classification=False, min_topk_agreement=0.99)
    assert v.passed and v.reason == "verified"
    assert v.batch_sizes == [1, 4, 8]
    o = v.outputs[0]
    assert o.max_abs == 0.0 and o.max_rel == 0.0 and o.min_cosine == pytest.approx(1.0)
    assert o.topk_agreement is None


def test_one_element_out_of_band_is_rejected_and_reported_as_the_worst():
    results = []
    for b, r in ref_batches():
        g = r.copy()
        if b == 4:
            g[2, 3] = r[2, 3] + 0.5        # far outside atol + rtol*|ref|
        results.append((b, [g], [r]))
    v = compare(results, ["y"], TOL, classification=False, min_topk_agreement=0.99)
    assert not v.passed
    assert "batch size 4" in v.reason and "[2, 3]" in v.reason
    assert v.worst["batch_size"] == 4 and v.worst["index"] == [2, 3]
    assert v.worst["got"] == pytest.approx(v.worst["expected"] + 0.5, abs=1e-5)
    assert v.outputs[0].max_abs == pytest.approx(0.5, abs=1e-5)


def test_small_errors_within_the_band_pass():
    results = [(b, [r * (1 + 5e-3)], [r]) for b, r in ref_batches()]   # 0.5% < rtol 1%
    v = compare(results, ["y"], TOL, classification=False, min_topk_agreement=0.99)
    assert v.passed, v.reason
    assert 4e-3 < v.outputs[0].max_rel < 6e-3


def test_non_finite_output_is_rejected():
    results = [(b, [r.copy()], [r]) for b, r in ref_batches()]
    results[1][1][0][0, 0] = np.inf
    v = compare(results, ["y"], TOL, classification=False, min_topk_agreement=0.99)
    assert not v.passed and "non-finite" in v.reason
    assert v.outputs[0].max_abs == float("inf")


def test_wrong_shape_names_the_batch_size():
    r = np.ones((4, 6), np.float32)
    v = compare([(1, [r[:1]], [r[:1]]), (4, [r.reshape(1, 24)], [r])], ["y"], TOL, False, 0.99)
    assert not v.passed and "batch size 4" in v.reason and "(1, 24)" in v.reason
    assert v.batch_sizes == [1]


def test_cosine_catches_drift_inside_the_element_band():
    loose = Tolerance(atol=1.0, rtol=0.0, min_cosine=0.999)
    ref = np.array([[1.0, 0.0, 0.0]], np.float32)
    got = np.array([[1.0, 0.5, 0.0]], np.float32)      # every element within atol, direction off
    v = compare([(1, [got], [ref])], ["y"], loose, False, 0.99)
    assert not v.passed and "cosine" in v.reason
    assert v.outputs[0].min_cosine == pytest.approx(1 / np.sqrt(1.25), abs=1e-6)


def test_classification_top1_disagreement_is_rejected():
    loose = Tolerance(atol=10.0, rtol=0.0, min_cosine=0.0)
    ref = np.tile(np.array([[0.0, 1.0, 0.9]], np.float32), (10, 1))
    got = ref.copy()
    got[3] = [0.0, 0.9, 1.0]                             # one of ten samples flips its top-1
    v = compare([(10, [got], [ref])], ["logits"], loose, classification=True, min_topk_agreement=0.99)
    assert not v.passed and "top-1 agreement 0.9000" in v.reason
    assert v.outputs[0].topk_agreement == pytest.approx(0.9)
    v = compare([(10, [ref.copy()], [ref])], ["logits"], loose, classification=True, min_topk_agreement=0.99)
    assert v.passed and v.outputs[0].topk_agreement == 1.0


def test_missing_output_is_rejected():
    r = np.ones((2, 3), np.float32)
    v = compare([(2, [r], [r, r])], ["a", "b"], TOL, False, 0.99)
    assert not v.passed and "returns 1 output" in v.reason


def test_only_eager_can_fail_the_stage():
    assert stage_exit_code("eager", "converted") == 0
    assert stage_exit_code("eager", "failed") == 1
    assert stage_exit_code("eager", "rejected") == 1
    for variant in ("torchscript", "fp16", "onnx", "aoti"):
        for status in ("converted", "rejected", "failed"):
            assert stage_exit_code(variant, status) == 0


# --------------------------------------------------------------------------- the stage, for real
def _stage(variant, params_file, golden_dir, out_dir):
    env = dict(os.environ, PIPELINE_PARAMS=str(params_file))
    return subprocess.run([sys.executable, "-m", "stages.convert", variant, "--out", str(out_dir),
                           "--golden", str(golden_dir)], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture
def stage_setup(tmp_path, make_params, factory_file):
    """A params file for a tiny MLP checkpoint and its golden set, as `stages.prepare` would write."""
    import torch
    from safetensors.torch import save_file

    from pipeline.model.checkpoint import load_model
    from pipeline.model.golden import write_golden
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    weights = tmp_path / "mlp.safetensors"
    save_file(module.state_dict(), str(weights))
    model = {"name": "mlp", "source": "state_dict", "checkpoint": str(weights),
             "factory": f"{factory_file}:build_mlp", "task": "tensor", "input_shape": [8]}
    raw = {"model": model, "variants": ["eager", "torchscript"], "benchmark": {"batch_sizes": [1, 4]},
           "conversion": {"golden_batches": 2}}
    params = make_params(model, benchmark=raw["benchmark"], conversion=raw["conversion"])
    write_golden(params, load_model(params), tmp_path / "golden")

    def params_file(**conversion):
        path = tmp_path / f"params_{len(list(tmp_path.glob('params_*')))}.yaml"
        data = json.loads(json.dumps(raw))
        data["conversion"].update(conversion)
        path.write_text(yaml.safe_dump(data))
        return path
    return tmp_path, params_file


def test_stage_converts_in_its_own_process(stage_setup):
    tmp, params_file = stage_setup
    done = _stage("torchscript", params_file(), tmp / "golden", tmp / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp / "out" / "conversion.json").read_text())
    assert record["status"] == "converted", record["reason"]
    assert record["verification"]["batch_sizes"] == [1, 4]
    assert (tmp / "out" / "model.pt").is_file()


def test_stage_timeout_is_recorded_as_failed(stage_setup):
    tmp, params_file = stage_setup
    # 1 s cannot even cover `import torch` in the conversion process: it is killed.
    short = params_file(timeout_s=1)
    done = _stage("torchscript", short, tmp / "golden", tmp / "ts")
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp / "ts" / "conversion.json").read_text())
    assert record["status"] == "failed" and record["reason"].startswith("timed out after 1 s")
    # Even a variant that never ran records the gate it would have been judged by: its dtype's.
    assert record["dtype"] == "float32"
    assert record["tolerance"] == dataclasses.asdict(load_params(short).conversion.tolerances["float32"])
    assert sorted(p.name for p in (tmp / "ts").iterdir()) == ["conversion.json"]
    # the same for eager fails the stage: there is no reference without it
    done = _stage("eager", params_file(timeout_s=1), tmp / "golden", tmp / "eager")
    assert done.returncode == 1
    assert json.loads((tmp / "eager" / "conversion.json").read_text())["status"] == "failed"


def test_stage_records_a_failing_conversion_and_exits_zero(stage_setup):
    tmp, params_file = stage_setup
    (tmp / "mlp.safetensors").write_bytes(b"not a safetensors file")     # corrupt checkpoint
    done = _stage("onnx", params_file(), tmp / "golden", tmp / "onnx")
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp / "onnx" / "conversion.json").read_text())
    assert record["status"] == "failed"
    assert "mlp.safetensors" in record["reason"]
    assert record["traceback"]
