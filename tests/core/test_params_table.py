"""The table of mistakes: every kind a user makes in params.yaml is refused before any work, with the
key, the value and the fix — the numbers' ranges from the schema itself, the files through the
first stage (stages/inputs.py), all of them in one message."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.core.params import REPO_ROOT, ParamsError, parse_params
from pipeline.core.params_checks import CUSTOM, RANGES, schema_numeric_patterns

MODEL = {"name": "m", "source": "hf", "checkpoint": "some/folder", "task": "text-embedding"}


def test_every_number_in_the_schema_has_a_range():
    """A new numeric setting cannot land without its allowed range (RANGES) or its own rule (CUSTOM)."""
    numeric = schema_numeric_patterns()
    assert not numeric - set(RANGES) - CUSTOM, f"numeric settings without a range rule: {sorted(numeric - set(RANGES) - CUSTOM)}"
    assert not set(RANGES) - numeric, f"RANGES names settings the schema lacks: {sorted(set(RANGES) - numeric)}"


def _data_with(pattern: str, value) -> tuple[dict, str]:
    """A params mapping with the setting at `pattern` set to `value`, and that setting's key."""
    data = {"model": dict(MODEL)}
    if pattern.startswith("model.image."):
        data["model"].update(source="state_dict", checkpoint="w.pt", factory="m.py:build", task="image-classification")
    if pattern.startswith("model.text."):
        data["model"]["task"] = "text-classification"
    parts = pattern.replace("<name>", "float32").split(".")
    if pattern.startswith("fleet.targets[]"):
        target: dict = {"name": "t"}
        data["fleet"] = {"targets": [target]}
        node, parts, key = target, pattern.split("[].", 1)[1].replace("<name>", "gpu").split("."), "fleet.targets[0]"
        key += "." + ".".join(parts)
    else:
        node, key = data, ".".join(parts)
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if part == "float32" and not node:
            node.update(atol=1e-4, rtol=1e-3, min_cosine=0.99999)
    node[parts[-1]] = value
    if pattern.startswith("conversion.tolerances."):
        data["conversion"]["tolerances"].update(
            {d: {"atol": 0.1, "rtol": 0.1, "min_cosine": 0.9} for d in ("float16", "bfloat16", "int8")})
    return data, key


@pytest.mark.parametrize("pattern", sorted(RANGES))
def test_a_number_out_of_its_range_is_refused(pattern):
    rule = RANGES[pattern]
    bad = rule.example_bad
    bad = int(bad) if float(bad).is_integer() else bad
    data, key = _data_with(pattern, bad)
    with pytest.raises(ParamsError) as info:
        parse_params(data)
    msg = str(info.value)
    assert f"`{key}` = {bad!r}" in msg or f"`{key}` = {float(bad)!r}" in msg, msg
    assert rule.allowed in msg, msg


# (what the user wrote, the key the message must name, words of the fix)
MISTAKES = [
    ({"serve": {"overrides": {"batch_size": -4}}}, "serve.overrides.batch_size", "an integer >= 1"),
    ({"serve": {"overrides": {"workers": 0}}}, "serve.overrides.workers", "an integer >= 1"),
    ({"model": {**MODEL, "task": "rerank", "text": {"max_length": -1}}}, "model.text.max_length", ">= 1"),
    ({"serve": {"memory_budget_mb": -1}}, "serve.memory_budget_mb", "a positive number of MB"),
    ({"conversion": {"timeout_s": 0}}, "conversion.timeout_s", "an integer >= 1"),
    ({"model": {**MODEL, "task": "text-classification", "source": "state_dict", "factory": "m.py:f"}},
     "model.source", "'hf' for task 'text-classification'"),
    ({"model": {**MODEL, "max_length": 64}}, "model.max_length", "did you mean `model.text.max_length`?"),
    ({"serve": {"latency_slo": 50}}, "serve.latency_slo", "did you mean `serve.latency_slo_ms`?"),
    ({"model": {**MODEL, "task": "text-embeding"}}, "model.task", "did you mean 'text-embedding'?"),
    ({"model": {**MODEL, "input_shape": [3]}}, "model.input_shape", "only task 'tensor' reads it"),
    ({"model": {**MODEL, "factory": "m.py:build"}}, "model.factory", "only state_dict is built by a factory"),
    ({"serve": {"overrides": {"batch_size": 8, "max_batch_delay_ms": 0}}}, "serve.overrides.max_batch_delay_ms",
     "a batch is never waited for"),
    ({"serve": {"inference_port": 8081}}, "serve.inference_port", "three different ports"),
    ({"tune": {"rounds": 3, "max_rounds": 2}}, "tune.max_rounds", ">= tune.rounds"),
    ({"serve_check": {"concurrency": 0}}, "serve_check.concurrency", "null: serve.expected_concurrency"),
    ({"publish": {"remote": "s3://x"}}, "publish.remote", "not a setting under `publish`"),
]


@pytest.mark.parametrize("edit, key, words", MISTAKES, ids=[m[1] for m in MISTAKES])
def test_each_mistake_names_key_value_and_fix(edit, key, words):
    data = {"model": dict(MODEL), **edit}
    with pytest.raises(ParamsError) as info:
        parse_params(data)
    msg = str(info.value)
    assert msg.startswith("params.yaml: "), msg
    assert f"`{key}`" in msg and words in msg, msg


