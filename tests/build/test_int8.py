"""int8 variants (issue 14): the task gate, the three converters on tiny models (a model that passes,
an outlier channel that fails and is rejected with its figure, the sensitivity fallback that keeps
the outlier's consumer fp32 and passes), host suitability, and an int8 .mar in a real TorchServe
whose HTTP answers are judged by the int8 gate."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from pipeline.accuracy import task_gate
from pipeline.core.params import ParamsError
from pipeline.core.params_schema import Tolerance, _default_tolerances
from pipeline.accuracy.verify import compare

INT8 = ["onnx-int8-dynamic", "onnx-int8-static", "int8"]
INT8_TOL = _default_tolerances()["int8"]
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")

OUTLIER_FACTORY = '''
import torch
from torch import nn


def build(outlier=0.0):
    """An MLP over 4 tokens of 16 features (3-D, so ONNX exports MatMul as for a transformer); with `outlier`, hidden channel 0 is `outlier` times larger and its consumer's weights
    as much smaller: the same function in fp32, but an activation whose per-tensor int8 range the
    one channel dominates (the failure LLM.int8 / SmoothQuant describe)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    if outlier:
        with torch.no_grad():
            m[0].bias[0] = 3.0                 # channel 0 active for (almost) every input
            m[0].weight[0] *= outlier
            m[0].bias[0] *= outlier
            m[2].weight[:, 0] /= outlier
    return m.eval()
