"""The bodies `huggingface_hub.InferenceClient(base_url=...)` POSTs, answered by the task adapters in-process.
Nothing is patched: each body is built by the client's own request code, the steps its methods
(feature_extraction, text_classification, token_classification, image_classification) take before the POST
(`get_provider_helper(...).prepare_request(...)` with the method's parameters, then the `httpx` request its
session builds from it); the adapter + the eager model answer it as the serving handler does; and the answer
bytes go through the parser the method applies to the response. The answers equal the eager model's (and
transformers' pipelines); today's bodies keep today's shapes; every option InferenceClient sends is accepted
or refused with a 400 naming it; and in the serving handler, a bad Hugging Face body fails only itself.
The client over real HTTP is tests/serve/test_inference_client_served.py."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from handlers.tasks import RequestError, make_adapter
from pipeline.core.params import parse_params
from pipeline.model.checkpoint import load_model
from tests.handlers.text_task_models import CLASSIFY_TEXTS, NER_TEXTS, pipeline_of, same_answers

hub = pytest.importorskip("huggingface_hub")
from huggingface_hub.inference._providers import get_provider_helper  # noqa: E402
from huggingface_hub.utils import get_session  # noqa: E402

URL = "http://127.0.0.1:1/predictions/m"


def client_request(task, inputs, parameters):
    """(provider helper, body bytes, content type) of the POST `InferenceClient(base_url=URL)` makes for `task`:
    the method's own `get_provider_helper(self.provider, task=..., model=self.model).prepare_request(...)`
    (huggingface_hub/inference/_client.py), then the `httpx.Request` that `_inner_post`'s
    `get_session().stream("POST", url, json=..., content=..., headers=...)` builds and sends; building it
    reads and writes nothing."""
    client = hub.InferenceClient(base_url=URL)
    helper = get_provider_helper(client.provider, task=task, model=client.model)
    params = helper.prepare_request(inputs=inputs, parameters=parameters, headers=client.headers,
                                    model=client.model, api_key=client.token)
    request = get_session().build_request("POST", params.url, json=params.json, content=params.data,
                                          headers=params.headers, cookies=client.cookies)
    assert str(request.url) == URL
    return helper, request.read(), request.headers.get("content-type")


class Answered:
    """InferenceClient's methods, their bodies built and their answers parsed by huggingface_hub's own code
    (each method below names the `_client.py` lines it repeats), the POST answered by `adapter` around
    `run(feeds) -> [batch-first outputs]` as the serving handler does; `sent` keeps each (body, content type)."""

    def __init__(self, adapter, run):
        self.adapter, self.run, self.sent = adapter, run, []

    def post(self, task, inputs, parameters):
        helper, body, ct = client_request(task, inputs, parameters)
        self.sent.append((body, ct))
        decoded = self.adapter.decode_request(body, ct)
        outs = self.run(self.adapter.collate(decoded.rows))
        response = self.adapter.respond_request_bytes([[o[j] for o in outs] for j in range(len(decoded.rows))],
                                                      decoded)
        assert isinstance(response, bytes)                 # what `_inner_post` hands the parser
        return helper, response

    def feature_extraction(self, text, *, normalize=None, prompt_name=None, truncate=None,
                           truncation_direction=None, dimensions=None, encoding_format=None):
        helper, response = self.post("feature-extraction", text, {
            "normalize": normalize, "prompt_name": prompt_name, "truncate": truncate,
            "truncation_direction": truncation_direction, "dimensions": dimensions,
            "encoding_format": encoding_format})
        return np.array(helper.get_response(response), dtype="float32")   # InferenceClient.feature_extraction

    def text_classification(self, text, *, function_to_apply=None, top_k=None):
        _, response = self.post("text-classification", text, {"function_to_apply": function_to_apply,
                                                              "top_k": top_k})
        return hub.TextClassificationOutputElement.parse_obj_as_list(response)[0]  # InferenceClient.text_classification

    def token_classification(self, text, *, aggregation_strategy=None, ignore_labels=None, stride=None):
        _, response = self.post("token-classification", text, {"aggregation_strategy": aggregation_strategy,
                                                               "ignore_labels": ignore_labels, "stride": stride})
        return hub.TokenClassificationOutputElement.parse_obj_as_list(response)  # InferenceClient.token_classification

    def image_classification(self, image, *, function_to_apply=None, top_k=None):
        _, response = self.post("image-classification", image, {"function_to_apply": function_to_apply,
                                                                "top_k": top_k})
        return hub.ImageClassificationOutputElement.parse_obj_as_list(response)  # InferenceClient.image_classification


def eager(lm):
    def run(feeds):
        with torch.no_grad():
            out = lm.module(*lm.example_inputs(feeds))
        return [t.numpy() for t in (out if isinstance(out, (tuple, list)) else (out,))]
    return run


def refused(adapter, doc) -> RequestError:
    with pytest.raises(RequestError) as info:
        adapter.decode_request(json.dumps(doc).encode(), "application/json")
    return info.value


# --------------------------------------------------------------------------- feature_extraction
@pytest.fixture(scope="module")
def embedder(tiny_text_model_dir):
    params = parse_params({"model": {"name": "tiny-text", "source": "hf", "checkpoint": str(tiny_text_model_dir),
                                     "task": "text-embedding", "text": {"max_length": 32}},
                           "variants": ["eager"], "benchmark": {"batch_sizes": [1, 4]}})
    lm = load_model(params)
    return lm, make_adapter(tiny_text_model_dir, lm.task)


def own_vector(adapter, run, doc_or_text):
    body, ct = ((doc_or_text.encode(), "text/plain") if isinstance(doc_or_text, str)
                else (json.dumps(doc_or_text).encode(), "application/json"))
    decoded = adapter.decode_request(body, ct)
    answer = json.loads(adapter.respond_request_bytes([[o[0] for o in run(adapter.collate(decoded.rows))]], decoded))
    assert set(answer) == {"embedding"}                # today's shape for today's bodies
    return np.asarray(answer["embedding"], dtype=np.float32)


def test_feature_extraction_parses_and_equals_the_eager_model(embedder):
    lm, adapter = embedder
    run = eager(lm)
    client = Answered(adapter, run)
    texts = ["hello world", "a man plays the guitar in the garden", "the old dog sleeps"]
    one = client.feature_extraction(texts[0])
    assert one.shape == (1, lm.task["dim"]) and one.dtype == np.float32
    assert json.loads(client.sent[0][0]) == {"inputs": texts[0]}
    np.testing.assert_allclose(one[0], own_vector(adapter, run, texts[0]), atol=1e-6)
    np.testing.assert_allclose(one[0], own_vector(adapter, run, {"text": texts[0]}), atol=1e-6)
    many = client.feature_extraction(texts)
    assert many.shape == (3, lm.task["dim"])
    for vector, text in zip(many, texts):
        assert float(vector @ own_vector(adapter, run, text)) >= 0.99999
    # every option the client sends, in its own names and values
    opts = client.feature_extraction(texts[1], normalize=True, truncate=True, truncation_direction="right",
                                     dimensions=lm.task["dim"])
    assert json.loads(client.sent[-1][0]) == {"inputs": texts[1], "normalize": True, "truncate": True,
                                              "truncation_direction": "right", "dimensions": lm.task["dim"]}
    np.testing.assert_allclose(opts[0], many[1], atol=1e-6)
    assert abs(float(np.linalg.norm(opts[0])) - 1.0) < 1e-5


def test_truncation_direction_cuts_the_end_the_request_names(embedder):
    _, adapter = embedder
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight"] * 6
    long = " ".join(words)
    right = adapter.decode_request(json.dumps({"inputs": long, "truncate": True}), "application/json").rows[0]
    left = adapter.decode_request(json.dumps({"inputs": long, "truncate": True, "truncation_direction": "Left"}),
                                  "application/json").rows[0]
    full = adapter.tokenizer.encode(long).ids            # [CLS] ... [SEP], over the 32 tokens
    assert len(right["input_ids"]) == len(left["input_ids"]) == 32
    assert right["input_ids"].tolist() == full[:31] + [full[-1]]         # keeps the start (and [SEP])
    assert left["input_ids"].tolist() == [full[0]] + full[-31:]          # keeps the end (and [CLS])
    err = refused(adapter, {"inputs": long})
    assert err.status == 413 and '"truncate": true' in err.message


def test_base64_and_prompts_in_the_hugging_face_shape(embedder, tiny_text_model_dir):
    lm, adapter = embedder
    run = eager(lm)
    texts = ["hello world", "the old dog sleeps"]
    doc = {"inputs": texts, "encoding_format": "base64"}
    decoded = adapter.decode_request(json.dumps(doc), "application/json")
    outs = run(adapter.collate(decoded.rows))
    answer = json.loads(adapter.respond_request_bytes([[o[j] for o in outs] for j in range(2)], decoded))
    assert adapter.respond_request([[o[j] for o in outs] for j in range(2)], decoded.meta) == answer
    for b64, text in zip(answer, texts):
        vector = np.frombuffer(base64.b64decode(b64), dtype="<f4")
        np.testing.assert_allclose(vector, own_vector(adapter, run, text), atol=1e-6)
    single = adapter.decode_request(json.dumps({"text": texts[0], "encoding_format": "base64"}), "application/json")
    compact = json.loads(adapter.respond_request_bytes([[o[0] for o in run(adapter.collate(single.rows))]], single))
    assert compact["encoding_format"] == "base64" and isinstance(compact["embedding"], str)
    prompted = make_adapter(tiny_text_model_dir, {**lm.task, "prompts": {"query": "query: "}})
    a = prompted.decode_request(json.dumps({"inputs": "hello world", "prompt_name": "query"}), "application/json")
    b = prompted.decode_request(json.dumps({"text": "hello world", "prompt_name": "query"}), "application/json")
    assert a.rows[0]["input_ids"].tolist() == b.rows[0]["input_ids"].tolist() \
        == prompted.tokenizer.encode("query: hello world").ids


@pytest.mark.parametrize("doc, words", [
    ({"inputs": "a", "normalize": False}, "end with Normalize"),
    ({"inputs": "a", "normalize": "yes"}, "`normalize` must be true or false"),
    ({"inputs": "a", "truncation_direction": "up"}, '`truncation_direction` is \'up\': use "right"'),
    ({"inputs": "a", "dimensions": 8}, "answers 32-dimensional vectors and never shortens them; drop `dimensions` "
                                       "or send 32"),
    ({"inputs": "a", "prompt_name": "query"}, "it has none"),
    ({"inputs": "a", "encoding_format": "int8"}, '"encoding_format" is \'int8\''),
    ({"inputs": "a", "text": "b"}, "both `text` and `inputs`"),
    ({"inputs": []}, "empty list"),
    ({"inputs": 5}, "inputs must be a string"),
    ({"inputs": ["ok", 5]}, "inputs[1] must be a string"),
    ({"inputs": "a", "truncation": True}, "unknown key(s) ['truncation']"),
    ({"text": "a", "dimensions": 3}, "drop `dimensions`"),
])
def test_unsupported_options_are_a_400_naming_them(embedder, doc, words):
    err = refused(embedder[1], doc)
    assert err.status == 400 and words in err.message, err.message


def test_normalize_true_on_a_model_without_normalize(tiny_text_model_dir, embedder):
    lm, _ = embedder
    raw = make_adapter(tiny_text_model_dir, {**lm.task, "normalize": False})
    decoded = raw.decode_request(json.dumps({"inputs": ["a", "b"], "normalize": True}), "application/json")
    outs = [[np.array([3.0, 4.0], np.float32)], [np.array([0.0, 2.0], np.float32)]]
    np.testing.assert_allclose(raw.respond_request(outs, decoded.meta), [[0.6, 0.8], [0.0, 1.0]], atol=1e-7)
    plain = raw.decode_request(json.dumps({"inputs": ["a"], "normalize": False}), "application/json")
    assert raw.respond_request(outs[:1], plain.meta) == [[3.0, 4.0]]


def test_hugging_face_bodies_fail_alone_in_a_served_batch(tmp_path):
    from handlers.torch_handler import TorchHandler
    from tests.handlers.test_handlers import WORDS, load, make_context, make_variant, serve_batch
    folder, _ = make_variant(tmp_path, "text-embedding", "eager")
    h = load(TorchHandler, folder)
    text = " ".join(WORDS[:4])
    requests = [(json.dumps({"inputs": text}).encode(), "application/json"),
                (json.dumps({"inputs": text, "normalize": False}).encode(), "application/json"),
                (json.dumps({"inputs": [text, " ".join(WORDS[2:5])], "normalize": True}).encode(), "application/json"),
                (json.dumps({"inputs": text, "truncation_direction": "middle"}).encode(), "application/json"),
                (json.dumps({"text": text}).encode(), "application/json"),
                (json.dumps({"inputs": text, "dimensions": 1}).encode(), "application/json")]
    answers = serve_batch(h, make_context(folder, {"threads": 1}), requests)
    assert [s for s, _ in answers] == [200, 400, 200, 400, 200, 400], answers
    one, many, own = answers[0][1], answers[2][1], answers[4][1]
    assert len(one) == 1 and len(many) == 2 and set(own) == {"embedding"}
    np.testing.assert_allclose(one[0], own["embedding"], atol=1e-6)
    np.testing.assert_allclose(many[0], own["embedding"], atol=1e-6)
    h.close()


# --------------------------------------------------------------------------- text / token classification
@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    from scripts.make_text_task_model import build
    root = tmp_path_factory.mktemp("hf_client_heads")
    out = {}
    for task in ("text-classification", "token-classification"):
        folder = build(root / task, task, arch="bert", seed=21)
        params = parse_params({"model": {"name": "t", "source": "hf", "checkpoint": str(folder), "task": task,
                                         "text": {"max_length": 64, "max_texts": 12}},
                               "variants": ["eager"], "benchmark": {"batch_sizes": [1, 4]}})
        lm = load_model(params)
        out[task] = (folder, lm, make_adapter(folder, lm.task))
    return out


def test_text_classification_parses_as_a_list_of_labels(heads):
    folder, lm, adapter = heads["text-classification"]
    pipe = pipeline_of("text-classification", folder)
    client = Answered(adapter, eager(lm))
    for text in CLASSIFY_TEXTS:
        for kw in ({}, {"top_k": 2}, {"top_k": 3, "function_to_apply": "sigmoid"}, {"function_to_apply": "none"}):
            got = client.text_classification(text, **kw)
            assert isinstance(got, list) and all(isinstance(e, hub.TextClassificationOutputElement) for e in got)
            want = pipe(text, **kw)
            assert [e.label for e in got] == [w["label"] for w in want]
            assert max(abs(e.score - w["score"]) for e, w in zip(got, want)) < 0.01
    assert json.loads(client.sent[1][0]) == {"inputs": CLASSIFY_TEXTS[0], "parameters": {"top_k": 2}}
    # today's bodies keep today's flat answer: text/plain, a pair, the text as {"text": ...}
    for body, ct in ((CLASSIFY_TEXTS[0].encode(), "text/plain"),
                     (json.dumps({"inputs": {"text": CLASSIFY_TEXTS[0]}, "parameters": {"top_k": 2}}), "application/json"),
                     (json.dumps(CLASSIFY_TEXTS[0]), "application/json")):
        assert adapter.decode_request(body, ct).meta["single"] is True


def test_token_classification_parses_as_entities(heads):
    folder, lm, adapter = heads["token-classification"]
    pipe = pipeline_of("token-classification", folder)
    client = Answered(adapter, eager(lm))
    for text in NER_TEXTS:
        for strategy in ("simple", "first", "average", "max"):
            got = client.token_classification(text, aggregation_strategy=strategy, stride=4)
            want = pipe(text, aggregation_strategy=strategy)
            assert all(isinstance(e, hub.TokenClassificationOutputElement) for e in got)
            assert [(e.entity_group, e.word, e.start, e.end) for e in got] == \
                   [(w["entity_group"], w["word"], w["start"], w["end"]) for w in want]
            assert all(abs(e.score - w["score"]) < 0.01 for e, w in zip(got, want))
        default = client.token_classification(text, ignore_labels=[])
        want = pipe(text, aggregation_strategy="simple", ignore_labels=[])
        assert same_answers([{k: e[k] for k in w} for e, w in zip(default, want)], want) == []
        assert len(default) == len(want)
    assert json.loads(client.sent[0][0]) == {"inputs": NER_TEXTS[0],
                                             "parameters": {"aggregation_strategy": "simple", "stride": 4}}
    for params, words in (({"stride": -1}, "stride = -1"), ({"stride": 2, "aggregation_strategy": "none"},
                                                            'other than "none"')):
        err = refused(adapter, {"inputs": "a text", "parameters": params})
        assert err.status == 400 and words in err.message


# --------------------------------------------------------------------------- image_classification
def test_image_classification_parses_raw_and_base64_bodies(tmp_path):
    (tmp_path / "labels.json").write_text(json.dumps(["zero", "one", "two", "three"]))
    adapter = make_adapter(tmp_path, {"kind": "image-classification", "size": 8, "mean": 127.0, "std": 128.0,
                                      "top_k": 3, "labels": "labels.json", "max_request_bytes": 100_000})
    weights = np.random.default_rng(0).standard_normal((8 * 8 * 3, 4)).astype(np.float32)

    def run(feeds):
        return [feeds["pixels"].reshape(len(feeds["pixels"]), -1) @ weights]

    client = Answered(adapter, run)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (12, 20, 3), dtype=np.uint8)).save(buf, format="PNG")
    image = buf.getvalue()
    logits = run({"pixels": adapter.decode(image, "image/png")["pixels"][None]})[0][0]
    got = client.image_classification(image)                              # raw bytes, no parameters
    assert client.sent[-1][0] == image
    assert [(e.label, round(e.score, 5)) for e in got] == \
           [(a["label"], round(a["score"], 5)) for a in adapter.answer(logits, 3, None)]
    got = client.image_classification(image, top_k=2, function_to_apply="sigmoid")   # JSON base64
    assert json.loads(client.sent[-1][0])["parameters"] == {"function_to_apply": "sigmoid", "top_k": 2}
    assert [(e.label, round(e.score, 5)) for e in got] == \
           [(a["label"], round(a["score"], 5)) for a in adapter.answer(logits, 2, "sigmoid")]
