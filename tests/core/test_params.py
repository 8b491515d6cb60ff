"""params.yaml validation: every mistake named at once, each with the key, the value and what is allowed.
The table of mistakes of each kind: tests/core/test_params_table.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.core.params import REPO_ROOT, ParamsError, load_params, parse_params

MODEL = {"name": "m", "source": "hf", "checkpoint": "some/folder", "task": "text-embedding"}


def params_with(**top) -> dict:
    data = {"model": dict(MODEL)}
    data.update(top)
    return data


def error_of(data) -> str:
    with pytest.raises(ParamsError) as info:
        parse_params(data)
    return str(info.value)


@pytest.mark.parametrize("path", ["params.yaml", "examples/efficientnet-lite0/params.yaml",
                                  "examples/tensor/params.yaml"])
def test_shipped_params_files_are_valid(path):
    params = load_params(REPO_ROOT / path)
    assert params.model.name
    assert "eager" in params.variants


def test_unknown_top_level_key_names_key_and_allowed():
    msg = error_of(params_with(benchmarks={"device": "cpu"}))
    assert "`benchmarks`" in msg and "allowed keys" in msg and "benchmark" in msg


def test_unknown_nested_key_names_full_path():
    data = params_with()
    data["model"]["chekpoint"] = "x"
    msg = error_of(data)
    assert "`model.chekpoint`" in msg and "checkpoint" in msg and "factory" in msg


def test_wrong_type_names_key_value_and_type():
    msg = error_of(params_with(benchmark={"batch_sizes": "1,2,4"}))
    assert "`benchmark.batch_sizes`" in msg and "'1,2,4'" in msg and "a list" in msg

    msg = error_of(params_with(benchmark={"batch_sizes": [1, "two"]}))
    assert "`benchmark.batch_sizes[1]`" in msg and "'two'" in msg and "integer" in msg

    data = params_with()
    data["model"]["trust_checkpoint"] = "yes"
    msg = error_of(data)
    assert "`model.trust_checkpoint`" in msg and "'yes'" in msg and "true/false" in msg

    msg = error_of(params_with(serve={"latency_slo_ms": "fast"}))
    assert "`serve.latency_slo_ms`" in msg and "'fast'" in msg and "number" in msg


def test_unknown_variant_lists_allowed():
    msg = error_of(params_with(variants=["eager", "tensorrt"]))
    assert "`variants[1]`" in msg and "'tensorrt'" in msg
    for v in ("eager", "torchscript", "fp16", "bf16", "onnx", "onnx-fp16", "aoti"):
        assert v in msg


def test_unknown_task_and_source_list_allowed():
    data = params_with()
    data["model"]["task"] = "segmentation"
    msg = error_of(data)
    assert "`model.task`" in msg and "'segmentation'" in msg
    assert "'text-embedding'" in msg and "'image-classification'" in msg and "'tensor'" in msg

    data = params_with()
    data["model"]["source"] = "onnx"
    msg = error_of(data)
    assert "`model.source`" in msg and "'onnx'" in msg and "'state_dict'" in msg


def test_missing_required_key():
    data = params_with()
    del data["model"]["checkpoint"]
    msg = error_of(data)
    assert "`model.checkpoint`" in msg and "missing" in msg


def test_cross_field_rules():
    data = params_with()
    data["model"].update(source="state_dict", task="tensor", input_shape=[4])
    assert "`model.factory` is missing: required when `model.source` is 'state_dict'" in error_of(data)

    data = params_with()
    data["model"].update(task="tensor")
    assert "`model.input_shape` is missing: required" in error_of(data)

    data = params_with()
    data["model"].update(task="tensor", input_shape=[16, 0])
    assert "`model.input_shape`" in error_of(data)

    assert "'eager'" in error_of(params_with(variants=["onnx"]))
    assert "increasing" in error_of(params_with(benchmark={"batch_sizes": [4, 2]}))
    assert "`benchmark.steady_runs`" in error_of(params_with(benchmark={"steady_runs": 0}))
    assert "`benchmark.min_iters`" in error_of(params_with(benchmark={"min_iters": 0}))
    assert "`serve.expected_concurrency`" in error_of(params_with(serve={"expected_concurrency": 0}))
    assert "`serve.memory_share`" in error_of(params_with(serve={"memory_share": 1.5}))
    assert "`serve.max_workers_per_gpu`" in error_of(params_with(serve={"max_workers_per_gpu": 0}))
    assert "`model.factory`" in error_of(params_with(model={**MODEL, "source": "state_dict", "factory": "nocolon"}))


def test_several_mistakes_are_all_named_in_a_fixed_order():
    """One run names every mistake, in the same order every time (the checks' order, then the keys')."""
    bad_name = {**MODEL, "name": "-m"}
    assert "`model.name`" in error_of(params_with(model=bad_name))
    both = error_of(params_with(model=bad_name, benchmark={"batch_sizes": [4, 2]}, tune={"rounds": 0}))
    assert both.startswith("params.yaml: 3 problems, nothing was run:\n"), both
    lines = both.splitlines()[1:]
    assert [next(k for k in ("model.name", "tune.rounds", "benchmark.batch_sizes") if f"`{k}`" in line)
            for line in lines] == ["model.name", "tune.rounds", "benchmark.batch_sizes"], both
    assert both == error_of(params_with(model=bad_name, benchmark={"batch_sizes": [4, 2]}, tune={"rounds": 0}))


def test_type_errors_and_rules_are_reported_together():
    """A wrong type does not hide the other sections' rules (its own section is not judged on a stand-in)."""
    data = params_with(serve={"overrides": {"workers": 0}}, tune={"rounds": "two"})
    data["model"]["task"] = "text-embeding"
    msg = error_of(data)
    assert "3 problems" in msg and "did you mean 'text-embedding'?" in msg
    assert "`serve.overrides.workers` = 0" in msg and "`tune.rounds` = 'two'" in msg


