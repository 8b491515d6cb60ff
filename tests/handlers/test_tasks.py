"""Task adapters (handlers/tasks/__init__.py): decoding and its errors, collate, respond, examples."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from handlers.tasks import RequestError, make_adapter

REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def png_bytes(color=(127, 255, 0), size=(20, 10), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color if mode == "RGB" else color[0]).save(buf, format="PNG")
    return buf.getvalue()


def status_of(adapter, body, content_type) -> tuple[int, str]:
    with pytest.raises(RequestError) as info:
        adapter.decode(body, content_type)
    return info.value.status, str(info.value)


@pytest.fixture
def text_adapter(tiny_text_model_dir):
    return make_adapter(tiny_text_model_dir, {"kind": "text-embedding", "max_length": 32,
                                              "tokenizer": "tokenizer.json", "max_request_bytes": 2000})


@pytest.fixture
def image_adapter(tmp_path):
    (tmp_path / "labels.json").write_text(json.dumps(["zero", "one", "two", "three"]))
    return make_adapter(tmp_path, {"kind": "image-classification", "size": 8, "mean": 127.0, "std": 128.0,
                                   "top_k": 3, "labels": "labels.json", "max_request_bytes": 100_000})


@pytest.fixture
def tensor_adapter(tmp_path):
    return make_adapter(tmp_path, {"kind": "tensor", "input_shape": [2, 3]})


# --------------------------------------------------------------------------- text
def test_text_decode_accepts_every_body_form(text_adapter):
    expected = text_adapter.decode(b"hello world", "text/plain")
    assert expected["input_ids"].dtype == np.int64 and expected["attention_mask"].dtype == np.int64
    assert len(expected["input_ids"]) == 4                      # [CLS] hello world [SEP], no fixed padding
    for body, ct in [("hello world", "text/plain; charset=utf-8"), (bytearray(b"hello world"), None),
                     (b'{"text": "hello world"}', "application/json"), ({"text": "hello world"}, "application/json"),
                     ('{"inputs": "hello world"}', "application/json"), ("hello world", None)]:
        got = text_adapter.decode(body, ct)
        np.testing.assert_array_equal(got["input_ids"], expected["input_ids"])


def test_text_over_the_length_is_413_unless_the_request_truncates(text_adapter):
    """TEI's semantics: never a silently different answer; `"truncate": true` cuts as sentence-transformers does."""
    long = " ".join(["guitar"] * 100)
    status, msg = status_of(text_adapter, long, "text/plain")
    assert status == 413 and "limit of 32" in msg and '"truncate": true' in msg
    sample = text_adapter.decode(json.dumps({"text": long, "truncate": True}), "application/json")
    assert len(sample["input_ids"]) == 32
    status, msg = status_of(text_adapter, json.dumps({"text": "a", "truncate": "yes"}), "application/json")
    assert status == 400 and "`truncate` must be true or false" in msg


@pytest.mark.parametrize("body, ct, status, words", [
    (b"", "text/plain", 400, "empty"),
    (b"   \n", "text/plain", 400, "empty"),
    (b'{"text": ', "application/json", 400, "not valid JSON"),
    (b'{"txt": "hello"}', "application/json", 400, '"text"'),
    (b'{"text": ""}', "application/json", 400, "empty"),
    (b"\xff\xfe\x00", "text/plain", 400, "UTF-8"),
    (png_bytes(), "image/png", 415, "text/plain"),
    (b"hello " * 400, "text/plain", 413, "2000 bytes"),
])
def test_text_decode_errors(text_adapter, body, ct, status, words):
    got_status, msg = status_of(text_adapter, body, ct)
    assert got_status == status and words in msg


