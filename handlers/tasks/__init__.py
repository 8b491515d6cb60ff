"""Task adapters: HTTP body <-> model feeds/outputs, one class per task.

Runs inside TorchServe as well as in the pipeline, so it imports only numpy, tokenizers, PIL and
the standard library (never torch, never `pipeline/`). Built as `make_adapter(model_dir, task)`
where `task` is variant.json's "task" mapping (kind + settings, optionally `max_request_bytes`).

- `decode_request(body, content_type) -> Decoded(rows, meta)`: ONE request becomes one or MANY model
  rows (a rerank query with 50 texts is 50 rows; a list of texts to embed, one row each); the
  serving handler fans the rows of all requests out over model calls and gathers them back.
  Bad input raises `RequestError` (400 bad content, 413 too large / too many texts, 415 wrong type).
- `respond_request(row_outputs, meta) -> JSON-able`: the request's answer from its rows' outputs
  (`row_outputs[j]` = the model outputs of row j, batch dimension removed).
- `decode(body, content_type) -> {input: array}` one sample, no batch dim (one-row requests).
- `collate(samples) -> feeds` batch-first (text: padded to the batch's longest).
- `respond(outputs, i) -> JSON-able` response of sample i (one-row requests).

The tasks with their own module (image-classification, tensor, text-classification, rerank,
token-classification) are imported on first use by `make_adapter`, so this package keeps the registry
and the shared parsing.
- `example_feeds(batch_size, seq_len=None)` deterministic synthetic feeds (warm-up, benchmarks).
- `example_requests(n, seed)` deterministic valid (body bytes, content type) pairs.

TorchServe hands a JSON body already decoded (dict/list) when Content-Type is application/json,
text/* as str, anything else as bytes/bytearray: all are accepted.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from handlers.encode import json_bytes

JSON_TYPES = ("application/json",)


class RequestError(Exception):
    """A client mistake: `.status` is the HTTP code, the message says what is wrong and how to fix it."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = int(status)
        self.message = message

    def as_response(self) -> dict:
        return {"error": self.message, "status": self.status}


def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def _body_size(body: Any) -> int | None:
    if isinstance(body, (bytes, bytearray, memoryview)):
        return len(body)
    if isinstance(body, str):
        return len(body.encode("utf-8", "surrogatepass"))
    return None   # already decoded by the server: its size was checked there (max_request_size)


def _parse_json(body: Any) -> Any:
    """JSON from bytes/str, or the already-decoded object TorchServe hands over."""
    if isinstance(body, (dict, list)):
        return body
    if isinstance(body, (bytes, bytearray, memoryview)):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(400, "request body is not UTF-8 text; send JSON encoded as UTF-8") from None
    if not isinstance(body, str):
        raise RequestError(400, f"request body of type {type(body).__name__} cannot be read as JSON")
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                                f"send a well-formed JSON document") from None


def _text_of(body: Any) -> str:
    if isinstance(body, (bytes, bytearray, memoryview)):
        try:
            return bytes(body).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(400, "request body is not UTF-8 text; encode the text as UTF-8") from None
    if isinstance(body, str):
        return body
    raise RequestError(400, f"request body of type {type(body).__name__} is not text")


def _json_or_text(body: Any, media: str, usage: str) -> Any:
    """A text body (text/plain or no type) as str, a JSON body as its decoded document."""
    if media in JSON_TYPES or isinstance(body, (dict, list)):
        return _parse_json(body)
    if media == "" or media.startswith("text/"):
        return _text_of(body)
    raise RequestError(415, f"Content-Type {media!r} is not supported for text; {usage}")


def check_text(value: Any, what: str, usage: str) -> str:
    """`value` as a non-blank string, else a 400 naming `what`."""
    if not isinstance(value, str):
        raise RequestError(400, f"{what} must be a string, got {type(value).__name__}; {usage}")
    if not value.strip():
        raise RequestError(400, f"{what} is empty; {usage}")
    return value


def check_count(count: int, cap: int, what: str = "texts") -> None:
    """413 when one request carries more rows than the per-request cap (params `model.text.max_texts`)."""
    if count > cap:
        raise RequestError(413, f"request has {count} {what}, over the cap of {cap} per request "
                                f"(model.text.max_texts); split it into requests of at most {cap}")


def check_keys(doc: dict, allowed: tuple, what: str, usage: str) -> None:
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        raise RequestError(400, f"{what} has unknown key(s) {unknown}; allowed: {', '.join(allowed)}. {usage}")


class Decoded:
    """One request as model rows (feeds without a batch dim) and what its answer needs besides them."""
    __slots__ = ("rows", "meta")

    def __init__(self, rows: list, meta: Any = None) -> None:
        self.rows, self.meta = rows, meta


