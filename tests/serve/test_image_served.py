"""image-classification in a REAL TorchServe 0.12: tiny HF image classifiers built here (a ViT with a
non-square input and a multi-label head; a ConvNeXT whose processor resizes the short side and crops
by crop_pct), each with its preprocessor_config.json and id2label, go through the pipeline's own steps
(prepare's golden set, the eager variant verified, the archive with the torch handler) and are served.
Their HTTP answers equal `transformers.pipeline("image-classification")` on the eager model for
images of other sizes and aspect ratios (raw bodies and JSON base64 with parameters): the same labels
in the same order, scores within 0.01. The golden HTTP cases pass the serve_check parity, and bad
images sent beside good ones (a decompression bomb, a truncated file, not base64...) get a 4xx while
their batch-mates are answered and the worker stays up."""
from __future__ import annotations

import base64
import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = [pytest.mark.torchserve,
              pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")]

transformers = pytest.importorskip("transformers")

SERVED = {"batch_size": 4, "max_batch_delay_ms": 50, "workers": 1, "threads_per_worker": 1,
          "response_timeout_s": 30, "startup_timeout_s": 60, "job_queue_size": 200,
          "max_request_size": 2000000, "max_response_size": 2000000, "max_request_bytes": 2000000, "device": "cpu"}
LABELS = ["cat", "dog", "owl", "fox", "bee", "elk"]
FIGURES: dict = {}


def _save(model, processor, folder: Path) -> Path:
    with torch.no_grad():                   # spread the logits: no near-ties for the order to hinge on
        model.classifier.weight.mul_(25.0)
    model.eval().save_pretrained(str(folder))
    processor.save_pretrained(str(folder))
    return folder


def tiny_vit(folder: Path) -> Path:
    torch.manual_seed(11)
    config = transformers.ViTConfig(image_size=(24, 40), patch_size=8, hidden_size=16, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=32, num_labels=len(LABELS),
                                    id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)},
                                    problem_type="multi_label_classification")
    processor = transformers.ViTImageProcessorPil(size={"height": 24, "width": 40}, resample=3,
                                                  image_mean=[0.48, 0.46, 0.41], image_std=[0.27, 0.26, 0.28])
    return _save(transformers.ViTForImageClassification(config), processor, folder)


def tiny_convnext(folder: Path) -> Path:
    torch.manual_seed(12)
    config = transformers.ConvNextConfig(patch_size=4, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                                         num_labels=len(LABELS), id2label=dict(enumerate(LABELS)),
                                         label2id={n: i for i, n in enumerate(LABELS)})
    processor = transformers.ConvNextImageProcessorPil(size={"shortest_edge": 32}, crop_pct=0.8)
    return _save(transformers.ConvNextForImageClassification(config), processor, folder)


MODELS = {"vit": tiny_vit, "convnext": tiny_convnext}


def images() -> list[tuple[bytes, str]]:
    """Files of sizes and aspect ratios the models never take as they are (the resize and crop matter)."""
    rng = np.random.default_rng(5)
    out = []
    for k, (w, h) in enumerate([(64, 48), (30, 90), (200, 120), (37, 37), (120, 41), (50, 75)]):
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h)], axis=-1)
        noisy = np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        fmt = "JPEG" if k % 3 == 2 else "PNG"
        Image.fromarray(noisy, "RGB").save(buf, format=fmt)
        out.append((buf.getvalue(), f"image/{fmt.lower()}"))
    return out


def serve(root: Path, folder: Path):
    """The pipeline's own steps: golden set, eager variant verified, .mar; a TorchServe for it."""
    from pipeline.core.params import parse_params
    from pipeline.serve.variant_server import serve_variant

    params = parse_params({"model": {"name": f"tiny-{folder.name}", "source": "hf", "checkpoint": str(folder),
                                     "task": "image-classification"},
                           "variants": ["eager"], "benchmark": {"batch_sizes": [1, 4]},
                           "conversion": {"golden_batches": 2}})
    served = serve_variant(params, root, settings=SERVED)
    return served.ts, served.golden.dir


def post_all(ts, requests: list) -> list:
    """All requests at once (4 clients): TorchServe batches them."""
    def one(item):
        body, ct = item
        r = ts.api.predict(body if isinstance(body, bytes) else json.dumps(body).encode(), ct)
        return r.status, r.json()
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, requests))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_served_answers_equal_transformers_pipeline(tmp_path, name):
    from pipeline.serve.checks.bad_input import bad_input_cases, check_bad_inputs, max_request_size
    from pipeline.serve.checks.http_cases import load_http_cases
    from pipeline.serve.checks.parity import check_parity

    folder = MODELS[name](tmp_path / name)
    processor = transformers.AutoImageProcessor.from_pretrained(str(folder))      # the PIL one without torchvision
    pipe = transformers.pipeline("image-classification", model=str(folder), device="cpu", image_processor=processor)
    ts, golden_dir = serve(tmp_path, folder)
    files = images()
    pictures = [Image.open(io.BytesIO(body)) for body, _ in files]
    good = list(files) + [({"inputs": base64.b64encode(body).decode("ascii"), "parameters": params}, "application/json")
                          for (body, _), params in zip(files, [{"top_k": 2}, {"function_to_apply": "softmax"},
                                                               {"top_k": 6, "function_to_apply": "none"}])]
    want = [pipe(p) for p in pictures] + [pipe(pictures[0], top_k=2), pipe(pictures[1], function_to_apply="softmax"),
                                          pipe(pictures[2], top_k=6, function_to_apply="none")]
    bad = [(b"\x89PNG\r\n\x1a\n broken", "image/png"), ({"inputs": "@@not base64@@"}, "application/json"),
           ("a sentence", "text/plain")]
    with ts:
        answers = post_all(ts, good[:4] + bad + good[4:])
        assert [s for s, _ in answers[4:7]] == [400, 400, 415], answers[4:7]
        assert "not a decodable image" in answers[4][1]["error"] and "base64" in answers[5][1]["error"]
        served = answers[:4] + answers[7:]
        for (status, body), w in zip(served, want):
            assert status == 200, body
            assert [b["label"] for b in body] == [x["label"] for x in w], (body, w)
            assert max(abs(b["score"] - x["score"]) for b, x in zip(body, w)) < 0.01, (body, w)
        cases = load_http_cases(golden_dir / "http_cases.json")
        parity = check_parity(ts, cases, 1e-4, 1e-3, 4, task="image-classification")
        assert parity["ok"], parity["failures"]
        bad_cases = bad_input_cases("image-classification", cases, max_request_size(ts))
        checked = check_bad_inputs(ts, bad_cases, cases, 1e-4, 1e-3, task="image-classification")
        assert checked["ok"], checked
        assert {c["id"]: c["status"] for c in checked["cases"]}["decompression_bomb"] == 413
    FIGURES[name] = max(abs(b["score"] - x["score"]) for (_, body), w in zip(served, want) for b, x in zip(body, w))
    print("served-vs-transformers max score differences:", FIGURES)