def test_the_message_names_the_file_it_came_from(tmp_path, monkeypatch):
    other = tmp_path / "exp.yaml"
    other.write_text(yaml.safe_dump(params_with(serve={"memory_budget_mb": -1})))
    with pytest.raises(ParamsError) as info:
        load_params(other)
    assert str(info.value).startswith(f"{other}: `serve.memory_budget_mb` = -1.0 is invalid"), str(info.value)
    monkeypatch.setenv("PIPELINE_PARAMS", "examples/tensor/params.yaml")
    assert load_params().model.task == "tensor"


def test_defaults_fill_in():
    params = parse_params(params_with())
    assert params.variants[0] == "eager" and params.model.trust_checkpoint is False
    assert params.model.text.max_length == 128 and params.conversion.golden_batches >= 1


def test_pipeline_params_env_var_selects_another_file(tmp_path, monkeypatch):
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(params_with(variants=["eager", "onnx"])))
    monkeypatch.setenv("PIPELINE_PARAMS", str(other))
    assert load_params().variants == ["eager", "onnx"]
    # An explicit path still wins over the environment.
    assert load_params(REPO_ROOT / "params.yaml").model.name == "minilm"


def test_missing_and_invalid_yaml_files(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)


def test_default_checkpoint_resolves_inside_installed_package():
    from pipeline.core.params import checkpoint_path
    path = checkpoint_path(load_params(REPO_ROOT / "params.yaml"))
    assert path.is_dir() and (path / "config.json").is_file()
    assert not Path(load_params(REPO_ROOT / "params.yaml").model.checkpoint).is_absolute()


IMAGE_MODEL = {"name": "m", "source": "state_dict", "checkpoint": "w.pt", "factory": "m.py:build",
               "task": "image-classification"}


@pytest.mark.parametrize("image, words", [
    ({"size": 224, "resize_shortest_edge": 256}, ["`model.image.size`", "resize_shortest_edge"]),
    ({"resize_shortest_edge": 256}, ["`model.image.resize_shortest_edge`", "crop_size"]),
    ({"crop_size": [224, 224, 3]}, ["`model.image.crop_size`", "[height, width]"]),
    ({"size": 0}, ["`model.image.size`", "positive"]),
    ({"mean": [0.5, 0.5]}, ["`model.image.mean`", "[R, G, B]"]),
    ({"std": [1.0, 0.0, 1.0], "rescale_factor": 0.5}, ["`model.image.std`", "positive"]),
    ({"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
     ["`model.image.std`", "rescale_factor: 0.00392156862745098"]),
    ({"rescale_factor": 0.00392156862745098}, ["`model.image.std`", "rescaled pixels"]),
    ({"rescale_factor": -1.0, "std": 0.5}, ["`model.image.rescale_factor`"]),
    ({"resample": "cubic"}, ["`model.image.resample`", "'bicubic'"]),
    ({"function_to_apply": "relu"}, ["`model.image.function_to_apply`", "'sigmoid'"]),
    ({"top_k": 0}, ["`model.image.top_k`"]),
    ({"max_pixels": 0}, ["`model.image.max_pixels`"]),
])
def test_image_preprocessing_params_are_checked(image, words):
    msg = error_of({"model": {**IMAGE_MODEL, "image": image}})
    assert all(w in msg for w in words), msg


def test_image_preprocessing_params_that_hold():
    ok = [{}, {"size": 224, "mean": 127, "std": 128}, {"size": [224, 320]},
          {"resize_shortest_edge": 256, "crop_size": 224, "resample": "bicubic", "rescale_factor": 0.00392156862745098,
           "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "function_to_apply": "sigmoid"},
          {"crop_size": [32, 48], "rescale_factor": 1.0, "mean": 0.0, "std": 1.0}]
    for image in ok:
        parse_params({"model": {**IMAGE_MODEL, "image": image}})
    # Another task does not read model.image: a value there would be silently ignored, so it is refused.
    msg = error_of({"model": {**MODEL, "image": {"resize_shortest_edge": 256}}})
    assert "`model.image`" in msg and "only image-classification reads it" in msg


def test_slo_above_the_benchmark_latency_cap_is_refused():
    """The sweep stops after the first batch past benchmark.latency_cap_ms: an SLO above it would
    leave batches it could serve unmeasured (issue 30)."""
    msg = error_of(params_with(serve={"latency_slo_ms": 800}))
    assert "`serve.latency_slo_ms`" in msg and "benchmark.latency_cap_ms (400 ms)" in msg
    assert parse_params(params_with(serve={"latency_slo_ms": 800}, benchmark={"latency_cap_ms": 800}))
    assert parse_params(params_with(serve={"latency_slo_ms": 400})).benchmark.latency_cap_ms == 400
