"""The clients' formats (OpenAI embeddings, TEI /embed) translated to the adapter's body and back
(handlers/client_api.py), without a server: what each client sends, what it gets, and each bad body refused
with a 400 naming the key and the fix."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from handlers import client_api
from handlers.tasks import RequestError


def _body(doc) -> bytes:
    return json.dumps(doc).encode()


def test_openai_request_becomes_the_adapters_list_body():
    one = client_api.openai_embeddings(_body({"input": "a text", "model": "m"}))
    many = client_api.openai_embeddings(_body({"input": ["a", "b"], "encoding_format": "base64", "user": "u"}))
    assert one.adapter_body == {"inputs": ["a text"]} and one.encoding == "float" and one.model == "m"
    assert many.adapter_body == {"inputs": ["a", "b"]} and many.encoding == "base64" and not many.normalize


def test_openai_answer_float_and_base64():
    rows = np.asarray([[3.0, 4.0], [1.0, 0.0]], dtype=np.float32)
    req = client_api.openai_embeddings(_body({"input": ["a", "b"], "encoding_format": "base64"}))
    answer = json.loads(json.dumps(client_api.openai_answer(req, client_api.vectors(req, _body(rows.tolist())), "m", 7),
                                   default=lambda a: a.tolist()))
    assert answer["object"] == "list" and answer["model"] == "m" and answer["usage"] == {"prompt_tokens": 7,
                                                                                        "total_tokens": 7}
    got = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in answer["data"]]
    assert np.array_equal(np.stack(got), rows) and [d["index"] for d in answer["data"]] == [0, 1]


def test_dimensions_shorten_and_renormalise():
    req = client_api.openai_embeddings(_body({"input": "a", "dimensions": 2}))
    got = client_api.vectors(req, _body([[3.0, 4.0, 12.0]]))
    assert np.allclose(got, [[0.6, 0.8]])
    with pytest.raises(RequestError, match="over this model's 3"):
        client_api.vectors(client_api.openai_embeddings(_body({"input": "a", "dimensions": 5})), _body([[1, 2, 3]]))


def test_tei_embed_normalises_by_default_and_passes_its_options():
    req = client_api.tei_embed(_body({"inputs": "a", "truncate": True, "prompt_name": "query"}))
    assert req.adapter_body == {"inputs": ["a"], "truncate": True, "prompt_name": "query"}
    assert np.allclose(client_api.vectors(req, _body([[3.0, 4.0]])), [[0.6, 0.8]])
    raw = client_api.tei_embed(_body({"inputs": ["a"], "normalize": False}))
    assert np.allclose(client_api.vectors(raw, _body([[3.0, 4.0]])), [[3.0, 4.0]])


@pytest.mark.parametrize("parse,doc,words", [
    (client_api.openai_embeddings, {"model": "m"}, "`input` is missing"),
    (client_api.openai_embeddings, {"input": [1, 2]}, "token arrays"),
    (client_api.openai_embeddings, {"input": []}, "non-empty list"),
    (client_api.openai_embeddings, {"input": "a", "encoding_format": "int8"}, '"float" or "base64"'),
    (client_api.openai_embeddings, {"input": "a", "dimensions": 0}, "positive integer"),
    (client_api.openai_embeddings, {"input": "a", "temperature": 1}, "unknown key(s) ['temperature']"),
    (client_api.tei_embed, {"input": "a"}, "unknown key(s) ['input']"),
    (client_api.tei_embed, {"inputs": "a", "normalize": "yes"}, "true or false"),
    (client_api.tei_embed, {"inputs": "a", "truncation_direction": "Left"}, 'only "Right"'),
    (client_api.tei_embed, ["a"], "JSON object"),
])
def test_bad_bodies_are_refused_naming_the_problem(parse, doc, words):
    with pytest.raises(RequestError) as e:
        parse(_body(doc))
    assert e.value.status == 400 and words in e.value.message


def test_not_json_is_a_400_and_errors_take_each_clients_shape():
    with pytest.raises(RequestError, match="not JSON"):
        client_api.tei_embed(b"{nope")
    assert client_api.openai_error(413, "too big") == {"error": {"message": "too big", "type": "invalid_request_error",
                                                                 "param": None, "code": 413}}
    assert client_api.tei_error(400, "bad") == {"error": "bad", "error_type": "Validation"}
    assert client_api.error_message(b'{"error": "why", "status": 400}') == "why"
