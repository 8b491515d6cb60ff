"""The clients' own request and answer formats, translated to and from the task adapters' (handlers/tasks/__init__.py).

Used by the Ray Serve application (handlers/ray_app.py): each route turns its client's body into the body the
model's adapter already takes, the serving handler answers it, and the route turns that answer back into the
client's shape. No model logic lives here: a vector or a score is the adapter's, computed once.

- OpenAI `POST /v1/embeddings`: `{"input": str | [str], "model", "encoding_format": "float" | "base64",
  "dimensions", "user"}` -> `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
  "model", "usage": {"prompt_tokens", "total_tokens"}}`; errors as `{"error": {"message", "type", "code"}}`.
- text-embeddings-inference (TEI) `POST /embed`: `{"inputs": str | [str], "normalize": true, "truncate",
  "truncation_direction": "Right", "prompt_name", "dimensions"}` -> `[[float, ...], ...]`; `/rerank` and
  `/predict` take TEI's bodies as the rerank and classification adapters do; errors `{"error", "error_type"}`.

Pure: standard library and numpy only, so it is tested without a server.
"""
from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from handlers.tasks import RequestError

OPENAI_KEYS = ("input", "model", "encoding_format", "dimensions", "user")
TEI_EMBED_KEYS = ("inputs", "normalize", "truncate", "truncation_direction", "prompt_name", "dimensions")
OPENAI_USAGE = ('send JSON {"input": "a text" | ["text", ...], "model": "<name>", "encoding_format": "float" | '
                '"base64"} (OpenAI embeddings API)')
TEI_USAGE = 'send JSON {"inputs": "a text" | ["text", ...], "normalize": true, "truncate": false} (TEI /embed)'


def _object(body: bytes, usage: str) -> dict:
    try:
        doc = json.loads(body.decode("utf-8")) if body else None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"the body is not JSON ({e}); {usage}") from None
    if not isinstance(doc, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(doc).__name__}; {usage}")
    return doc


def _unknown(doc: dict, allowed: tuple, usage: str) -> None:
    extra = sorted(set(doc) - set(allowed))
    if extra:
        raise RequestError(400, f"unknown key(s) {extra}; allowed: {', '.join(allowed)}. {usage}")


def _texts(value: Any, key: str, usage: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        raise RequestError(400, f"`{key}` must be a string or a non-empty list of strings; {usage}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            hint = (" (token arrays are not accepted: send the text)" if isinstance(text, (int, list)) else "")
            raise RequestError(400, f"`{key}[{i}]` must be a string, got {type(text).__name__}{hint}; {usage}")
    return texts


def _dimensions(value: Any, usage: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(400, f"`dimensions` = {value!r}: needs a positive integer; {usage}")
    return value


class EmbeddingsRequest:
    """One client embeddings request as the adapter's body plus what the answer needs."""
    __slots__ = ("texts", "adapter_body", "encoding", "dimensions", "normalize", "model")

    def __init__(self, texts, adapter_body, encoding="float", dimensions=None, normalize=False, model=None):
        self.texts, self.adapter_body = texts, adapter_body
        self.encoding, self.dimensions, self.normalize, self.model = encoding, dimensions, normalize, model


def _texts_request(body: bytes, allowed: tuple, key: str, usage: str) -> tuple[dict, list[str]]:
    """The client's JSON object (only its API's keys) and its texts under `key`."""
    doc = _object(body, usage)
    _unknown(doc, allowed, usage)
    if key not in doc:
        raise RequestError(400, f"`{key}` is missing; {usage}")
    return doc, _texts(doc[key], key, usage)


def openai_embeddings(body: bytes) -> EmbeddingsRequest:
    doc, texts = _texts_request(body, OPENAI_KEYS, "input", OPENAI_USAGE)
    encoding = doc.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise RequestError(400, f'`encoding_format` = {encoding!r}: use "float" or "base64"')
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, f"`model` must be a string, got {type(model).__name__}")
    # OpenAI's vectors are unit length, shortened ones renormalised (their `dimensions`).
    dims = _dimensions(doc.get("dimensions"), OPENAI_USAGE)
    return EmbeddingsRequest(texts, {"inputs": texts}, encoding, dims, normalize=dims is not None, model=model)


def tei_embed(body: bytes) -> EmbeddingsRequest:
    doc, texts = _texts_request(body, TEI_EMBED_KEYS, "inputs", TEI_USAGE)
    normalize = doc.get("normalize", True)
    if not isinstance(normalize, bool):
        raise RequestError(400, f"`normalize` = {normalize!r}: needs true or false")
    direction = doc.get("truncation_direction", "Right")
    if direction not in ("Right", "right"):
        raise RequestError(400, f"`truncation_direction` = {direction!r}: only \"Right\" is served (the text's end "
                                f"is cut, as sentence-transformers does)")
    adapter_body: dict = {"inputs": texts}
    for key in ("truncate", "prompt_name"):
        if doc.get(key) is not None:
            adapter_body[key] = doc[key]
    return EmbeddingsRequest(texts, adapter_body, "float", _dimensions(doc.get("dimensions"), TEI_USAGE), normalize)


def vectors(request: EmbeddingsRequest, answer: bytes) -> np.ndarray:
    """The adapter's answer to `{"inputs": [...]}` (one vector per text) as float32 rows, shortened and
    normalised as the client asked."""
    rows = np.asarray(json.loads(answer), dtype=np.float32)
    if rows.ndim != 2 or len(rows) != len(request.texts):
        raise ValueError(f"the model answered {rows.shape} for {len(request.texts)} texts")
    if request.dimensions is not None:
        if request.dimensions > rows.shape[1]:
            raise RequestError(400, f"`dimensions` = {request.dimensions} is over this model's {rows.shape[1]}; "
                                    f"send at most {rows.shape[1]}")
        rows = rows[:, :request.dimensions]
    if request.normalize:
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        rows = rows / np.where(norms > 0, norms, 1).astype(np.float32)
    return rows


def openai_answer(request: EmbeddingsRequest, rows: np.ndarray, model: str, prompt_tokens: int) -> dict:
    def encoded(row: np.ndarray):
        if request.encoding == "base64":
            return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
        return row
    return {"object": "list", "model": request.model or model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(row)} for i, row in enumerate(rows)],
            "usage": {"prompt_tokens": int(prompt_tokens), "total_tokens": int(prompt_tokens)}}


def openai_error(status: int, message: str) -> dict:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def tei_error(status: int, message: str) -> dict:
    kinds = {413: "Validation", 422: "Validation", 400: "Validation", 429: "Overloaded", 503: "Unhealthy"}
    return {"error": message, "error_type": kinds.get(status, "Backend")}


def error_message(answer: bytes) -> str:
    """The message of the serving handler's error body (`{"error": ..., "status": ...}`)."""
    try:
        doc = json.loads(answer)
    except (ValueError, UnicodeDecodeError):
        return answer.decode("utf-8", "replace")
    return doc.get("error", str(doc)) if isinstance(doc, dict) else str(doc)