'''


# --------------------------------------------------------------------------- the gate, pure
def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_embedding_figures_recall_and_k_rule():
    rng = np.random.default_rng(0)
    ref = _unit(rng.standard_normal((41, 16)))
    same = task_gate.embedding_figures(ref.copy(), ref, recall_k=10)
    assert same["k"] == 10 and same["recall_at_k"] == 1.0 and same["min_cosine"] == pytest.approx(1.0)
    # A small set gets a small k: neighbours stay a quarter of the others at most.
    assert task_gate.embedding_figures(ref[:9], ref[:9], recall_k=10)["k"] == 2
    # Every vector rotated by the same orthogonal map: cosine to the reference collapses, but the
    # neighbourhoods are intact — the two figures measure different things.
    q, _ = np.linalg.qr(rng.standard_normal((16, 16)))
    rotated = task_gate.embedding_figures(ref @ q, ref, 10)
    assert rotated["recall_at_k"] == pytest.approx(1.0) and rotated["min_cosine"] < 0.9
    # Shuffled rows: each sample keeps a unit vector, but its neighbours are someone else's.
    shuffled = task_gate.embedding_figures(ref[rng.permutation(41)], ref, 10)
    assert shuffled["recall_at_k"] < 0.5
    reason = task_gate.judge(shuffled, INT8_TOL)
    assert "cosine" in reason          # cosine is checked first; the shuffle breaks it too


def test_recall_gate_catches_what_cosine_lets_through():
    rng = np.random.default_rng(1)
    ref = _unit(rng.standard_normal((41, 64)) * 0.05 + 1.0)      # a tight cluster: neighbours are fragile
    got = _unit(ref + rng.standard_normal(ref.shape) * 0.004)
    f = task_gate.embedding_figures(got, ref, 10)
    assert f["min_cosine"] > INT8_TOL.min_cosine and f["recall_at_k"] < INT8_TOL.min_recall_at_k
    assert task_gate.judge(f, INT8_TOL).startswith("recall@10")


def test_classification_figures_and_verify_compare_use_the_task_gate():
    ref = np.eye(6, 10)[[0, 1, 2, 3, 4, 5] * 5] * 5.0 + np.linspace(0, 1, 10)    # 30 samples, clear winners
    got = ref.copy()
    got[3] = np.roll(got[3], 1)                                                    # one sample's top class moves
    figures = task_gate.figures_from_outputs("image-classification", got, ref, INT8_TOL)
    assert figures["top1_agreement"] == pytest.approx(29 / 30) and figures["first_disagreeing_samples"] == [3]
    results = [(30, [got], [ref])]
    v = compare(results, ["logits"], INT8_TOL, True, 0.99, task="image-classification")
    assert not v.passed and "top-1 agreement 0.9667 < min_top1_agreement 0.97" in v.reason
    assert v.as_dict()["task_gate"]["logits"]["top1_disagreements"] == 1
    lenient = Tolerance(**{**INT8_TOL.__dict__, "min_top1_agreement": 0.95})
    assert compare(results, ["logits"], lenient, True, 0.99, task="image-classification").passed
    # The float gates are untouched: the same figures judged element-wise fail on the moved logits.
    assert not compare(results, ["logits"], _default_tolerances()["bfloat16"], True, 0.99,
                       task="image-classification").passed


def test_http_responses_judged_by_the_gate():
    from pipeline.serve.checks.parity import response_within
    gate = {**INT8_TOL.__dict__}
    e = {"embedding": [0.6, 0.8, 0.0]}
    close = {"embedding": [0.61, 0.79, 0.01]}
    assert not response_within(close, e, 1e-4, 1e-3)[0]               # element-wise float32 gate: a miss
    assert response_within(close, e, 1e-4, 1e-3, gate)[0]             # the int8 gate: cosine 0.9998
    ok, _, msg = response_within({"embedding": [0.8, 0.6, 0.0]}, e, 1e-4, 1e-3, gate)
    assert not ok and "cosine" in msg
    top = [{"label": "c", "score": 0.5}, {"label": "b", "score": 0.4}]
    swapped = [{"label": "b", "score": 0.45}, {"label": "c", "score": 0.44}]
    image = "image-classification"
    assert response_within(swapped, top, 1e-4, 1e-3, gate, image)[0]   # near-tie swap: judged over all answers
    assert not response_within([{"label": "a", "score": 0.9}], top, 1e-4, 1e-3, gate, image)[0]
    assert not response_within(swapped, top, 1e-4, 1e-3, gate)[0]      # text-classification: scores, element-wise
    figures = task_gate.responses_figures([(swapped, top), (top, top)], gate, image)
    assert figures["top1_agreement"] == 0.5 and task_gate.judge(figures, gate).startswith("top-1 agreement")


def test_params_need_an_int8_tolerance_when_int8_variants_are_listed(make_params):
    model = {"name": "m", "source": "state_dict", "checkpoint": "x.pt", "factory": "x.py:b", "task": "tensor",
             "input_shape": [4]}
    floats = {k: v.__dict__ for k, v in _default_tolerances().items() if k != "int8"}
    with pytest.raises(ParamsError, match="an `int8` entry"):
        make_params(model, variants=["eager", "onnx-int8-dynamic"], conversion={"tolerances": floats})
    make_params(model, variants=["eager", "onnx"], conversion={"tolerances": floats})   # not needed without int8
    with pytest.raises(ParamsError, match="conversion.int8.calibration"):
        make_params(model, conversion={"int8": {"calibration": "kl"}})


def test_host_suitability():
    from pipeline.build.variants import get_converter
    vnni = {"device": "cpu", "cpu": {"isa": {"avx2": True, "avx512_vnni": True, "amx_int8": False}}}
    avx2 = {"device": "cpu", "cpu": {"isa": {"avx2": True, "avx512_vnni": False, "avx_vnni": False}}}
    old = {"device": "cpu", "cpu": {"isa": {"avx": True, "avx2": False, "sse4_2": True}}}
    gpu = {"device": "cuda", "cpu": {"isa": {"avx2": True}}}
    for v in INT8:
        c = get_converter(v)
        assert c.host_unsuitable(vnni) is None and c.host_unsuitable(avx2) is None
        assert "no integer dot-product" in c.host_unsuitable(old)
        assert "TensorRT" in c.host_unsuitable(gpu)
    assert get_converter("onnx").host_unsuitable(old) is None           # the default: every host


def test_reduce_range_auto_follows_the_usable_isa():
    from pipeline.build.variants.int8.shared import resolve_reduce_range
    x86 = lambda **isa: {"device": "cpu", "cpu": {"arch": "x86_64", "isa": {"avx2": True, **isa}}}  # noqa: E731
    assert resolve_reduce_range("auto", x86(avx512_vnni=False, avx_vnni=False, amx_int8=False))[0] is True
    assert resolve_reduce_range("auto", x86(avx512_vnni=True))[0] is False
    assert resolve_reduce_range("auto", x86(avx_vnni=True))[0] is False
    arm = {"device": "cpu", "cpu": {"arch": "aarch64", "isa": {"asimd": True}}}
    assert resolve_reduce_range("auto", arm)[0] is False                 # no vpmaddubsw there
    assert resolve_reduce_range("auto", {})[0] is False                  # no probe: nothing to go on
    assert resolve_reduce_range(True, x86(avx512_vnni=True)) == (True, "set in params.yaml")
    assert resolve_reduce_range(False, x86()) == (False, "set in params.yaml")


# --------------------------------------------------------------------------- converters on a tiny MLP
@pytest.fixture(scope="module")
def outlier_models(tmp_path_factory):
    """{outlier: (factory spec, checkpoint)} for a plain MLP and its outlier-channel twin."""
    import importlib.util

    from safetensors.torch import save_file
    root = tmp_path_factory.mktemp("int8_models")
    factory = root / "outlier_mlp.py"
    factory.write_text(OUTLIER_FACTORY)
    spec = importlib.util.spec_from_file_location("outlier_mlp", factory)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = {}
    for outlier in (0.0, 1000.0):
        ckpt = root / f"mlp_{int(outlier)}.safetensors"
        save_file({k: v.contiguous() for k, v in module.build(outlier).state_dict().items()}, str(ckpt))
        out[outlier] = (f"{factory}:build", ckpt)
    return out


def _convert(variant, outlier, outlier_models, make_params, tmp_path, conversion=None, env=None, **int8):
    from pipeline.model.checkpoint import load_model
    from pipeline.model.golden import write_golden
    from pipeline.build.variants import get_converter
    from pipeline.build.builder import build_variant
    from pipeline.accuracy.verify import tolerance_for
    factory, ckpt = outlier_models[outlier]
    params = make_params({"name": "mlp", "source": "state_dict", "checkpoint": str(ckpt), "factory": factory,
                          "factory_kwargs": {"outlier": outlier}, "task": "tensor", "input_shape": [4, 16]},
                         variants=["eager", variant],
                         conversion={"int8": {"calibration_samples": 32, **int8}, **(conversion or {})})
    loaded = load_model(params)
    golden = write_golden(params, loaded, tmp_path / "golden")
    converter = get_converter(variant).from_params(params)
    if env is not None:
        converter = converter.for_host(env)
    out = tmp_path / variant
    record = build_variant(converter, loaded, golden, out, "cpu", tolerance_for(params, "int8"),
                           params.conversion.min_topk_agreement)
    return record, out, golden


@pytest.mark.parametrize("variant", INT8)
def test_a_plain_model_passes_its_int8_gate_whole(variant, outlier_models, make_params, tmp_path):
    from handlers.runtimes import load_runtime
    record, out, golden = _convert(variant, 0.0, outlier_models, make_params, tmp_path)
    assert record["status"] == "converted", record["reason"]
    assert record["dtype"] == "int8" and record["tolerance"]["gate"] == "task"
    q = record["quantization"]
    assert q["fp32_ops"] == [] and q["whole_model"]["passed"] and q["quantizable_ops"] == 3
    meta = json.loads((out / "variant.json").read_text())
    assert meta["dtype"] == "int8" and meta["quantization"]["fp32_ops"] == []
    rt = load_runtime(out)
    got = rt.run(golden.batches[-1].feeds)[0]
    rt.close()
    ref = golden.batches[-1].outputs[0]
    assert 1e-5 < np.abs(got - ref).max() <= 0.05 + 0.1 * np.abs(ref).max()     # really quantized, within the gate


@pytest.mark.parametrize("variant", ["onnx-int8-dynamic", "onnx-int8-static"])
def test_an_avx2_host_quantizes_weights_to_7_bits(variant, outlier_models, make_params, tmp_path):
    avx2 = {"device": "cpu", "cpu": {"arch": "x86_64", "isa": {"avx2": True, "avx512_vnni": False}}}
    record, out, _ = _convert(variant, 0.0, outlier_models, make_params, tmp_path, env=avx2)
    assert record["status"] == "converted", record["reason"]
    q = record["quantization"]
    assert q["reduce_range"] is True and "vpmaddubsw" in q["reduce_range_reason"]
    import onnx
    from onnx import numpy_helper
    weights = [numpy_helper.to_array(t) for t in onnx.load(str(out / "model.onnx")).graph.initializer
               if t.data_type == onnx.TensorProto.INT8 and t.dims and len(t.dims) >= 2]
    assert weights and max(int(np.abs(w).max()) for w in weights) <= 64          # 7-bit range, not 127


@pytest.mark.parametrize("variant", INT8)
def test_an_outlier_channel_is_rejected_with_its_figure(variant, outlier_models, make_params, tmp_path):
    record, out, _ = _convert(variant, 1000.0, outlier_models, make_params, tmp_path, sensitivity_budget_s=0,
                              smoothing_alpha=None)
    assert record["status"] == "rejected", record["reason"]
    assert "|diff|" in record["reason"] and "> atol 0.05" in record["reason"]       # the worst element, named
    worst = record["verification"]["worst"]
    assert worst["abs_diff"] > worst["allowed"]
    assert not record["quantization"]["whole_model"]["passed"]
    assert sorted(p.name for p in out.iterdir()) == ["conversion.json"]            # nothing loadable left
    assert len(record["attempts"]) == 1          # the other method would only redraw the same accuracy


@pytest.mark.parametrize("ranking", ["per-op", "local"])
@pytest.mark.parametrize("variant", INT8)
def test_sensitivity_fallback_keeps_the_outlier_consumer_fp32(variant, ranking, outlier_models, make_params,
                                                              tmp_path, monkeypatch):
    from pipeline.build.variants.int8 import sensitivity
    if ranking == "local":      # as on a big model, where one forward per op would not fit in the budget
        monkeypatch.setattr(sensitivity, "RANKING_SHARE", 0.0)
    record, out, _ = _convert(variant, 1000.0, outlier_models, make_params, tmp_path, max_fp32_share=0.7,
                              smoothing_alpha=None)    # the fallback itself (smoothing rescues this model)
    assert record["status"] == "converted", record["reason"]
    q = record["quantization"]
    assert not q["whole_model"]["passed"] and q["stopped_by"] == "gate passed"
    assert q["sensitivity"]["by"].startswith("each op's own output error" if ranking == "local" else "the model's")
    assert q["sensitivity"]["measured"] == q["quantizable_ops"]
    # The layer fed by the outlier channel (Sequential index 2) stays fp32, the last layer is int8.
    # Static QDQ also quantizes the first layer's OUTPUT, which carries the outlier: it stays fp32 too.
    expected = [q["ops"][1], q["ops"][0]] if variant == "onnx-int8-static" else [q["ops"][1]]
    assert q["fp32_ops"] == expected, q
    assert [s["op"] for s in q["sensitivity"]["most_sensitive"][:len(expected)]] == expected
    assert json.loads((out / "variant.json").read_text())["quantization"]["fp32_ops"] == q["fp32_ops"]


# --------------------------------------------------------------------------- smoothing (SmoothQuant)
def _mlp_onnx(outlier_models, outlier, path):
    import torch
    import importlib.util
    factory, _ = outlier_models[outlier]
    spec = importlib.util.spec_from_file_location("outlier_mlp_export", factory.split(":")[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.onnx.export(module.build(outlier).eval(), (torch.randn(2, 4, 16),), str(path), input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}}, dynamo=False)
    return path


@pytest.mark.parametrize("external,threshold", [(False, None), (True, 0), (True, 8192)],
                         ids=["one-file", "external-data", "small-weights-inline"])
def test_smoothing_moves_the_outlier_into_the_weights_and_keeps_the_function(external, threshold, outlier_models,
                                                                            tmp_path):
    """choose() measures α per input and smooths only where it lowers an op's own int8 error; apply()
    writes a graph computing the same outputs, its outlier channel divided down."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from pipeline.build.variants.int8 import smoothing
    from pipeline.build.variants.int8.onnx_int8 import weight_nodes
    from pipeline.build.variants.int8.onnx_int8_errors import onnx_local_errors
    from pipeline.build.variants.int8.sensitivity import Calibration
    src = _mlp_onnx(outlier_models, 1000.0, tmp_path / "mlp.onnx")
    if external:
        m = onnx.load(str(src))
        onnx.save(m, str(src), save_as_external_data=True, all_tensors_to_one_file=True,
                  location="mlp.onnx.data", size_threshold=threshold)      # 8192: the 4 and 2 KB weights inline
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((8, 4, 16)).astype(np.float32)} for _ in range(4)]
    ops = weight_nodes(src)
    groups, record = smoothing.choose(src, ops, feeds, "auto", reduce_range=False, per_channel=True,
                                      static=False, ranking_batches=2)
    assert record["applied"] and record["worst_op_error"]["after"] < record["worst_op_error"]["before"]
    assert sum(record["alpha_per_group"].values()) == record["groups"] == 3
    outlier_group = next(g for g in groups if g.nodes[0].name == ops[1])       # the layer reading channel 0
    assert outlier_group.alpha in smoothing.ALPHAS and outlier_group.act_max[0] > 100 * np.median(outlier_group.act_max)
    dst = tmp_path / "smoothed.onnx"
    smoothing.apply(src, dst, groups, external=external)
    assert (tmp_path / "smoothed.onnx.data").exists() is external
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, feeds[0])[0]  # noqa: E731
    np.testing.assert_allclose(run(dst), run(src), rtol=1e-4, atol=1e-4)
    smoothed = onnx.load(str(dst))
    muls = [n for n in smoothed.graph.node if n.op_type == "Mul" and n.name.startswith("smooth")]
    assert len(muls) == len(groups)
    inv = {t.name: numpy_helper.to_array(t) for t in smoothed.graph.initializer}[
        next(m.input[1] for m in muls if m.input[0] == outlier_group.input)]
    assert inv[0] < 0.1 * np.median(inv)                        # the outlier channel divided most
    cal = Calibration(feeds, [], ["y"], "tensor")
    before = onnx_local_errors(src, ops, cal, False, True, static=False)
    after = onnx_local_errors(dst, ops, cal, False, True, static=False)
    assert after[ops[1]] < 0.5 * before[ops[1]]
    groups_off, off = smoothing.choose(src, ops, feeds, None, False, True, False, 2)
    assert groups_off == [] and not off["applied"]
    fixed, rec = smoothing.choose(src, ops, feeds, 0.5, False, True, False, 2)
    assert {g.alpha for g in fixed} == {0.5} and rec["why"] == "set in params.yaml"


@pytest.mark.parametrize("variant", ["onnx-int8-dynamic", "onnx-int8-static"])
def test_smoothing_lets_the_outlier_model_pass_with_fewer_fp32_ops(variant, outlier_models, make_params, tmp_path):
    """The model whose outlier channel fails whole-model int8 (its consumer kept fp32 without
    smoothing) passes its gate with fewer ops in fp32 once the outlier is smoothed into the weights
    (dynamic int8; static is left as it was)."""
    plain, _, _ = _convert(variant, 1000.0, outlier_models, make_params, tmp_path / "plain", max_fp32_share=0.7,
                           smoothing_alpha=None)
    record, out, golden = _convert(variant, 1000.0, outlier_models, make_params, tmp_path / "smooth",
                                   max_fp32_share=0.7)
    assert record["status"] == "converted", record["reason"]
    q = record["quantization"]
    meta = json.loads((out / "variant.json").read_text())
    if variant == "onnx-int8-static":       # auto smooths dynamic int8 only: static is as without it
        assert not q["smoothing"]["applied"] and "static" in q["smoothing"]["why"]
        assert q["fp32_ops"] == plain["quantization"]["fp32_ops"]
        return
    assert q["smoothing"]["applied"] and q["smoothing"]["groups"] == 3
    assert len(q["fp32_ops"]) < len(plain["quantization"]["fp32_ops"]), (q["fp32_ops"], plain["quantization"]["fp32_ops"])
    assert meta["quantization"]["smoothing"]["applied"]


# --------------------------------------------------------------------------- external data (big models)
# The MLP's fp32 weights are 23 KB: a 0 MB threshold puts every form in external data; 0.02 MB keeps the
# fp32 graph external while its int8 result (~6 KB of weights) is small enough for one file again.
@pytest.mark.parametrize("variant", ["onnx-int8-dynamic", "onnx-int8-static"])
@pytest.mark.parametrize("outlier,threshold_mb,int8_external", [(1000.0, 0, True), (0.0, 0.02, False)],
                         ids=["sensitivity-external", "whole-one-file"])
def test_external_data_model_quantizes_and_loads_from_its_folder(variant, outlier, threshold_mb, int8_external,
                                                                  outlier_models, make_params, tmp_path):
    from handlers.runtimes import load_runtime
    record, out, golden = _convert(variant, outlier, outlier_models, make_params, tmp_path,
                                   conversion={"onnx_external_data_mb": threshold_mb}, max_fp32_share=0.7,
                                   smoothing_alpha=None)
    assert record["status"] == "converted", record["reason"]
    q = record["quantization"]
    assert q["source_external_data"] is True and q["external_data"] is int8_external
    assert q["whole_model"]["passed"] is (outlier == 0.0)        # the outlier case ran the search on external data
    assert int8_external is (q["quantized_bytes"] >= threshold_mb * 10**6)
    meta = json.loads((out / "variant.json").read_text())
    listed = ["model.onnx.data"] if int8_external else []
    assert meta["external_data"] == listed and (out / "model.onnx.data").exists() is int8_external
    assert set(listed) <= set(meta["files"])
    files = sorted(p.name for p in out.iterdir() if p.name not in ("conversion.json", "variant.json"))
    packed = [meta["prepacked"]["artifact"]] if "prepacked" in meta else []
    if variant == "onnx-int8-dynamic":                            # its integer MatMuls pack their weights
        assert bool(packed) is int8_external
    assert files == sorted(["model.onnx"] + listed + packed)    # no quantizer temporaries left beside it
    moved = tmp_path / "elsewhere"
    shutil.move(str(out), moved)
    rt = load_runtime(moved)
    got = rt.run(golden.batches[-1].feeds)[0]
    rt.close()
    ref = golden.batches[-1].outputs[0]
    assert np.abs(got - ref).max() <= 0.05 + 0.1 * np.abs(ref).max()


# --------------------------------------------------------------------------- served in TorchServe
@pytest.mark.torchserve
@needs_java
def test_int8_mar_served_with_parity_within_the_int8_gate(tmp_path, text_params):
    """The torch `int8` variant of the tiny text model, archived by pipeline/serve/archive.py (torch
    handler), started in a real TorchServe; its HTTP answers are judged by the int8 gate the .mar's
    provenance carries (an element-wise float32 gate would fail them)."""
    from pipeline.serve.archive import build_archive
    from pipeline.model.checkpoint import load_model
    from pipeline.model.golden import write_golden
    from pipeline.decide.properties import write_config_properties
    from pipeline.serve.checks.http_cases import load_http_cases, tolerance_from_mar
    from pipeline.serve.serve_check import ServerSpec, check_server
    from pipeline.build.variants import get_converter
    from pipeline.build.builder import build_variant
    from tests.serve.test_archive import build_stage_inputs
    from tests.serve.test_torchserve import DERIVED

    art = tmp_path / "artifacts"
    inputs = build_stage_inputs(art, text_params)
    loaded = load_model(text_params)
    golden = write_golden(text_params, loaded, art / "golden")
    record = build_variant(get_converter("int8").from_params(text_params), loaded, golden,
                           inputs["variants_dir"] / "int8", "cpu", text_params.conversion.tolerances["int8"],
                           text_params.conversion.min_topk_agreement)
    assert record["status"] == "converted", record["reason"]
    import torch
    graph = str(torch.jit.load(str(inputs["variants_dir"] / "int8" / "model.pt")).inlined_graph)
    # Really int8: every traced Linear is a dynamic int8 one (BERT's unused pooler is not in the trace).
    assert 0 < graph.count("quantized::linear_dynamic") <= record["quantization"]["quantizable_ops"]
    assert "aten::linear" not in graph
    inputs["selection_path"].write_text(json.dumps({"winner": "int8", "objective": "throughput", "slo_met": True,
                                                    "message": "test", "variants": {}}))
    store = art / "model_store"
    mar = build_archive(text_params, export_dir=store, **inputs).path
    gate = tolerance_from_mar(mar)
    assert gate["gate"] == "task" and gate["min_recall_at_k"] == 0.95
    derived = {**DERIVED, "max_batch_delay_ms": 5, "startup_timeout_s": 60, "response_timeout_s": 30,
               "job_queue_size": 1000, "max_request_size": 200000, "max_request_bytes": 200000}
    config = inputs["serve_dir"] / "config.properties"
    write_config_properties(config, derived, model_name=text_params.model.name, model_store=store)
    cases = load_http_cases(art / "golden" / "http_cases.json")
    out = check_server(ServerSpec(text_params.model.name, store, config), cases, task="text-embedding",
                       atol=gate["atol"], rtol=gate["rtol"], gate=gate, requests=16, concurrency=4, time_cap_s=60)
    assert out["ready"], out.get("error")
    parity = out["parity"]
    assert parity["ok"], parity["failures"]
    figures = parity["task_gate"]
    assert figures["samples"] == len(cases) and figures["min_cosine"] >= gate["min_cosine"]
    assert figures["recall_at_k"] >= gate["min_recall_at_k"]
    assert out["bad_inputs"]["ok"], out["bad_inputs"]
    assert out["load"]["requests_ok"] == 16
    h = out["handler_load_ms"]          # the handler's own [load] phases, read from the worker log
    assert 0 < h["total"] <= out["worker_load_ms"] and h["warmup_bs4"] > 0 and "runtime_total" in h, h


def test_report_shows_int8_accuracy_beside_its_speed():
    from pipeline.publish.report_inputs import ReportInputs
    from pipeline.publish.report_render import render_markdown
    from pipeline.publish.report_sections import accuracy_trade_blocks
    gate = {"embedding": task_gate.embedding_figures(np.eye(41, 8) + 1.0, np.eye(41, 8) + 1.0, 10)}
    bench = lambda sps: {"steady": {"8": {"batch_size": 8, "throughput_sps": sps}}}  # noqa: E731
    inputs = ReportInputs("m", 200.0, ["onnx", "onnx-int8-dynamic"],
                          conversions={"onnx": {"status": "converted"},
                                       "onnx-int8-dynamic": {"status": "converted", "verification": {"task_gate": gate},
                                                             "quantization": {"fp32_ops": ["a"], "quantizable_ops": 4}}},
                          benchmarks={"onnx": bench(100.0), "onnx-int8-dynamic": bench(150.0)},
                          model_config={"batchSize": 8})
    md = render_markdown(accuracy_trade_blocks(inputs), None)
    row = next(line for line in md.splitlines() if line.startswith("| onnx-int8-dynamic"))
    assert "recall@10 1" in row and "1 of 4" in row and "| 1.5 |" in row


def test_the_sensitivity_ranking_spends_the_budget_not_more():
    """On a big model one ranking forward per op can cost more than the whole budget (bert-large:
    144 ops, 218 s against 120 s): the ranking stops at the budget, the ops it did not reach keep
    their graph order, and the search returns within the budget (+ one attempt)."""
    import time

    from pipeline.build.variants.int8.sensitivity import Calibration, search
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    cal = Calibration([{"x": x}], [[x]], ["y"], "tensor")
    ops = [f"op{i}" for i in range(40)]
    calls = []

    def quantize(exclude, only):
        return len(exclude)

    def run(kept, on):
        # Far off unless 30 ops are kept: whole-model misses, so the search ranks and then searches.
        return [[x + (0.0 if kept >= 30 else 1.0)]]

    def op_errors(candidates, deadline):
        out = {}
        for op in candidates:
            if time.perf_counter() > deadline:
                break
            time.sleep(0.05)
            calls.append(op)
            out[op] = float(len(out))
        return out

    tol = Tolerance(atol=0.05, rtol=0.1, min_cosine=0.995)
    t0 = time.perf_counter()
    _, record = search(ops, quantize, run, cal, tol, 0.99, budget_s=0.5, max_fp32_share=1.0, op_errors=op_errors)
    took = time.perf_counter() - t0
    sens = record["sensitivity"]
    assert 0 < sens["measured"] < len(ops) == sens["of"] and len(calls) == sens["measured"]
    assert record["stopped_by"] == "budget" and took < 0.5 + 0.5          # not 40 × 0.05 s = 2 s of ranking


@pytest.mark.parametrize("budget_s,expected", [(2.0, "local"), (20.0, "per-op")])
def test_the_ranking_is_local_where_one_forward_per_op_would_not_fit(budget_s, expected):
    """40 ops at ~20 ms a forward: 0.8 s of per-op ranking is more than a quarter of a 2 s budget (one
    pass of local errors instead), and less than a quarter of 20 s (the per-op ranking stays)."""
    import time

    from pipeline.build.variants.int8.sensitivity import Calibration, search
    x = np.ones((8, 4), np.float32)
    cal = Calibration([{"x": x}], [[x]], ["y"], "tensor")
    ops = [f"op{i}" for i in range(40)]
    used = []

    def run(kept, on):
        time.sleep(0.02)
        return [[x + (0.0 if kept >= 1 else 1.0)]]      # passes once the most sensitive op is kept

    def op_errors(candidates, deadline):
        used.append("per-op")
        return {op: float(i == 7) for i, op in enumerate(candidates)}

    def local_errors(candidates):
        used.append("local")
        return {op: float(i == 7) for i, op in enumerate(candidates)}

    tol = Tolerance(atol=0.05, rtol=0.1, min_cosine=0.995)
    _, record = search(ops, lambda exclude, only: len(exclude), run, cal, tol, 0.99, budget_s=budget_s,
                       max_fp32_share=1.0, op_errors=op_errors, local_errors=local_errors)
    assert used == [expected]
    assert record["fp32_ops"] == ["op7"] and record["stopped_by"] == "gate passed"
    assert ("one forward per op would take" in record["sensitivity"]["by"]) is (expected == "local")


def test_per_channel_weight_cache_reproduces_ort_and_is_reused(outlier_models, tmp_path):
    """The sensitivity attempts re-quantize the same weights: the memoized per-channel quantization
    must give byte-identical initializers to ORT's own, and the second attempt must not recompute."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from pipeline.build.variants.int8.onnx_int8 import weight_nodes
    from pipeline.build.variants.int8.ort_quantizer import PerChannelWeightCache
    src = _mlp_onnx(outlier_models, 0.0, tmp_path / "fp32.onnx")
    nodes = weight_nodes(src)
    assert len(nodes) == 3

    def quantize(dst, exclude, cache=None):
        kw = dict(per_channel=True, weight_type=QuantType.QInt8, nodes_to_quantize=nodes, nodes_to_exclude=exclude,
                  extra_options={"MatMulConstBOnly": True})
        if cache is None:
            quantize_dynamic(str(src), str(dst), **kw)
        else:
            with cache.active(scope="one build"):
                quantize_dynamic(str(src), str(dst), **kw)
        return {i.name: i.SerializeToString() for i in onnx.load(str(dst)).graph.initializer}

    cache = PerChannelWeightCache()
    plain = quantize(tmp_path / "plain.onnx", [nodes[1]])
    quantize(tmp_path / "whole.onnx", [], cache)                       # fills the cache (3 weights)
    assert (cache.misses, cache.hits) == (3, 0)
    cached = quantize(tmp_path / "cached.onnx", [nodes[1]], cache)     # an attempt keeping one op fp32
    assert (cache.misses, cache.hits) == (3, 2)
    assert cached == plain
    from onnxruntime.quantization.base_quantizer import BaseQuantizer
    assert BaseQuantizer.quantize_weight_per_channel_impl.__name__ == "quantize_weight_per_channel_impl"


def test_quantizer_refreshes_shapes_without_a_second_copy(outlier_models, tmp_path, monkeypatch):
    """In dynamic mode ORT's quantizer deep-copies, saves and reloads the whole model to refresh its
    shapes (three copies of the weights at once). one_model_copy() must give the same quantized
    graph, byte for byte, without that save: the only model written is the result."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from pipeline.build.variants.int8.onnx_int8 import UNTYPED_AS_FLOAT, weight_nodes
    from pipeline.build.variants.int8.ort_quantizer import one_model_copy
    src = _mlp_onnx(outlier_models, 0.0, tmp_path / "fp32.onnx")
    # Value_info for the weights too, as torch.onnx's dynamo export writes it: shape inference keeps
    # what a graph already records, and ORT's optimiser reads it (dropping it changed bert-large's
    # int8 outputs by 0.0035).
    from onnx import helper
    m = onnx.load(str(src))
    m.graph.value_info.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in m.graph.initializer)
    onnx.save(m, str(src), save_as_external_data=True, location="fp32.onnx.data", size_threshold=0)
    kw = dict(per_channel=True, weight_type=QuantType.QInt8, nodes_to_quantize=weight_nodes(src),
              use_external_data_format=True, extra_options={"MatMulConstBOnly": True, **UNTYPED_AS_FLOAT})
    saved = []
    real_save = onnx.save_model
    monkeypatch.setattr(onnx, "save_model", lambda proto, f, *a, **k: (saved.append(str(f)), real_save(proto, f, *a, **k))[1])
    quantize_dynamic(str(src), str(tmp_path / "ort.onnx"), **kw)
    assert len(saved) == 2                       # ORT's own: the reloaded copy, then the result
    saved.clear()
    with one_model_copy():
        quantize_dynamic(str(src), str(tmp_path / "one.onnx"), **kw)
    assert saved == [str(tmp_path / "one.onnx")]
    ours, theirs = (onnx.load(str(tmp_path / f"{n}.onnx")) for n in ("one", "ort"))
    for m in (ours, theirs):
        for t in m.graph.initializer:           # where the bytes came from is not the graph
            t.ClearField("data_location")
    assert ours.graph.SerializeToString() == theirs.graph.SerializeToString()
    from onnxruntime.quantization import onnx_quantizer
    assert onnx_quantizer.save_and_reload_model_with_shape_infer.__name__ == "save_and_reload_model_with_shape_infer"


@pytest.mark.parametrize("method", ["MinMax", "Entropy", "Percentile"])
def test_calibration_over_the_graph_alone_gives_ort_s_ranges(method, outlier_models, tmp_path, monkeypatch):
    """calibrate_to_cache() calibrates before quantize_static without loading the weights into
    Python (the session reads them from the data file): the ranges must be ORT's own, and
    quantize_static must take them from the cache instead of calibrating again."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, calibrate, quantize_static

    from pipeline.build.variants.int8.onnx_int8 import _FeedsReader, weight_nodes
    from pipeline.build.variants.int8.ort_quantizer import calibrate_to_cache
    src = _mlp_onnx(outlier_models, 1000.0, tmp_path / "fp32.onnx")
    onnx.save(onnx.load(str(src)), str(src), save_as_external_data=True, location="fp32.onnx.data", size_threshold=0)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((8, 4, 16)).astype(np.float32)} for _ in range(3)]
    how = getattr(CalibrationMethod, method)
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    loads = []
    real_load = onnx.load_model

    def spy(f, *a, load_external_data=True, **k):
        loads.append(load_external_data)
        return real_load(f, *a, load_external_data=load_external_data, **k)
    monkeypatch.setattr(onnx, "load", spy)
    monkeypatch.setattr(onnx, "load_model", spy)
    calibrate_to_cache(src, _FeedsReader(feeds), ["MatMul", "Gemm"], how, ours)
    monkeypatch.undo()
    assert loads and not any(loads)               # every load the calibration made left the weights on disk
    from onnxruntime.quantization import quant_utils   # ORT's own functions again after the call
    for module in (calibrate, quant_utils):
        assert module.load_model_with_shape_infer.__name__ == "load_model_with_shape_infer"
    assert calibrate.CalibraterBase.create_inference_session.__qualname__ == "CalibraterBase.create_inference_session"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp32.onnx", "fp32.onnx.data", "ours.json"]
    kw = dict(quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul", "Gemm"], activation_type=QuantType.QUInt8,
              weight_type=QuantType.QInt8, nodes_to_quantize=weight_nodes(src), calibrate_method=how,
              use_external_data_format=True)
    quantize_static(str(src), str(tmp_path / "theirs.onnx"), _FeedsReader(feeds), calibration_cache_path=theirs, **kw)
    a, b = calibrate.load_tensors_data(ours), calibrate.load_tensors_data(theirs)
    assert set(a.keys()) == set(b.keys()) and len(a.keys()) > 3
    for name in b.keys():
        np.testing.assert_allclose(a[name].range_value, b[name].range_value, rtol=1e-5, atol=1e-6)
    # The cache is read, never recomputed: an empty reader would fail a calibration.
    quantize_static(str(src), str(tmp_path / "ours.onnx"), _FeedsReader([]), calibration_cache_path=ours, **kw)
    assert [n.op_type for n in onnx.load(str(tmp_path / "ours.onnx")).graph.node] == \
        [n.op_type for n in onnx.load(str(tmp_path / "theirs.onnx")).graph.node]


def test_needed_share_from_the_missed_figures():
    """A miss (1 - figure) must shrink to the margined gate's: recall 0.90 against 0.9625 → 62.5% of
    the error removed; figures that pass, or have no 'at least' form (max_abs), ask nothing."""
    from pipeline.build.variants.int8.sensitivity import needed_share, with_margin
    margined = with_margin(Tolerance(atol=0.05, rtol=0.1, min_cosine=0.995, gate="task"))
    figures = {"embedding": {"min_cosine": 0.9977, "mean_cosine": 0.998, "k": 10, "recall_at_k": 0.90}}
    assert needed_share(figures, margined) == pytest.approx(1 - 0.0375 / 0.10)
    assert needed_share({"y": {"max_abs": 3.0, "min_cosine": 0.9999}}, margined) is None


def test_the_search_stops_where_the_budget_cannot_reach_the_error():
    """bert-large static int8: the error spread evenly over the ops and ~25 s an attempt, so the budget
    could keep only a few ops fp32 — a sliver of the error the gate needed gone. The search stops
    after the ranking, says why, and returns the whole-model quantization for the golden gate to judge."""
    import time

    from pipeline.build.variants.int8.sensitivity import Calibration, search
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    cal = Calibration([{"x": x}], [[x]], ["y"], "tensor")
    ops = [f"op{i}" for i in range(40)]

    def run(kept, on):
        time.sleep(0.1)
        return [[x + (0.0 if kept >= 30 else 1.0)]]

    tol = Tolerance(atol=0.05, rtol=0.1, min_cosine=0.995)
    _, record = search(ops, lambda exclude, only: len(exclude), run, cal, tol, 0.99, budget_s=0.35,
                       max_fp32_share=1.0, op_errors=lambda candidates, deadline: {op: 1.0 for op in candidates})
    assert record["stopped_by"] == "out of reach" and record["fp32_ops"] == []
    assert len(record["attempts"]) == 1
    reach = record["reach"]
    assert reach["out_of_reach"] and reach["keepable_ops"] <= 4 and reach["error_share_keepable"] <= 0.1
    assert "out of reach" in reach["why"]


@pytest.mark.parametrize("static", [False, True])
def test_smoothing_errors_for_every_alpha_at_once_equal_each_alpha_alone(static):
    """Issue 30: the fp32 product of each op is computed once for all α (it was recomputed per α);
    the errors are the same numbers as α by α (the computation as it was, below)."""
    import torch
    from onnx import helper

    from pipeline.build.variants.int8 import smoothing
    from pipeline.build.variants.int8.sensitivity import LocalErrors, fake_quant_activation, fake_quant_weight

    def one_alpha(groups, inputs, weights, alpha, reduce_range, per_channel, static):
        errors = LocalErrors()
        for g in groups:
            s = torch.from_numpy(g.scales(alpha)) if alpha is not None else None
            for n in g.nodes:
                w = weights[n.input[1]]
                wq = fake_quant_weight(w * s[:, None] if s is not None else w, 1 if per_channel else None,
                                       reduce_range)
                xs = [torch.from_numpy(np.asarray(b[g.input], np.float32)) for b in inputs]
                smoothed = [x / s if s is not None else x for x in xs]
                lo_hi = (min(float(x.min()) for x in smoothed), max(float(x.max()) for x in smoothed)) \
                    if static else None
                for x, x_s in zip(xs, smoothed):
                    lo, hi = lo_hi or (float(x_s.min()), float(x_s.max()))
                    errors.add(n.name, x @ w, fake_quant_activation(x_s, lo, hi, static and reduce_range) @ wq)
        return errors.result()
    rng = np.random.default_rng(1)
    w1, w2 = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in ((16, 8), (16, 4)))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["y1"], name="m1"),
             helper.make_node("MatMul", ["x", "w2"], ["y2"], name="m2")]
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    x[..., 0] *= 50.0                                         # an outlier channel
    group = smoothing.SmoothGroup("x", nodes, np.abs(x).reshape(-1, 16).max(axis=0),
                                  np.maximum(w1.abs().amax(dim=1), w2.abs().amax(dim=1)).numpy())
    inputs = [{"x": x}, {"x": x[:, :3] * 0.5}]
    weights = {"w1": w1, "w2": w2}
    alphas = (None, *smoothing.ALPHAS)
    together = smoothing.local_errors_by_alpha([group], inputs, weights, alphas, False, True, static)
    for a in alphas:
        assert together[a] == one_alpha([group], inputs, weights, a, False, True, static)
        assert smoothing.local_errors([group], inputs, weights, a, False, True, static) == together[a]
    assert together[0.8]["m1"] != together[None]["m1"]


def test_torch_int8_attempts_quantize_each_linear_once_and_equal_quantize_dynamic():
    """Issue 30: every attempt of the torch int8 search quantized all its Linears again (~1 s a
    2 GB model's attempt); each is now quantized once per build by quantize_dynamic's own path, and
    an attempt is the module quantize_dynamic makes with that kept set: same types, same outputs."""
    import types

    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    from pipeline.build.variants.base import module_copy
    from pipeline.build.variants.int8.torch_int8 import Attempts
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))).eval()
    names = ["0", "2.0", "2.1"]
    attempts = Attempts(types.SimpleNamespace(module=model), names, None, per_channel=True)
    x = torch.randn(4, 16)
    for kept in ([], ["2.0"], ["0", "2.1"], []):
        got = attempts.quantize(kept, None)
        want = quantize_dynamic(module_copy(model), {n: per_channel_dynamic_qconfig for n in set(names) - set(kept)},
                                dtype=torch.qint8, inplace=True)
        assert [type(m) for m in got.modules()] == [type(m) for m in want.modules()]
        assert torch.equal(got(x), want(x))
    assert set(attempts.quantized) == set(names)                  # each quantized once, reused after
    assert all(isinstance(m, torch.nn.Linear) for m in model.modules() if not isinstance(m, (torch.nn.Sequential,
                                                                                          torch.nn.ReLU)))
