"""Converters: every variant builds and verifies on tiny models; traces that bake the batch size and
fp16 overflow are caught; a failing converter is recorded and does not stop the others."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from handlers.runtimes import load_runtime
from pipeline.measure.cold import artifact_files
from pipeline.model.checkpoint import InputSpec, LoadedModel, load_model
from pipeline.model.golden import ActivationRange, Golden, GoldenBatch, write_golden
from pipeline.build.variants.base import REGISTRY, Artifact, Converter, get_converter
from pipeline.build.builder import build_variant
from pipeline.accuracy.verify import tolerance_for

FAST_VARIANTS = ["eager", "torchscript", "fp16", "bf16", "onnx", "onnx-fp16"]


# --------------------------------------------------------------------------- helpers
def tensor_case(module: nn.Module, features: int | tuple[int, ...], batch_sizes=(1, 4, 3), seed: int = 0):
    """A LoadedModel + golden set (reference = the eager module) for a one-input tensor model
    (`features`: the sample's size, or its shape)."""
    shape = (features,) if isinstance(features, int) else tuple(features)
    module = module.eval().requires_grad_(False)
    loaded = LoadedModel(module=module, inputs=[InputSpec("input", "float32", {0: "batch"})],
                         outputs=["output"], task={"kind": "tensor", "input_shape": list(shape)})
    rng = np.random.default_rng(seed)
    batches = []
    activations = ActivationRange(module)      # recorded as write_golden does
    for i, b in enumerate(batch_sizes):
        x = rng.standard_normal((b, *shape)).astype(np.float32)
        with torch.inference_mode(), activations:
            y = module(torch.from_numpy(x)).numpy()
        batches.append(GoldenBatch(f"batch_{i}.npz", b, {"input": x}, [y]))
    activations.close()
    golden = Golden(dir=None, task=loaded.task, inputs=[{"name": "input", "dtype": "float32"}],
                    outputs=["output"], batches=batches,
                    manifest={"activation_range": activations.summary()})
    return loaded, golden


def convert(variant, params, loaded, golden, out_dir):
    converter = get_converter(variant).from_params(params)
    return build_variant(converter, loaded, golden, out_dir, "cpu", tolerance_for(params, converter.dtype),
                         params.conversion.min_topk_agreement)


def assert_converted(record, out_dir, golden):
    assert record["status"] == "converted", record["reason"]
    on_disk = json.loads((out_dir / "conversion.json").read_text())
    assert on_disk["status"] == "converted"
    for key in ("variant", "reason", "conversion_s", "artifact_bytes", "dtype", "tolerance", "verification"):
        assert key in on_disk
    assert on_disk["verification"]["batch_sizes"] == sorted({b.batch_size for b in golden.batches})
    meta = json.loads((out_dir / "variant.json").read_text())
    for name in meta["files"]:
        assert (out_dir / name).is_file(), name
    assert on_disk["artifact_bytes"] == sum(f.stat().st_size for f in artifact_files(out_dir, meta)) > 0
    # The folder is self-sufficient: the shared runtime loads it and reproduces the reference.
    rt = load_runtime(out_dir)
    out = rt.run(golden.batches[-1].feeds)
    rt.close()
    assert out[0].dtype == np.float32 and out[0].shape == golden.batches[-1].outputs[0].shape


class BakesBatchSize(nn.Module):
    """Traced at batch 1, `int(h.shape[0])` becomes the constant 1: wrong shape at any other batch."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        h = self.fc(x)
        return h.reshape(int(h.shape[0]), -1)


class BranchesOnBatchSize(nn.Module):
    """Python control flow on the batch size: a trace at batch 1 keeps only the batch-1 branch."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        h = self.fc(x)
        if x.shape[0] == 1:
            return h
        return h * 2.0 + 1.0


class OverflowsFp16(nn.Module):
    """An intermediate activation reaches ~1e5 (> 65504, the fp16 maximum) then is scaled back."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        big = self.fc(x) * 8.0 * 3.0e4
        return big / 3.0e4


class Explodes(Converter):
    """A converter whose build raises (like an exporter hitting an unsupported op)."""
    name = "explodes"
    family = "torch"
    methods = ("boom",)

    def build_boom(self, ctx) -> Artifact:
        raise NotImplementedError("operator aten::frobnicate is not supported by this exporter")


# --------------------------------------------------------------------------- tests
def test_registry_has_one_converter_per_variant():
    from pipeline.core.params import VARIANTS
    import pipeline.build.variants  # noqa: F401
    assert set(VARIANTS) <= set(REGISTRY)
    assert len({REGISTRY[v] for v in VARIANTS}) == len(VARIANTS)
    with pytest.raises(KeyError, match="no converter registered"):
        get_converter("int4")


@pytest.mark.parametrize("variant", FAST_VARIANTS)
def test_tiny_cnn_classifier_converts_and_verifies(variant, image_params, tmp_path):
    loaded = load_model(image_params)
    golden = write_golden(image_params, loaded, tmp_path / "golden")
    out = tmp_path / variant
    record = convert(variant, image_params, loaded, golden, out)
    assert_converted(record, out, golden)
    figures = record["verification"]["outputs"][0]
    assert figures["topk_agreement"] >= image_params.conversion.min_topk_agreement


@pytest.mark.parametrize("variant", ["eager", "torchscript", "bf16", "onnx"])
def test_tiny_text_model_converts_with_dynamic_sequence(variant, text_params, tmp_path):
    loaded = load_model(text_params)
    golden = write_golden(text_params, loaded, tmp_path / "golden")
    seq_lengths = {b.feeds["input_ids"].shape[1] for b in golden.batches}
    assert len(seq_lengths) > 1        # the golden set really varies the sequence length
    out = tmp_path / variant
    record = convert(variant, text_params, loaded, golden, out)
    assert_converted(record, out, golden)
    assert (out / "tokenizer.json").is_file()      # the task's extra file travels with the variant
    if variant == "onnx":   # its output "embedding" no longer collides with the exporter's aten.embedding value
        assert record["method"] == "dynamo", record["attempts"]


@pytest.mark.parametrize("variant", FAST_VARIANTS)
def test_tiny_mlp_converts_and_verifies(variant, make_params, tmp_path):
    params = make_params({"name": "m", "source": "state_dict", "checkpoint": "x.pt", "factory": "x.py:b",
                          "task": "tensor", "input_shape": [8]})
    torch.manual_seed(0)
    loaded, golden = tensor_case(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), 8)
    record = convert(variant, params, loaded, golden, tmp_path / variant)
    assert_converted(record, tmp_path / variant, golden)
    if variant in ("fp16", "bf16"):
        assert json.loads((tmp_path / variant / "variant.json").read_text())["dtype"] == \
            {"fp16": "float16", "bf16": "bfloat16"}[variant]


def test_the_onnx_export_is_shared_by_the_onnx_variants_of_one_model(make_params, tmp_path, monkeypatch):
    """bert-large exported the same fp32 graph four times (20 s each): the first ONNX variant keeps it,
    the next reuse it. fp16 goes first here: it rewrites its copy in place, and the kept export must
    still be the fp32 graph the `onnx` variant then verifies. Another weight is another model."""
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    params = make_params({"name": "m", "source": "state_dict", "checkpoint": "x.pt", "factory": "x.py:b",
                          "task": "tensor", "input_shape": [8]})
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    loaded, golden = tensor_case(module, 8)
    exports = {}
    for variant in ("onnx-fp16", "onnx"):
        record = convert(variant, params, loaded, golden, tmp_path / variant)
        assert_converted(record, tmp_path / variant, golden)
        exports[variant] = json.loads((tmp_path / variant / "variant.json").read_text())["export"]
    assert exports["onnx-fp16"]["reused"] is False and exports["onnx"]["reused"] is True
    assert exports["onnx"]["key"] == exports["onnx-fp16"]["key"]
    with torch.no_grad():
        module[0].weight[0, 0] += 1.0
    loaded, golden = tensor_case(module, 8)
    record = convert("onnx", params, loaded, golden, tmp_path / "changed")
    assert_converted(record, tmp_path / "changed", golden)
    changed = json.loads((tmp_path / "changed" / "variant.json").read_text())["export"]
    assert changed["reused"] is False and changed["key"] != exports["onnx"]["key"]


@pytest.mark.parametrize("model_cls", [BakesBatchSize, BranchesOnBatchSize])
def test_trace_that_only_works_at_its_batch_size_is_rejected(model_cls, make_params, tmp_path):
    params = make_params({"name": "m", "source": "state_dict", "checkpoint": "x.pt", "factory": "x.py:b",
                          "task": "tensor", "input_shape": [8]})
    torch.manual_seed(0)
    loaded, golden = tensor_case(model_cls(), 8, batch_sizes=(1, 4))
    record = convert("torchscript", params, loaded, golden, tmp_path / "ts")
    assert record["status"] in ("rejected", "failed")
    assert record["status"] == "rejected"          # it built, but the golden set caught it
    assert "batch size 4" in record["reason"]
    assert sorted(p.name for p in (tmp_path / "ts").iterdir()) == ["conversion.json"]   # nothing loadable left
    assert [a["method"] for a in record["attempts"]] == ["trace-freeze", "trace"]
    # eager is not fooled either: torch.export refuses the specialisation, or the scripted fallback verifies
    record = convert("eager", params, loaded, golden, tmp_path / "eager")
    assert record["status"] == "converted", record["reason"]
    assert record["verification"]["batch_sizes"] == [1, 4]


def test_fp16_overflow_rejects_half_variants_only(make_params, tmp_path):
    params = make_params({"name": "m", "source": "state_dict", "checkpoint": "x.pt", "factory": "x.py:b",
                          "task": "tensor", "input_shape": [8]})
    loaded, golden = tensor_case(OverflowsFp16(), 8)
    ref_max = max(float(np.abs(b.outputs[0]).max()) for b in golden.batches) * 3.0e4
    assert ref_max > 65504          # the intermediate really leaves the fp16 range
    status = {}
    for variant in ("fp16", "onnx-fp16", "bf16", "torchscript", "onnx"):
        record = convert(variant, params, loaded, golden, tmp_path / variant)
        status[variant] = record["status"]
    assert status["fp16"] == status["onnx-fp16"] == "rejected"
    assert status["bf16"] == status["torchscript"] == status["onnx"] == "converted"
    for variant in ("fp16", "onnx-fp16"):
        record = json.loads((tmp_path / variant / "conversion.json").read_text())
        # Rejected from the reference's activation range, before building: ONNX Runtime's CPU
        # provider would upcast this chain to fp32 and hide the overflow that any real fp16
        # device hits — the verdict must not depend on that.
        assert "overflow float16" in record["reason"] and "65504" in record["reason"]
        assert "`<model>: mul`" in record["reason"]           # where: the top-level forward's multiplication
        assert sorted(p.name for p in (tmp_path / variant).iterdir()) == ["conversion.json"]


def test_half_precision_is_still_verified_by_its_outputs(make_params, tmp_path):
    """Within the fp16 range, the fp16 variant is judged by its numbers (the worst element reported)."""
    params = make_params({"name": "m", "source": "state_dict", "checkpoint": "x.pt", "factory": "x.py:b",
                          "task": "tensor", "input_shape": [8]})
    loaded, golden = tensor_case(OverflowsFp16(), 8)
    golden.manifest = {}            # no range record (an old golden set): the outputs decide
    record = convert("fp16", params, loaded, golden, tmp_path / "fp16")
    worst = record["verification"]["worst"]
    assert record["status"] == "rejected"
    assert worst["output"] == "output" and not np.isfinite(worst["got"])
    assert "non-finite" in record["reason"]


def test_a_converter_that_raises_is_recorded_and_others_still_convert(make_params, tmp_path):
    params = make_params({"name": "m", "source": "state_dict", "checkpoint": "x.pt", "factory": "x.py:b",
                          "task": "tensor", "input_shape": [8]})
    torch.manual_seed(0)
    loaded, golden = tensor_case(nn.Linear(8, 3), 8)
    record = build_variant(Explodes(), loaded, golden, tmp_path / "explodes", "cpu",
                           tolerance_for(params, "float32"), 0.99)
    assert record["status"] == "failed"
    assert "aten::frobnicate" in record["reason"] and "NotImplementedError" in record["reason"]
    assert any("build_boom" in line for line in record["traceback"])
    assert json.loads((tmp_path / "explodes" / "conversion.json").read_text())["status"] == "failed"
    record = convert("torchscript", params, loaded, golden, tmp_path / "ts")
    assert record["status"] == "converted"


class _TiedMLP(nn.Module):
    """Two layers share one weight (as tied embeddings do): the weights file keeps it once."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.mid2 = nn.Linear(16, 16)
        self.mid2.weight = self.mid.weight

    def forward(self, x):
        return self.out(torch.relu(self.mid2(torch.relu(self.mid(torch.relu(self.inp(x)))))))


def test_aoti_compiles_a_dynamic_batch_library_with_its_weights_mapped_apart(make_params, tmp_path):
    # The one AOTInductor test (cold compile ~25 s+): dynamic batch verified at 1, 4 and 3.
    from handlers.runtimes.torch_family import AotiLibrary
    from tests.handlers.test_runtime import mapped_files
    params = make_params({"name": "m", "source": "state_dict", "checkpoint": "x.pt", "factory": "x.py:b",
                          "task": "tensor", "input_shape": [8]})
    import gc

    from tests.scenarios.test_big_models import _reloadable, weight_storage_refs
    torch.manual_seed(0)
    loaded, golden = tensor_case(_TiedMLP().eval(), 8)
    reloads = _reloadable(loaded)       # the state it reloads from is a copy: the weights below can go
    weights = weight_storage_refs(loaded.module)
    folder = tmp_path / "aoti"
    record = convert("aoti", params, loaded, golden, folder)
    # The build lets the module go once exported (nothing of torch.export's keeps its weights).
    gc.collect()
    assert loaded.module is None and reloads == [] and [w() for w in weights] == [None] * len(weights)
    loaded.require_module()
    assert_converted(record, folder, golden)
    assert record["verification"]["batch_sizes"] == [1, 3, 4]
    variant = json.loads((folder / "variant.json").read_text())
    assert variant["device"] == "cpu"
    # On CPU the library ships unpacked (opened in place at load), not the package it came in, and
    # its weights apart: the library holds none, the weights file each storage once (tied kept tied).
    assert variant["artifact"] == "aoti.so" and not (folder / "aoti.pt2").exists()
    assert variant["weights"] == "aoti.so.weights" and {"aoti.so.weights", "aoti.so.weights.json"} <= set(variant["files"])
    stored = {p.data_ptr(): p.numel() * 4 for p in loaded.module.parameters()}
    # (inductor folds the 4-element bias into its kernel; a second copy of the tied weight would add 1024)
    assert sum(stored.values()) - 16 <= (folder / "aoti.so.weights").stat().st_size < sum(stored.values()) + 1024 - 64
    runtime = load_runtime(folder)
    library = runtime.model
    assert isinstance(library, AotiLibrary) and library.constants
    mapped = [t for t in library.constants.values()]
    assert all(str((folder / "aoti.so.weights").resolve()) in mapped_files(t.data_ptr()) for t in mapped)
    # A second library on the same file (the build's verification after its screen) shares the mapping:
    # torch's binding never lets go of user-managed constants, so a fresh one each time would add up.
    load_runtime(folder).close()
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert len({ln.split()[0] for ln in maps if ln.endswith(str((folder / "aoti.so.weights").resolve()))}) == 1
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    with torch.no_grad():
        expected = loaded.module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(runtime.run({"input": x})[0], expected, rtol=1e-5, atol=1e-5)


def test_aoti_ships_the_library_alone_only_when_nothing_else_in_the_package_runs():
    import io
    import zipfile

    from pipeline.build.variants.aoti import library_member
    model = "m/data/aotinductor/model/"
    cases = {"cpu": {model + "abc.wrapper.so": b"ELF", model + "abc.wrapper.cpp": b"src",
                     model + "abc.wrapper_metadata.json": b"{}", "m/byteorder": b"little", "m/archive_format": b"pt2",
                     "m/archive_version": b"1", "m/data/weights/weight_0": b"w", model + "weights_config.json": b"{}"},
             "cuda": {model + "abc.wrapper.so": b"ELF", model + "k1.cubin": b"bin"},
             "two libraries": {model + "abc.wrapper.so": b"ELF", model + "def.kernel.so": b"ELF"}}
    for name, members in cases.items():
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as z:
            for member, data in members.items():
                z.writestr(member, data)
        with zipfile.ZipFile(buffer) as z:
            assert (library_member(z) == model + "abc.wrapper.so") == (name == "cpu"), name


def test_module_copy_shares_unchanged_weights_and_converts_without_an_fp32_copy():
    """Converters work on module_copy(): fp32 weights on their device are shared (no second copy of a
    GB-sized model), a dtype change makes new tensors from the originals, and the loaded model is
    left as it was, whatever is done to the copy's structure."""
    from pipeline.build.variants.base import module_copy
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model.register_buffer("steps", torch.arange(3))            # an integer buffer keeps its dtype
    same = module_copy(model)
    assert same is not model and same[0] is not model[0]
    assert same[0].weight.data_ptr() == model[0].weight.data_ptr()
    half = module_copy(model, "cpu", torch.bfloat16)
    assert half[0].weight.dtype == torch.bfloat16 and half.steps.dtype == torch.int64
    assert model[0].weight.dtype == torch.float32
    same[2] = nn.Identity()                                     # restructuring the copy (as quantize_dynamic does)
    assert isinstance(model[2], nn.Linear)
    x = torch.randn(3, 4)
    torch.testing.assert_close(half(x.bfloat16()).float(), model(x), atol=0.05, rtol=0.05)
