"""The image-classification adapter (handlers/tasks/image.py): the body forms it takes, the answer in
transformers' format, and bad images refused with a 4xx that names the problem and the fix.
(The recipe against transformers' processors: tests/model/test_image_task.py.)"""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from handlers.tasks.image import center_crop
from handlers.tasks import RequestError, make_adapter
from pipeline.serve.checks.bad_input import png_claiming

RECIPE = {"resize": {"shortest_edge": 20}, "resample": "bicubic", "crop": {"height": 16, "width": 16},
          "rescale_factor": 1 / 255, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}
LABELS = ["cat", "dog", "owl", "fox"]


def png(width: int = 30, height: int = 20, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def adapter(tmp_path):
    return make_adapter(tmp_path, {"kind": "image-classification", "input_size": [16, 16], "preprocess": RECIPE,
                                   "labels": LABELS, "top_k": 3, "function": "softmax", "max_pixels": 15_000,
                                   "max_request_bytes": 200_000})


def refusal(adapter, body, ct) -> tuple[int, str]:
    with pytest.raises(RequestError) as info:
        adapter.decode_request(body, ct)
    return info.value.status, info.value.message


def test_raw_body_json_base64_and_data_uri_decode_alike(adapter):
    body = png()
    want = adapter.decode(body, "image/png")["pixels"]
    assert want.shape == (3, 16, 16) and want.dtype == np.float32
    b64 = base64.b64encode(body).decode("ascii")
    for doc, ct in [(body, None), (body, "application/octet-stream"), ({"inputs": b64}, "application/json"),
                    (json.dumps({"inputs": b64}).encode(), "application/json"),
                    (json.dumps({"inputs": "data:image/png;base64," + b64}).encode(), None),
                    ({"inputs": b64[:40] + "\n" + b64[40:]}, "application/json")]:
        np.testing.assert_array_equal(adapter.decode(doc, ct)["pixels"], want)


def test_parameters_choose_top_k_and_the_score_function(adapter):
    logits = np.array([1.0, 3.0, 2.0, -1.0], dtype=np.float32)
    b64 = base64.b64encode(png()).decode("ascii")
    default = adapter.decode_request(png(), "image/png")
    answer = adapter.respond_request([[logits]], default.meta)
    assert [a["label"] for a in answer] == ["dog", "owl", "cat"] and set(answer[0]) == {"label", "score"}
    e = np.exp(logits - logits.max())
    assert answer[0]["score"] == pytest.approx(float(e[1] / e.sum()), abs=1e-6)
    req = adapter.decode_request({"inputs": b64, "parameters": {"top_k": 10, "function_to_apply": "sigmoid"}},
                                 "application/json")
    answer = adapter.respond_request([[logits]], req.meta)
    assert len(answer) == 4 and answer[0]["score"] == pytest.approx(1 / (1 + np.exp(-3.0)), abs=1e-6)
    req = adapter.decode_request({"inputs": b64, "parameters": {"top_k": 1, "function_to_apply": "none"}},
                                 "application/json")
    assert adapter.respond_request([[logits]], req.meta) == [{"label": "dog", "score": 3.0}]
    # No function in the task: as transformers, one label -> sigmoid, several -> softmax.
    one = make_adapter(".", {"kind": "image-classification", "preprocess": RECIPE, "labels": ["yes"]})
    assert one.respond([np.array([[0.0]])], 0) == [{"label": "yes", "score": 0.5}]


@pytest.mark.parametrize("body, ct, status, words", [
    (b"", "image/png", 400, "empty"),
    (b"GIF89a not really", "image/gif", 400, "not a decodable image"),
    (png()[:60], "image/png", 400, "cannot be decoded"),
    ("a sentence", "text/plain", 415, "not an image"),
    (b'{"inputs": ', "application/json", 400, "not valid JSON"),
    (b'["x"]', "application/json", 400, "must be an object"),
    ({"image": "x"}, "application/json", 400, "unknown key(s) ['image']"),
    ({"parameters": {}}, "application/json", 400, "no `inputs`"),
    ({"inputs": 5}, "application/json", 400, "base64-encoded (a string)"),
    ({"inputs": "   "}, "application/json", 400, "`inputs` is empty"),
    ({"inputs": "not base64!"}, "application/json", 400, "not valid base64"),
    ({"inputs": base64.b64encode(b"hello").decode()}, "application/json", 400, "not a decodable image"),
    ({"inputs": base64.b64encode(png()).decode(), "parameters": {"top_k": 0}}, "application/json", 400,
     "parameters.top_k = 0"),
    ({"inputs": base64.b64encode(png()).decode(), "parameters": {"function_to_apply": "relu"}}, "application/json",
     400, "function_to_apply = 'relu'"),
    ({"inputs": base64.b64encode(png()).decode(), "parameters": {"topk": 2}}, "application/json", 400,
     "unknown parameter(s) ['topk']"),
    (png(200, 100), "image/png", 413, "200x100 = 20000 pixels, over the limit of 15000 (model.image.max_pixels)"),
    (png_claiming(40000, 40000), "image/png", 413, "decompression bomb"),
    (b"\x89PNG" + b"0" * 300_000, "image/png", 413, "200000 bytes"),
])
def test_bad_requests_get_a_4xx_naming_the_problem(adapter, body, ct, status, words):
    got, msg = refusal(adapter, body, ct)
    assert got == status and words in msg, msg


def test_bomb_is_refused_from_its_header_without_decoding(tmp_path):
    big = make_adapter(tmp_path, {"kind": "image-classification", "preprocess": RECIPE})      # default cap 50 M
    status, msg = refusal(big, png_claiming(10000, 8000), "image/png")                        # 80 M pixels
    assert status == 413 and "downscale it" in msg


def test_center_crop_pads_small_images_like_transformers():
    pixels = np.arange(2 * 3 * 1, dtype=np.uint8).reshape(2, 3, 1) + 1
    out = center_crop(pixels, 4, 5)
    assert out.shape == (4, 5, 1)
    np.testing.assert_array_equal(out[..., 0], [[0, 0, 0, 0, 0], [0, 1, 2, 3, 0], [0, 4, 5, 6, 0], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(center_crop(pixels, 2, 1)[..., 0], [[2], [5]])


def test_examples_are_non_square_and_deterministic(adapter):
    requests = adapter.example_requests(7, seed=3)
    assert requests == adapter.example_requests(7, seed=3)
    sizes = {Image.open(io.BytesIO(body)).size for body, ct in requests if ct == "image/png"}
    assert any(w != h for w, h in sizes)
    feeds = adapter.collate([adapter.decode(body, ct) for body, ct in requests])
    assert feeds["pixels"].shape == (7, 3, 16, 16)