class TaskAdapter(ABC):
    kind = ""

    def __init__(self, model_dir: str | Path, task: dict):
        self.model_dir = Path(model_dir)
        self.task = dict(task)
        limit = self.task.get("max_request_bytes")
        self.max_request_bytes = int(limit) if limit else None

    # -- shared checks
    def _check_size(self, body: Any) -> None:
        size = _body_size(body)
        if self.max_request_bytes and size is not None and size > self.max_request_bytes:
            raise RequestError(413, f"request body is {size} bytes, over the limit of {self.max_request_bytes} "
                                    f"bytes; send a smaller input")

    def decode(self, body: Any, content_type: str | None = None) -> dict[str, np.ndarray]:
        self.check_body(body)
        return self._decode(body, _media_type(content_type))

    def check_body(self, body: Any) -> None:
        """Empty bodies and the size limit: the same for every task."""
        if body is None or (isinstance(body, (bytes, bytearray, str)) and len(body) == 0):
            raise RequestError(400, f"request body is empty; {self.usage()}")
        self._check_size(body)

    def decode_request(self, body: Any, content_type: str | None = None) -> Decoded:
        """The request's rows; one row unless the task fans a request out (see the module doc)."""
        return Decoded([self.decode(body, content_type)])

    def respond_request(self, row_outputs: list[list[np.ndarray]], meta: Any) -> Any:
        return self.respond([o[None] for o in row_outputs[0]], 0)

    def respond_request_bytes(self, row_outputs: list[list[np.ndarray]], decoded: Decoded) -> bytes:
        """The request's answer as JSON bytes, what the serving handler returns (handlers/encode.py)."""
        if len(decoded.rows) == 1 and type(self).respond_request is TaskAdapter.respond_request:
            return self.respond_bytes([o[None] for o in row_outputs[0]], 0, decoded.rows[0])
        return json_bytes(self.respond_request(row_outputs, decoded.meta))

    @abstractmethod
    def usage(self) -> str:
        """How a valid request looks (appended to every 4xx message)."""

    @abstractmethod
    def _decode(self, body: Any, media: str) -> dict[str, np.ndarray]:
        """One non-empty, size-checked body → that sample's feeds; RequestError when invalid."""

    def collate(self, samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        if not samples:
            raise ValueError("collate needs at least one sample")
        return {name: np.stack([s[name] for s in samples]) for name in samples[0]}

    @abstractmethod
    def respond(self, outputs: list[np.ndarray], i: int) -> Any:
        """Sample `i`'s JSON-able response from the batch outputs."""

    def respond_bytes(self, outputs: list[np.ndarray], i: int, sample: dict | None = None) -> bytes:
        """The same response as JSON bytes, what the serving handler returns (handlers/encode.py)."""
        return json_bytes(self.respond(outputs, i))

    @abstractmethod
    def example_feeds(self, batch_size: int, seq_len: int | None = None) -> dict[str, np.ndarray]:
        """Deterministic synthetic feeds (warm-up, benchmarks)."""

    @abstractmethod
    def example_requests(self, n: int, seed: int = 0) -> list[tuple[bytes, str]]:
        """`n` deterministic valid (body, content type) requests (golden set, HTTP parity)."""


# Words of the tasks' example requests (short-sentence traffic).
_WORDS = ("the a one every small large red quiet bright old new fast slow happy tired curious river city "
          "guitar music market morning evening window garden train engine forest ocean story teacher student "
          "doctor farmer child dog cat bird plays reads builds carries watches finds opens writes sings runs "
          "walks near under over behind across through during after before with without because while and "
          "but so yesterday today tomorrow slowly quickly carefully loudly softly again together alone").split()


# Each task in its own module (they import this one): loaded when first asked for.
TASK_MODULES = {"text-embedding": ("embedding", "TextEmbeddingAdapter"),
                "tensor": ("tensor", "TensorAdapter"),
                "image-classification": ("image", "ImageClassificationAdapter"),
                "text-classification": ("classification", "TextClassificationAdapter"),
                "rerank": ("rerank", "RerankAdapter"),
                "token-classification": ("tokens", "TokenClassificationAdapter")}
KINDS = tuple(TASK_MODULES)


def adapter_class(kind: str) -> type:
    if kind not in TASK_MODULES:
        raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(KINDS)}")
    import importlib
    module, name = TASK_MODULES[kind]
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def make_adapter(model_dir: str | Path, task: dict) -> TaskAdapter:
    return adapter_class(task.get("kind"))(model_dir, task)