def test_all_the_mistakes_at_once():
    data = {"model": dict(MODEL)}
    for edit, _, _ in MISTAKES:
        for section, value in edit.items():
            if isinstance(value, dict) and isinstance(data.get(section), dict):
                for k, v in value.items():
                    if isinstance(v, dict) and isinstance(data[section].get(k), dict):
                        data[section][k].update(v)
                    else:
                        data[section].setdefault(k, v)
            else:
                data.setdefault(section, value)
    with pytest.raises(ParamsError) as info:
        parse_params(data)
    problems = info.value.problems
    assert len(problems) >= 10, str(info.value)
    assert str(info.value).startswith(f"params.yaml: {len(problems)} problems, nothing was run:"), str(info.value)


# --------------------------------------------------------------------------- the files (first stage)
def run_checkpoint_stage(tmp_path, monkeypatch, capsys, model: dict) -> tuple[int, str]:
    """The checkpoint stage (stages.inputs) on a params file holding `model` (nothing written: it fails before)."""
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["model"] = model
    path = tmp_path / "exp-params.yaml"
    path.write_text(yaml.safe_dump(params))
    monkeypatch.setenv("PIPELINE_PARAMS", str(path))
    from stages.inputs import main
    rc = main(["checkpoint"])
    return rc, capsys.readouterr().err


@pytest.fixture
def hf_encoder(tmp_path):
    folder = tmp_path / "encoder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def _pooling(folder, cfg: dict) -> None:
    """A sentence-transformers folder whose 1_Pooling/config.json is `cfg`."""
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


FILE_MISTAKES = [
    ("missing checkpoint", lambda f: {**MODEL, "checkpoint": str(f.parent / "no-such-folder")},
     "model.checkpoint", "does not exist"),
    ("package not installed", lambda f: {**MODEL, "checkpoint": "pkg:no_such_package_xyz/model"},
     "model.checkpoint", "Python package `no_such_package_xyz` is not installed"),
    ("no head for the task", lambda f: {**MODEL, "checkpoint": str(f), "task": "text-classification"},
     "model.task", "names BertModel, without the ForSequenceClassification head"),
    ("hf source on a file", lambda f: {**MODEL, "checkpoint": str(f / "model.safetensors")},
     "model.checkpoint", "is a file"),
    ("no tokenizer", lambda f: ((f / "tokenizer.json").unlink(), {**MODEL, "checkpoint": str(f)})[1],
     "model.checkpoint", "tokenizer.json"),
    ("no weights", lambda f: ((f / "model.safetensors").unlink(), {**MODEL, "checkpoint": str(f)})[1],
     "model.checkpoint", "no model.safetensors or pytorch_model.bin"),
    ("state_dict on a folder", lambda f: {"name": "m", "source": "state_dict", "checkpoint": str(f), "task": "tensor",
                                           "input_shape": [4], "factory": "examples/tensor/model.py:build"},
     "model.checkpoint", "is a folder"),
    ("factory file missing", lambda f: {"name": "m", "source": "state_dict", "checkpoint": str(f / "model.safetensors"),
                                        "task": "tensor", "input_shape": [4], "factory": "nowhere/model.py:build"},
     "model.factory", "does not exist"),
    ("factory module missing", lambda f: {"name": "m", "source": "state_dict", "task": "tensor", "input_shape": [4],
                                          "checkpoint": str(f / "model.safetensors"), "factory": "no_such_mod_xyz:build"},
     "model.factory", "`no_such_mod_xyz` is not installed"),
    ("a pooling mode not served", lambda f: (_pooling(f, {"pooling_mode_medoid_tokens": True}),
                                             {**MODEL, "checkpoint": str(f)})[1],
     "model.checkpoint", "pooling_mode_medoid_tokens is not supported; supported: pooling_mode_cls_token"),
    ("torchscript not a TorchScript file", lambda f: {"name": "m", "source": "torchscript", "task": "tensor",
                                                      "input_shape": [4], "checkpoint": str(f / "config.json")},
     "model.checkpoint", "not one"),
]


@pytest.mark.parametrize("why, model, key, words", FILE_MISTAKES, ids=[m[0] for m in FILE_MISTAKES])
def test_the_first_stage_refuses_wrong_files(tmp_path, monkeypatch, capsys, hf_encoder, why, model, key, words):
    rc, err = run_checkpoint_stage(tmp_path, monkeypatch, capsys, model(hf_encoder))
    assert rc == 2, err
    assert "exp-params.yaml: " in err and f"`{key}`" in err and words in err, err


def test_the_first_stage_names_settings_and_files_together(tmp_path, monkeypatch, capsys, hf_encoder):
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["model"] = {**MODEL, "checkpoint": str(hf_encoder), "task": "token-classification"}
    params["serve"]["overrides"] = {"workers": 0}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(params))
    monkeypatch.setenv("PIPELINE_PARAMS", str(path))
    from stages.inputs import main
    assert main(["checkpoint"]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "`serve.overrides.workers` = 0" in err and "ForTokenClassification" in err, err


def test_the_shipped_checkpoint_passes(tmp_path, monkeypatch, capsys):
    """The default model's folder passes the file checks (the stage then only fingerprints it)."""
    from pipeline.core.params import load_params
    from pipeline.model.checkpoint_files import check_checkpoint
    assert check_checkpoint(load_params(REPO_ROOT / "params.yaml")) == []
    if (REPO_ROOT / "examples/tensor/weights.safetensors").exists():
        assert check_checkpoint(load_params(REPO_ROOT / "examples/tensor/params.yaml")) == []
    shutil.rmtree(tmp_path, ignore_errors=True)