def test_text_collate_pads_to_longest_in_batch(text_adapter):
    samples = [text_adapter.decode(t, "text/plain") for t in ("hello", "a man is playing a guitar today")]
    feeds = text_adapter.collate(samples)
    longest = len(samples[1]["input_ids"])
    assert feeds["input_ids"].shape == (2, longest) and longest < 48          # not the tokenizer's 48
    assert feeds["attention_mask"].tolist()[0] == [1, 1, 1] + [0] * (longest - 3)
    assert (feeds["input_ids"][0, 3:] == text_adapter.pad_id).all()
    np.testing.assert_array_equal(feeds["input_ids"][1], samples[1]["input_ids"])


def test_text_respond_and_examples(text_adapter, tiny_text_model_dir):
    out = [np.arange(6, dtype=np.float32).reshape(2, 3)]
    assert text_adapter.respond(out, 1) == {"embedding": [3.0, 4.0, 5.0]}

    feeds = text_adapter.example_feeds(3, seq_len=10)
    assert feeds["input_ids"].shape == (3, 10) and feeds["attention_mask"].all()
    np.testing.assert_array_equal(feeds["input_ids"], text_adapter.example_feeds(3, seq_len=10)["input_ids"])

    requests = text_adapter.example_requests(12, seed=5)
    assert requests == text_adapter.example_requests(12, seed=5)
    assert requests != text_adapter.example_requests(12, seed=6)
    assert {ct for _, ct in requests} == {"text/plain", "application/json"}
    lengths = {len(text_adapter.decode(body, ct)["input_ids"]) for body, ct in requests}
    assert len(lengths) >= 4                                   # varied lengths -> padding in batches
    unknown = make_adapter(tiny_text_model_dir, {"kind": "text-embedding"}).tokenizer.token_to_id("[UNK]")
    ids = np.concatenate([text_adapter.decode(b, ct)["input_ids"] for b, ct in requests])
    assert unknown not in ids


# --------------------------------------------------------------------------- image
# More of the image task (the recipe against transformers, JSON bodies, bombs): tests/handlers/test_task_image.py
def test_image_decode_preprocesses(image_adapter):
    sample = image_adapter.decode(png_bytes((127, 255, 0)), "image/png")
    pixels = sample["pixels"]
    assert pixels.shape == (3, 8, 8) and pixels.dtype == np.float32
    np.testing.assert_allclose(pixels[:, 0, 0], [0.0, 128 / 128, -127 / 128])   # (x - 127) / 128, CHW

    gray = image_adapter.decode(png_bytes((200,), mode="L"), "application/octet-stream")["pixels"]
    assert gray.shape == (3, 8, 8) and np.allclose(gray[0], gray[2])
    buf = io.BytesIO()
    Image.new("RGB", (30, 30), (10, 20, 30)).save(buf, format="JPEG")
    assert image_adapter.decode(bytearray(buf.getvalue()), "image/jpeg")["pixels"].shape == (3, 8, 8)


@pytest.mark.parametrize("body, ct, status, words", [
    (b"not an image at all", "image/png", 400, "not a decodable image"),
    (png_bytes()[:40], "image/png", 400, "image"),
    (b'{"pixels": []}', "application/json", 400, "unknown key(s) ['pixels']"),
    ({"inputs": []}, "application/json", 400, "base64-encoded (a string)"),
    ("some text", "text/plain", 415, "not an image"),
    (b"\x89PNG" + b"0" * 200_000, "image/png", 413, "100000 bytes"),
])
def test_image_decode_errors(image_adapter, body, ct, status, words):
    got_status, msg = status_of(image_adapter, body, ct)
    assert got_status == status and words in msg, msg


def test_image_respond_labels_and_scores_best_first(image_adapter):
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    resp = image_adapter.respond([logits], 0)
    assert [t["label"] for t in resp] == ["one", "three", "two"] and set(resp[0]) == {"label", "score"}
    probs = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert resp[0]["score"] == pytest.approx(float(probs[1]))
    assert json.loads(json.dumps(resp)) == resp

    no_labels = make_adapter(".", {"kind": "image-classification", "size": 8, "top_k": 10})
    assert [t["label"] for t in no_labels.respond([logits], 1)][:1] == ["LABEL_0"]
    assert len(no_labels.respond([logits], 1)) == 4


