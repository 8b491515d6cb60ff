"""The golden set (pipeline/model/golden.py) and the prepare stage."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from handlers.tasks import make_adapter
from pipeline.model.checkpoint import load_model
from pipeline.model.golden import batch_plan, read_golden, run_reference, write_golden
from pipeline.core.params import REPO_ROOT


def test_batch_plan_covers_one_largest_and_every_listed_size():
    assert batch_plan([1, 2, 4, 8], 3) == [1, 1, 1, 2, 4, 8, 8, 8]
    assert batch_plan([4, 16], 2) == [1, 1, 4, 16, 16]           # batch 1 always present
    assert batch_plan([1], 3) == [1, 1, 1]


def file_bytes(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_tensor_golden_written_read_back_and_deterministic(tmp_path, tensor_params):
    loaded = load_model(tensor_params)
    written = write_golden(tensor_params, loaded, tmp_path / "g1")
    golden = read_golden(tmp_path / "g1")

    manifest = json.loads((tmp_path / "g1" / "golden.json").read_text())
    assert manifest["task"] == loaded.task and manifest["outputs"] == [{"name": "output"}]
    assert manifest["inputs"] == [{"name": "input", "dtype": "float32", "dynamic_axes": {"0": "batch"}}]
    assert [b["batch_size"] for b in manifest["batches"]] == [1, 1, 2, 4, 4]
    assert golden.batch_sizes == [1, 2, 4] and golden.input_names == ["input"] and golden.outputs == ["output"]

    for got, ref in zip(golden.batches, written.batches):
        assert got.feeds["input"].shape == (got.batch_size, 16, 32) and got.feeds["input"].dtype == np.float32
        np.testing.assert_array_equal(got.outputs[0], ref.outputs[0])
        np.testing.assert_array_equal(got.outputs[0], run_reference(loaded, got.feeds)[0])
    # Distinct batches, not copies of one.
    assert not np.array_equal(golden.batches[0].feeds["input"], golden.batches[1].feeds["input"])

    # Same params, same bytes: DVC sees no change when prepare re-runs.
    write_golden(tensor_params, loaded, tmp_path / "g2")
    assert file_bytes(tmp_path / "g1") == file_bytes(tmp_path / "g2")


def test_http_cases_replay_to_golden_inputs_and_outputs(tmp_path, tensor_params):
    loaded = load_model(tensor_params)
    golden = write_golden(tensor_params, loaded, tmp_path / "g")
    cases = json.loads((tmp_path / "g" / "http_cases.json").read_text())
    assert len(cases) == sum(b.batch_size for b in golden.batches) and len({c["id"] for c in cases}) == len(cases)
    adapter = golden.adapter()
    rows = [(b, i) for b in golden.batches for i in range(b.batch_size)]
    for case, (batch, i) in zip(cases, rows):
        assert case["content_type"] == "application/json"
        sample = adapter.decode(case["body"].encode(), case["content_type"])
        np.testing.assert_array_equal(sample["input"], batch.feeds["input"][i])   # the very same request
        assert case["expected"] == adapter.respond(batch.outputs, i)
        assert np.asarray(case["expected"]).shape == (10,)


def test_text_golden_has_padding_and_tokenizer(tmp_path, text_params):
    loaded = load_model(text_params)
    write_golden(text_params, loaded, tmp_path / "g")
    golden = read_golden(tmp_path / "g")
    assert (tmp_path / "g" / "tokenizer.json").is_file() and golden.manifest["files"] == ["tokenizer.json"]
    big = [b for b in golden.batches if b.batch_size == 4]
    assert big and all((b.feeds["attention_mask"] == 0).any() for b in big)          # varied lengths -> padding
    lengths = {b.feeds["input_ids"].shape[1] for b in golden.batches}
    assert len(lengths) > 1 and max(lengths) <= 32
    for b in golden.batches:
        assert b.feeds["input_ids"].dtype == np.int64 and b.outputs[0].shape == (b.batch_size, 32)
        np.testing.assert_allclose(np.linalg.norm(b.outputs[0], axis=1), 1.0, rtol=1e-5)
    # HTTP bodies decode (through the copied tokenizer) to the golden rows.
    adapter = golden.adapter()
    case, batch = golden.http_cases[-1], golden.batches[-1]
    ids = adapter.decode(case["body"].encode(), case["content_type"])["input_ids"]
    np.testing.assert_array_equal(batch.feeds["input_ids"][-1, :len(ids)], ids)


def test_image_golden_writes_png_bodies(tmp_path, image_params):
    loaded = load_model(image_params)
    golden = write_golden(image_params, loaded, tmp_path / "g")
    case = golden.http_cases[0]
    body = (tmp_path / "g" / case["body_file"]).read_bytes()
    assert case["content_type"] == "image/png" and body[:4] == b"\x89PNG" and "body" not in case
    adapter = make_adapter(tmp_path / "g", loaded.task)
    np.testing.assert_array_equal(adapter.decode(body, "image/png")["pixels"], golden.batches[0].feeds["pixels"][0])
    top = case["expected"]
    assert len(top) == 3 and top[0]["score"] >= top[-1]["score"] and set(top[0]) == {"label", "score"}
    json_case = next(c for c in golden.http_cases if c["content_type"] == "application/json")
    assert json.loads(json_case["body"])["inputs"] and isinstance(json_case["expected"], list)


def test_write_golden_refuses_foreign_folder(tmp_path, tensor_params):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="refusing"):
        write_golden(tensor_params, load_model(tensor_params), tmp_path)
    assert (tmp_path / "precious.txt").exists()


def test_read_golden_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="stages.prepare"):
        read_golden(tmp_path / "nothing")


def run_prepare(tmp_path, params: dict):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    env = dict(os.environ, PIPELINE_PARAMS=str(path))
    return subprocess.run([sys.executable, "-m", "stages.prepare", "--out", str(tmp_path / "golden")],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_prepare_stage_writes_golden_and_fails_clearly(tmp_path):
    params = yaml.safe_load((REPO_ROOT / "examples/tensor/params.yaml").read_text())
    params["benchmark"]["batch_sizes"] = [1, 2]
    done = run_prepare(tmp_path, params)
    assert done.returncode == 0, done.stderr
    assert read_golden(tmp_path / "golden").batch_sizes == [1, 2]
    assert "golden" in done.stderr                # it logs what it wrote and where

    params["model"]["checkpoint"] = "examples/tensor/missing.safetensors"
    done = run_prepare(tmp_path, params)
    assert done.returncode == 2 and "missing.safetensors" in done.stderr and "does not exist" in done.stderr

    params["model"]["colour"] = "red"
    done = run_prepare(tmp_path, params)
    assert done.returncode == 2 and "`model.colour`" in done.stderr
