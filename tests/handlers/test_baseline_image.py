"""The naive baseline (handlers/baseline_handler.py) on image-classification, packed by the archive stage
(`write_baseline` + `build_reference`, as serve_check packs it) and run by TorchServe's own model loader
with the repo off sys.path: a transformers folder and a factory + state_dict alike answer in the
pipeline's format and honour the request's `parameters` (top_k, function_to_apply) as the pipeline's
handler does (handlers/tasks/image.py); a bad parameter gets its 400 beside them."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from handlers.tasks import make_adapter
from pipeline.model.checkpoint import load_model
from pipeline.serve.reference.reference_archives import build_reference, write_baseline
from tests.handlers.test_task_image import png
from tests.model.test_image_task import tiny_vit
from tests.serve.test_archive import load_and_predict, unpack

B64 = base64.b64encode(png(40, 30, seed=2)).decode("ascii")
REQUESTS = [(json.dumps({"inputs": "data:image/png;base64," + B64}), "application/json"),
            (json.dumps({"inputs": B64}), "application/json"),
            (json.dumps({"inputs": B64, "parameters": {"top_k": 2, "function_to_apply": "none"}}), "application/json"),
            (json.dumps({"inputs": B64, "parameters": {"top_k": 1, "function_to_apply": "sigmoid"}}),
             "application/json"),
            (json.dumps({"inputs": B64, "parameters": {"function_to_apply": "tanh"}}), "application/json")]


def baseline_image_answers(tmp_path, params) -> tuple[dict, list]:
    """The baseline's answers to REQUESTS as ONE TorchServe batch, and the pipeline's adapter's answers
    to the same requests from the eager model (None for the bad one)."""
    loaded = load_model(params)
    eager = tmp_path / "variants" / "eager"
    eager.mkdir(parents=True)
    (eager / "variant.json").write_text(json.dumps({
        "variant": "eager", "task": loaded.task, "files": ["variant.json"],
        "inputs": [{"name": i.name} for i in loaded.inputs], "outputs": [{"name": o} for o in loaded.outputs]}))
    write_baseline(params, variants_dir=tmp_path / "variants", baseline_dir=tmp_path / "baseline")
    mar = build_reference(tmp_path / "baseline", tmp_path / "scratch", params.model.name).mar
    got = load_and_predict(unpack(mar, tmp_path / "unpacked"), REQUESTS)
    adapter = make_adapter(eager, loaded.task)
    want = []
    for body, ct in REQUESTS[:-1]:
        decoded = adapter.decode_request(body.encode(), ct)
        with torch.no_grad():
            logits = loaded.module(torch.from_numpy(np.stack([r["pixels"] for r in decoded.rows])))
        want.append(adapter.respond_request([[logits[0].numpy()]], decoded.meta))
    return got, want + [None]


@pytest.mark.parametrize("source", ["hf", "state_dict"])
def test_baseline_image_classification_honours_parameters(tmp_path, make_params, factory_file, tiny_cnn_checkpoint,
                                                           source):
    if source == "hf":
        model = {"name": "tiny-vit", "source": "hf", "checkpoint": str(tiny_vit(tmp_path / "vit")),
                 "task": "image-classification"}
    else:
        model = {"name": "tiny-cnn", "source": "state_dict", "checkpoint": str(tiny_cnn_checkpoint),
                 "factory": f"{factory_file}:build_cnn", "task": "image-classification",
                 "image": {"size": 32, "top_k": 3}}
    got, want = baseline_image_answers(tmp_path, make_params(model))
    assert got["status"] == [200, 200, 200, 200, 400], got
    assert "function_to_apply" in got["out"][4]["error"]
    assert [len(a) for a in got["out"][:4]] == [3, 3, 2, 1]
    for answer, expected in zip(got["out"][:4], want[:4]):
        assert [a["label"] for a in answer] == [e["label"] for e in expected], (answer, expected)
        np.testing.assert_allclose([a["score"] for a in answer], [e["score"] for e in expected], atol=1e-5)
    # function_to_apply none: the raw logits, not probabilities
    assert got["out"][2][0]["score"] != pytest.approx(got["out"][1][0]["score"])