def test_image_examples(image_adapter):
    requests = image_adapter.example_requests(6, seed=1)
    assert requests == image_adapter.example_requests(6, seed=1)
    assert {ct for _, ct in requests} == {"image/png", "application/json"}
    assert all(body[:4] == b"\x89PNG" for body, ct in requests if ct == "image/png")
    feeds = image_adapter.collate([image_adapter.decode(b, ct) for b, ct in requests])
    assert feeds["pixels"].shape == (6, 3, 8, 8)
    assert image_adapter.example_feeds(2)["pixels"].shape == (2, 3, 8, 8)


# --------------------------------------------------------------------------- tensor
def test_tensor_decode_forms(tensor_adapter):
    data = [[1, 2, 3], [4, 5, 6.5]]
    expected = np.array(data, dtype=np.float32)
    for body, ct in [(json.dumps(data).encode(), "application/json"), (data, "application/json"),
                     ({"input": data}, "application/json"), (json.dumps(data), None)]:
        got = tensor_adapter.decode(body, ct)["input"]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected)
    buf = io.BytesIO()
    np.save(buf, expected)
    np.testing.assert_array_equal(tensor_adapter.decode(buf.getvalue(), "application/x-npy")["input"], expected)


@pytest.mark.parametrize("body, ct, status, words", [
    (b"[[1, 2, 3]]", "application/json", 400, "expected [2, 3]"),
    (b"[[1, 2, 3], [4, 5]]", "application/json", 400, "ragged"),
    (b'[["a", "b", "c"], ["d", "e", "f"]]', "application/json", 400, "numbers"),
    (b"[[1, 2, NaN], [4, 5, 6]]", "application/json", 400, "NaN"),
    (b'{"x": [[1, 2, 3], [4, 5, 6]]}', "application/json", 400, "`input`"),
    (b"[[1, 2, 3], [4, 5, 6]", "application/json", 400, "not valid JSON"),
    (b"1,2,3", "text/csv", 415, "application/json"),
    (b"\x93NUMPY garbage", "application/x-npy", 400, ".npy"),
])
def test_tensor_decode_errors(tensor_adapter, body, ct, status, words):
    got_status, msg = status_of(tensor_adapter, body, ct)
    assert got_status == status and words in msg
    assert "2×3" in msg or status != 415 or "application/json" in msg


def test_tensor_collate_respond_examples(tensor_adapter):
    samples = [tensor_adapter.decode(b, ct) for b, ct in tensor_adapter.example_requests(3, seed=0)]
    feeds = tensor_adapter.collate(samples)
    assert feeds["input"].shape == (3, 2, 3) and feeds["input"].dtype == np.float32
    one = [np.arange(6, dtype=np.float32).reshape(3, 2)]
    assert tensor_adapter.respond(one, 2) == [4.0, 5.0]
    two = one + [np.ones((3, 1), np.float32)]
    assert tensor_adapter.respond(two, 0) == {"outputs": [[0.0, 1.0], [1.0]]}
    assert tensor_adapter.example_feeds(4)["input"].shape == (4, 2, 3)
    np.testing.assert_array_equal(tensor_adapter.example_feeds(4)["input"], tensor_adapter.example_feeds(4)["input"])


def test_request_error_response_and_unknown_task():
    err = RequestError(413, "too big")
    assert err.status == 413 and err.as_response() == {"error": "too big", "status": 413}
    with pytest.raises(ValueError, match="unknown task kind 'audio'"):
        make_adapter(".", {"kind": "audio"})


def test_tasks_module_imports_neither_torch_nor_pipeline():
    code = ("import sys, handlers.tasks; bad = [m for m in sys.modules if m == 'torch' or m.startswith('pipeline')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
