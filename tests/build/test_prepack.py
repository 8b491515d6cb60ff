"""pipeline/build/variants/prepack.py with the real ONNX Runtime: a small MLP graph whose MatMul weights
ORT pre-packs, written as the onnx variant leaves it (graph + external data file), rewritten as the
portable graph, the prepacked graph and the grown data file; and a graph ORT packs nothing of,
left byte for byte as it was."""
from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from handlers.runtimes.onnx_family import packing_host, session_options, session_source
from pipeline.build.variants.prepack import PACKED_KEY, PREPACKED_GRAPH, prepack

DATA = "model.onnx.data"


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w1": rng.standard_normal((64, 128)).astype(np.float32) * 0.1,
            "b1": rng.standard_normal(128).astype(np.float32) * 0.1,
            "w2": rng.standard_normal((128, 32)).astype(np.float32) * 0.1}


def reference(x: np.ndarray, w: dict) -> np.ndarray:
    return np.maximum(x @ w["w1"] + w["b1"], 0.0) @ w["w2"]


def save(folder, nodes, w: dict, out_dim: int):
    """model.onnx + model.onnx.data (every tensor over 1 KB outside), as the onnx variant writes them."""
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", out_dim])],
        [numpy_helper.from_array(v, k) for k, v in w.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / "model.onnx"
    onnx.save(model, str(final), save_as_external_data=True, all_tensors_to_one_file=True, location=DATA,
              size_threshold=1024)
    return final


def mlp(folder, w):
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    return save(folder, nodes, w, 32)


def run(path, x) -> np.ndarray:
    # As the runtime loads a variant: the graph is optimised at build time, not at load.
    sess = ort.InferenceSession(str(path), sess_options=session_options(1, graph_optimized=True),
                                providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def packed_initializers(path) -> list[str]:
    model = onnx.load(str(path), load_external_data=False)
    return sorted(t.name for t in model.graph.initializer if any(e.key.startswith(PACKED_KEY) for e in t.external_data))


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_prepack_writes_portable_and_prepacked_graphs_over_one_data_file(tmp_path):
    w = weights()
    final = mlp(tmp_path / "onnx", w)
    folder = final.parent
    before = {p: p.stat().st_size for p in (final, folder / DATA)}
    assert before[folder / DATA] >= w["w1"].nbytes + w["w2"].nbytes     # the weights are outside

    record = prepack(final, DATA)

    assert record is not None
    assert record["artifact"] == PREPACKED_GRAPH and record["host"] == packing_host()
    # Both MatMul weights are packed; the bias of the Add is not a GEMM weight.
    assert record["weights"] == 2
    assert packed_initializers(folder / PREPACKED_GRAPH) == ["w1", "w2"]
    assert packed_initializers(final) == []                 # the portable graph names no packed layout
    after = {p: p.stat().st_size for p in (final, folder / DATA)}
    assert record["packed_bytes"] == sum(after.values()) - sum(before.values())
    # The packed layouts are at least as big as the weights they re-lay (padding only adds).
    assert after[folder / DATA] - before[folder / DATA] >= w["w1"].nbytes + w["w2"].nbytes
    assert sorted(p.name for p in folder.iterdir()) == sorted(["model.onnx", DATA, PREPACKED_GRAPH])

    # Either graph computes the model: the portable one packs at load, the prepacked one maps the layout.
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    want = reference(x, w)
    np.testing.assert_allclose(run(final, x), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(run(folder / PREPACKED_GRAPH, x), want, rtol=1e-4, atol=1e-5)

    # The runtime takes the prepacked graph on this host (it packs like the build host), else the portable one.
    variant = {"artifact": "model.onnx", "external_data": [DATA], "prepacked": record}
    source, note = session_source(folder, variant, "cpu")
    assert (source, note) == (str(folder / PREPACKED_GRAPH), None)
    other = {**variant, "prepacked": {**record, "host": {**record["host"], "onnxruntime": "0.0.0"}}}
    source, note = session_source(folder, other, "cpu")
    assert source == str(final) and "0.0.0" in note


def test_a_graph_with_nothing_to_pack_is_left_as_it_was(tmp_path):
    w = {"bias": np.linspace(-1, 1, 64 * 8, dtype=np.float32).reshape(8, 64)}
    nodes = [helper.make_node("Gather", ["bias", "idx"], ["row"]),
             helper.make_node("Add", ["x", "row"], ["y"])]
    w["idx"] = np.array(3, dtype=np.int64)
    final = save(tmp_path / "onnx", nodes, w, 64)
    folder = final.parent
    before = {p.name: digest(p) for p in folder.iterdir()}

    assert prepack(final, DATA) is None

    assert {p.name: digest(p) for p in folder.iterdir()} == before    # nothing written, nothing left over
    x = np.ones((2, 64), dtype=np.float32)
    np.testing.assert_allclose(run(final, x), x + w["bias"][3], atol=0)


def test_a_failing_session_leaves_the_variant_and_no_work_folder(tmp_path):
    final = mlp(tmp_path / "onnx", weights())
    folder = final.parent
    (folder / DATA).write_bytes(b"")        # the weights are gone: ORT cannot create the session
    before = {p.name: digest(p) for p in folder.iterdir()}
    with pytest.raises(Exception, match=r"External initializer: w[12]"):
        prepack(final, DATA)
    assert {p.name: digest(p) for p in folder.iterdir()} == before
