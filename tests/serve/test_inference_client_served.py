"""`huggingface_hub.InferenceClient(base_url=f"http://127.0.0.1:{port}/predictions/{model}")` against a REAL
TorchServe 0.12, its methods called unchanged: feature_extraction, text_classification,
token_classification and image_classification, each on a tiny model built by the pipeline's own steps
(golden set, eager variant verified, .mar with the torch handler) from weights no other test uses, all
four served by ONE TorchServe (started once, always stopped). Each answer equals the reference:
sentence-transformers' vectors (cosine >= 0.999, `prompt_name` and truncation included),
transformers' pipelines (labels and entity spans equal, scores within 0.01). A refused option comes
back as the client's HTTP error naming it, and today's bodies still get today's shapes."""
from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.torchserve,
              pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")]

hub = pytest.importorskip("huggingface_hub")
transformers = pytest.importorskip("transformers")

SERVED = {"batch_size": 4, "max_batch_delay_ms": 20, "workers": 1, "threads_per_worker": 1,
          "response_timeout_s": 30, "startup_timeout_s": 60, "job_queue_size": 200,
          "max_request_size": 2000000, "max_response_size": 2000000, "max_request_bytes": 2000000, "device": "cpu"}
NAMES = {"text-embedding": "hf-embed", "text-classification": "hf-cls", "token-classification": "hf-ner",
         "image-classification": "hf-img"}


def _params(task: str, folder: Path, text: dict | None):
    from pipeline.core.params import parse_params
    model = {"name": NAMES[task], "source": "hf", "checkpoint": str(folder), "task": task}
    if text:
        model["text"] = text
    return parse_params({"model": model, "variants": ["eager"], "benchmark": {"batch_sizes": [1, 4]},
                         "conversion": {"golden_batches": 2}})


