"""Safe checkpoint loading and the task wrappers (pipeline/model/checkpoint.py)."""
from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest

from pipeline.core.params import ParamsError
import torch
from safetensors.torch import save_file

from pipeline.model.checkpoint import CheckpointError, load_model, read_weights


class CreatesMarker:
    """Unpickling this creates a file: the stand-in for arbitrary code in a malicious checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def mlp_params(make_params, factory_file, checkpoint, **model):
    return make_params({"name": "mlp", "source": "state_dict", "checkpoint": str(checkpoint),
                        "factory": f"{factory_file}:build_mlp", "task": "tensor", "input_shape": [8], **model})


def mlp_state():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).state_dict()


# --------------------------------------------------------------------------- malicious pickles
@pytest.mark.parametrize("zip_format", [True, False], ids=["torch-zip", "legacy-pickle"])
def test_malicious_pickle_refused_without_running_it(tmp_path, make_params, factory_file, zip_format):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    payload = {**mlp_state(), "evil": CreatesMarker(marker)}
    torch.save(payload, path, _use_new_zipfile_serialization=zip_format)
    assert not marker.exists()

    with pytest.raises(CheckpointError) as info:
        load_model(mlp_params(make_params, factory_file, path))
    assert not marker.exists(), "the pickle's code ran"
    msg = str(info.value)
    assert "evil.pt" in msg and "trust_checkpoint: true" in msg and "refused" in msg


def test_plain_pickle_file_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps({"w": CreatesMarker(marker)}))
    with pytest.raises(CheckpointError, match="trust_checkpoint"):
        read_weights(path)
    assert not marker.exists()


def test_malicious_hf_pytorch_model_bin_refused(tmp_path, make_params, tiny_text_model_dir):
    folder = tmp_path / "hf"
    shutil.copytree(tiny_text_model_dir, folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({"evil": CreatesMarker(marker)}, folder / "pytorch_model.bin")
    params = make_params({"name": "t", "source": "hf", "checkpoint": str(folder), "task": "text-embedding"})
    with pytest.raises(CheckpointError, match="trust_checkpoint"):
        load_model(params)
    assert not marker.exists()


def test_trust_checkpoint_is_the_explicit_way_out(tmp_path, make_params, factory_file):
    """With trust the pickle does run (that is what the flag means); its non-tensor entry is then reported."""
    marker = tmp_path / "ran"
    path = tmp_path / "trusted.pt"
    torch.save({**mlp_state(), "extra": CreatesMarker(marker)}, path)
    with pytest.raises(CheckpointError, match="mixes tensors with other entries"):
        load_model(mlp_params(make_params, factory_file, path, trust_checkpoint=True))
    assert marker.exists()


# --------------------------------------------------------------------------- corrupt files
def test_truncated_safetensors(tmp_path, make_params, factory_file):
    path = tmp_path / "w.safetensors"
    save_file(dict(mlp_state()), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        load_model(mlp_params(make_params, factory_file, path))
    assert "w.safetensors" in str(info.value)

    path.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_weights(path)


def test_truncated_and_empty_torch_files(tmp_path, make_params, factory_file):
    path = tmp_path / "w.pt"
    torch.save(mlp_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(mlp_params(make_params, factory_file, path))
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        read_weights(path)


def test_missing_checkpoint_file(tmp_path, make_params, factory_file):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(mlp_params(make_params, factory_file, tmp_path / "nope.pt"))


# --------------------------------------------------------------------------- keys
def test_missing_and_unexpected_keys_are_listed(tmp_path, make_params, factory_file):
    state = dict(mlp_state())
    del state["2.bias"]
    state["head.weight"] = torch.zeros(3, 16)
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError) as info:
        load_model(mlp_params(make_params, factory_file, path))
    msg = str(info.value)
    assert "missing keys (1): 2.bias" in msg and "unexpected keys (1): head.weight" in msg
    assert "model.factory" in msg


def test_shape_mismatch_is_listed(tmp_path, make_params, factory_file):
    state = dict(mlp_state())
    state["2.weight"] = torch.zeros(4, 16)
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=r"2\.weight \(checkpoint \(4, 16\) vs model \(3, 16\)\)"):
        load_model(mlp_params(make_params, factory_file, path))


def test_wrapped_state_dict_is_unwrapped(tmp_path, make_params, factory_file):
    path = tmp_path / "ckpt.pth"
    torch.save({"state_dict": mlp_state(), "epoch": 3}, path)
    # {"state_dict": tensors, "epoch": int} is a plain container: weights_only loads it, we unwrap it.
    loaded = load_model(mlp_params(make_params, factory_file, path))
    assert loaded.outputs == ["output"]


# --------------------------------------------------------------------------- factory
@pytest.mark.parametrize("factory, expected", [
    ("no_such_pkg.models:build", "cannot import module `no_such_pkg.models`"),
    ("examples/none/model.py:build", "not found"),
    ("{file}:missing_fn", "has no attribute `missing_fn`"),
    ("{file}:NOT_CALLABLE", "not callable"),
    ("{file}:build_fails", "factory exploded on purpose"),
    ("{file}:build_not_module", "must return a torch.nn.Module"),
])
def test_factory_errors(tmp_path, make_params, factory_file, factory, expected):
    path = tmp_path / "w.safetensors"
    save_file(dict(mlp_state()), str(path))
    params = mlp_params(make_params, factory_file, path, factory=factory.format(file=factory_file))
    with pytest.raises(CheckpointError, match="model.factory") as info:
        load_model(params)
    assert expected in str(info.value)


def test_factory_file_with_syntax_error(tmp_path, make_params):
    bad = tmp_path / "broken.py"
    bad.write_text("def build(:\n")
    path = tmp_path / "w.safetensors"
    save_file(dict(mlp_state()), str(path))
    params = make_params({"name": "x", "source": "state_dict", "checkpoint": str(path),
                          "factory": f"{bad}:build", "task": "tensor", "input_shape": [8]})
    with pytest.raises(CheckpointError, match="SyntaxError"):
        load_model(params)


# --------------------------------------------------------------------------- sources and tasks
def test_tensor_example_from_repo(tensor_params):
    loaded = load_model(tensor_params)
    assert [i.name for i in loaded.inputs] == ["input"] and loaded.inputs[0].dynamic_axes == {0: "batch"}
    assert loaded.outputs == ["output"]
    assert loaded.task == {"kind": "tensor", "input_shape": [16, 32], "input_dtype": "float32"}
    assert loaded.source_files[0].name == "weights.safetensors"
    assert not loaded.module.training
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in loaded.module.parameters())
    out = loaded.module(torch.zeros(3, 16, 32))
    assert out.shape == (3, 10)


@pytest.mark.parametrize("factory, names", [("build_two_heads", ["output_0", "output_1"]),
                                            ("build_dict_out", ["scores", "extra"])])
def test_multi_output_models_get_named_outputs(tmp_path, make_params, factory_file, factory, names):
    import importlib.util
    spec = importlib.util.spec_from_file_location("tf_for_weights", factory_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "w.pt"
    torch.save(getattr(mod, factory)().state_dict(), path)
    loaded = load_model(make_params({"name": "x", "source": "state_dict", "checkpoint": str(path),
                                     "factory": f"{factory_file}:{factory}", "task": "tensor",
                                     "input_shape": [8]}))
    assert loaded.outputs == names
    out = loaded.module(torch.ones(2, 8))
    assert isinstance(out, tuple) and [o.shape for o in out] == [(2, 3), (2, 2)]
    traced = torch.jit.trace(loaded.module, (torch.ones(2, 8),))
    assert [o.shape[0] for o in traced(torch.ones(5, 8))] == [5, 5]


def test_torchscript_source(tmp_path, make_params):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh())
    path = tmp_path / "m.pt"
    torch.jit.save(torch.jit.script(module), str(path))
    params = make_params({"name": "ts", "source": "torchscript", "checkpoint": str(path), "task": "tensor",
                          "input_shape": [8]})
    loaded = load_model(params)
    x = torch.randn(3, 8)
    torch.testing.assert_close(loaded.module(x), module(x))

    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="not a loadable TorchScript archive"):
        load_model(params)


def test_image_classification_wrapper(image_params, tmp_path, make_params, factory_file, tiny_cnn_checkpoint):
    loaded = load_model(image_params)
    assert [(i.name, i.dtype) for i in loaded.inputs] == [("pixels", "float32")]
    assert loaded.outputs == ["logits"]
    assert loaded.task == {"kind": "image-classification", "input_size": [32, 32], "top_k": 3, "num_classes": 5,
                           "labels": None, "problem_type": None, "function": "softmax", "max_pixels": 50_000_000,
                           "preprocess": {"resize": {"height": 32, "width": 32}, "resample": "bilinear", "crop": None,
                                          "rescale_factor": None, "mean": [127.0] * 3, "std": [128.0] * 3,
                                          "from": "params model.image"}}
    assert loaded.module(torch.zeros(4, 3, 32, 32)).shape == (4, 5)

    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps(["a", "b", "c"]))
    params = make_params({"name": "x", "source": "state_dict", "checkpoint": str(tiny_cnn_checkpoint),
                          "factory": f"{factory_file}:build_cnn", "task": "image-classification",
                          "image": {"size": 32, "labels": str(labels)}})
    with pytest.raises(CheckpointError, match="list of 5 names"):
        load_model(params)
    labels.write_text(json.dumps(list("abcde")))
    loaded = load_model(params)
    assert loaded.extra_files == {} and loaded.task["labels"] == list("abcde")     # carried in the task itself


def test_text_embedding_wrapper_pools_masks_and_traces(text_params, tiny_text_model_dir):
    loaded = load_model(text_params)
    assert [(i.name, i.dtype, i.dynamic_axes) for i in loaded.inputs] == [
        ("input_ids", "int64", {0: "batch", 1: "sequence"}), ("attention_mask", "int64", {0: "batch", 1: "sequence"})]
    assert loaded.outputs == ["embedding"]
    assert loaded.task["kind"] == "text-embedding" and loaded.task["pooling"] == "mean"
    assert loaded.task["normalize"] is True and loaded.task["dim"] == 32 and loaded.task["max_length"] == 32
    assert loaded.extra_files == {"tokenizer.json": tiny_text_model_dir / "tokenizer.json"}

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 60, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.inference_mode():
        emb = loaded.module(ids, mask)
        alone = loaded.module(ids[1:2, :5], mask[1:2, :5])     # the same sentence without padding
    assert emb.shape == (3, 32)
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(3))
    torch.testing.assert_close(emb[1:2], alone, atol=1e-5, rtol=1e-4)

    # Traced at one shape, correct at another batch and sequence length (no baked shapes).
    traced = torch.jit.trace(loaded.module, (ids[:2, :7], mask[:2, :7]), check_trace=False)
    ids2 = torch.randint(5, 60, (5, 13), generator=gen)
    mask2 = torch.ones_like(ids2)
    mask2[0, 4:] = 0
    with torch.inference_mode():
        torch.testing.assert_close(traced(ids2, mask2), loaded.module(ids2, mask2), atol=1e-5, rtol=1e-4)


def test_hf_folder_problems(tmp_path, make_params, tiny_text_model_dir):
    folder = tmp_path / "hf"
    shutil.copytree(tiny_text_model_dir, folder)
    params = make_params({"name": "t", "source": "hf", "checkpoint": str(folder), "task": "text-embedding"})

    (folder / "tokenizer.json").rename(folder / "tok.bak")
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_model(params)
    (folder / "tok.bak").rename(folder / "tokenizer.json")

    # Weights of another architecture: the encoder would be random -> refused, keys listed.
    save_file({"other.weight": torch.zeros(2, 2)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys") as info:
        load_model(params)
    assert "embeddings.word_embeddings.weight" in str(info.value)

    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or pytorch_model.bin"):
        load_model(params)

    # A text task from another source is refused by params validation, before any loading.
    with pytest.raises(ParamsError, match="`model.source` = 'torchscript' is invalid; allowed: 'hf' for task"):
        make_params({"name": "t", "source": "torchscript", "checkpoint": str(folder / "config.json"),
                     "task": "text-embedding"})


# --------------------------------------------------------------------------- real models
@pytest.mark.slow
def test_real_minilm_sanity_figures():
    """stack.md: cosine ~0.72 guitar/strumming, ~-0.05 vs the stock market."""
    from handlers.tasks import make_adapter
    from pipeline.core.params import REPO_ROOT, load_params
    params = load_params(REPO_ROOT / "params.yaml")
    loaded = load_model(params)
    assert loaded.task["dim"] == 384 and loaded.task["pooling"] == "mean" and loaded.task["normalize"]
    adapter = make_adapter(loaded.extra_files["tokenizer.json"].parent, loaded.task)
    texts = ["A man is playing a guitar.", "Someone is strumming a guitar.", "The stock market fell sharply today."]
    feeds = adapter.collate([adapter.decode(t, "text/plain") for t in texts])
    assert feeds["input_ids"].shape[1] < 128        # padded to the longest, not the tokenizer's fixed 128
    with torch.inference_mode():
        emb = loaded.module(*loaded.example_inputs(feeds)).numpy()
    assert emb[0] @ emb[1] == pytest.approx(0.72, abs=0.01)
    assert emb[0] @ emb[2] == pytest.approx(-0.05, abs=0.01)


@pytest.mark.slow
def test_real_efficientnet_lite0_through_example_factory():
    from pipeline.core.params import REPO_ROOT, load_params
    params = load_params(REPO_ROOT / "examples/efficientnet-lite0/params.yaml")
    loaded = load_model(params)        # strict: every key of the shipped state_dict matches build()
    assert loaded.task["num_classes"] == 1000 and loaded.task["input_size"] == [224, 224]
    x = torch.from_numpy(np.random.default_rng(0).uniform(-1, 1, (2, 3, 224, 224)).astype(np.float32))
    with torch.inference_mode():
        logits = loaded.module(x)
    assert logits.shape == (2, 1000) and torch.isfinite(logits).all()
    assert float(logits.std()) > 0.5          # trained weights, not a constant/untrained head


def test_hf_image_classification_folder(tmp_path, make_params):
    from transformers import ResNetConfig, ResNetForImageClassification
    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4)
    ResNetForImageClassification(config).eval().save_pretrained(str(tmp_path / "resnet"))
    loaded = load_model(make_params({"name": "r", "source": "hf", "checkpoint": str(tmp_path / "resnet"),
                                     "task": "image-classification", "image": {"size": 32}}))
    assert loaded.outputs == ["logits"] and loaded.task["num_classes"] == 4
    x = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        logits = loaded.module(x)
    assert isinstance(logits, torch.Tensor) and logits.shape == (3, 4)
    traced = torch.jit.trace(loaded.module, (x[:1],), check_trace=False)
    torch.testing.assert_close(traced(x), logits, atol=1e-5, rtol=1e-4)