def _wait_ready(ts, name: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if any(w.get("status") == "READY" for w in ts.api.describe_model(name).get("workers", [])):
                return
        except Exception:                      # not registered yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"{name} not READY after {timeout_s} s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The four tiny models, each archived by the pipeline's steps, in one TorchServe for the module."""
    from scripts.make_decoder_model import build as build_embedder
    from scripts.make_text_task_model import build as build_text
    from pipeline.serve.server.torchserve import TorchServe
    from pipeline.serve.variant_server import serve_variant
    from tests.serve.test_image_served import tiny_vit

    root = tmp_path_factory.mktemp("hf_client_served")
    folders = {"text-embedding": build_embedder(root / "embed_model", seed=23),
               "text-classification": build_text(root / "cls_model", "text-classification", arch="bert", seed=23),
               "token-classification": build_text(root / "ner_model", "token-classification", arch="bert", seed=23),
               "image-classification": tiny_vit(root / "img_model")}
    texts = {"text-embedding": {"max_length": 48, "max_texts": 8},
             "text-classification": {"max_length": 64}, "token-classification": {"max_length": 64}}
    store = root / "store"
    store.mkdir()
    config = None
    for task, folder in folders.items():
        served = serve_variant(_params(task, folder, texts.get(task)), root / task, settings=SERVED)
        shutil.copy(served.mar, store / f"{NAMES[task]}.mar")
        config = config or served.ts.config
    first = NAMES["text-embedding"]
    ts = TorchServe(config, store, first, workdir=root / "server",
                    models=",".join(f"{n}={n}.mar" for n in NAMES.values()))
    with ts:
        for name in NAMES.values():
            _wait_ready(ts, name)
        yield ts, folders


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """The tests run with HF_HUB_OFFLINE=1 (tests/conftest.py), which makes the client refuse every URL:
    lifted for these tests, whose only URLs are this server's on 127.0.0.1."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def client(ts, task: str):
    return hub.InferenceClient(base_url=f"http://127.0.0.1:{ts.api.inference_port}/predictions/{NAMES[task]}",
                               api_key=ts.api.inference_key(), timeout=60)


def test_feature_extraction_equals_sentence_transformers(server):
    from tests.model.test_decoder_embedding import TEXTS, sentence_transformer
    ts, folders = server
    st = sentence_transformer(folders["text-embedding"])
    c = client(ts, "text-embedding")
    texts = TEXTS[:4]
    want = st.encode(texts, batch_size=1)
    want_query = st.encode(texts[:2], batch_size=1, prompt_name="query")
    one = c.feature_extraction(texts[0])
    assert one.shape == (1, want.shape[1]) and one.dtype == np.float32
    assert float(one[0] @ want[0]) >= 0.999
    many = c.feature_extraction(texts)
    assert many.shape == want.shape and all(float(g @ w) >= 0.999 for g, w in zip(many, want))
    query = c.feature_extraction(texts[:2], prompt_name="query", normalize=True, truncate=False,
                                 truncation_direction="right")
    assert all(float(g @ w) >= 0.999 for g, w in zip(query, want_query))
    st.max_seq_length = 48
    long = " ".join(["the river runs past the old city"] * 20)
    cut = c.feature_extraction(long, truncate=True)
    assert float(cut[0] @ st.encode([long], batch_size=1)[0]) >= 0.999
    with pytest.raises(hub.errors.HfHubHTTPError) as info:
        c.feature_extraction(texts[0], dimensions=3)
    assert info.value.response.status_code == 400 and "drop `dimensions`" in info.value.response.json()["error"]
    with pytest.raises(hub.errors.HfHubHTTPError) as info:
        c.feature_extraction(long)
    assert info.value.response.status_code == 413 and '"truncate": true' in info.value.response.json()["error"]
    # today's bodies, today's shape
    r = ts.api.predict(json.dumps({"text": texts[0]}).encode(), "application/json", model=NAMES["text-embedding"])
    assert r.status == 200 and float(np.asarray(r.json()["embedding"]) @ want[0]) >= 0.999
    r = ts.api.predict(texts[1].encode(), "text/plain", model=NAMES["text-embedding"])
    assert r.status == 200 and float(np.asarray(r.json()["embedding"]) @ want[1]) >= 0.999


def test_text_classification_equals_transformers(server):
    from tests.handlers.text_task_models import CLASSIFY_TEXTS, pipeline_of
    ts, folders = server
    pipe = pipeline_of("text-classification", folders["text-classification"])
    c = client(ts, "text-classification")
    for text in CLASSIFY_TEXTS:
        for kw in ({}, {"top_k": 3}, {"top_k": 2, "function_to_apply": "sigmoid"}):
            got, want = c.text_classification(text, **kw), pipe(text, **kw)
            assert [e.label for e in got] == [w["label"] for w in want], (got, want)
            assert max(abs(e.score - w["score"]) for e, w in zip(got, want)) < 0.01
    r = ts.api.predict(CLASSIFY_TEXTS[0].encode(), "text/plain", model=NAMES["text-classification"])
    assert r.status == 200 and [a["label"] for a in r.json()] == [w["label"] for w in pipe(CLASSIFY_TEXTS[0])]


def test_token_classification_equals_transformers(server):
    from tests.handlers.text_task_models import NER_TEXTS, pipeline_of
    ts, folders = server
    pipe = pipeline_of("token-classification", folders["token-classification"])
    c = client(ts, "token-classification")
    for text in NER_TEXTS:
        for strategy in (None, "first", "average", "max"):
            kw = {"aggregation_strategy": strategy} if strategy else {}
            got, want = c.token_classification(text, **kw), pipe(text, aggregation_strategy=strategy or "simple")
            assert [(e.entity_group, e.word, e.start, e.end) for e in got] == \
                   [(w["entity_group"], w["word"], w["start"], w["end"]) for w in want]
            assert all(abs(e.score - w["score"]) < 0.01 for e, w in zip(got, want))
    with pytest.raises(hub.errors.HfHubHTTPError) as info:
        c.token_classification(NER_TEXTS[0], stride=-2)
    assert info.value.response.status_code == 400 and "stride" in info.value.response.json()["error"]


def test_image_classification_equals_transformers(server):
    from PIL import Image
    from tests.serve.test_image_served import images
    ts, folders = server
    folder = folders["image-classification"]
    processor = transformers.AutoImageProcessor.from_pretrained(str(folder))
    pipe = transformers.pipeline("image-classification", model=str(folder), device="cpu", image_processor=processor)
    c = client(ts, "image-classification")
    for k, (body, _) in enumerate(images()[:4]):
        picture = Image.open(io.BytesIO(body))
        kw = [{}, {"top_k": 2}, {"function_to_apply": "softmax"}, {"top_k": 6, "function_to_apply": "none"}][k]
        got, want = c.image_classification(body, **kw), pipe(picture, **kw)
        assert [e.label for e in got] == [w["label"] for w in want], (kw, got, want)
        assert max(abs(e.score - w["score"]) for e, w in zip(got, want)) < 0.01
