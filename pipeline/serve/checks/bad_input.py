"""Bad input: malformed requests for the task, sent beside valid ones; each must get a 4xx and the
workers must stay up (the valid ones still answered correctly in the batches they shared)."""
from __future__ import annotations

import base64
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.checks.parity import concurrently, response_within
from pipeline.serve.server.interface import Server
from pipeline.serve.server.torchserve_http import Client

# The text tasks with a head (handlers/task_*.py): requests their adapters must refuse with a 4xx
# naming the problem. 10 000 texts pass any sane model.text.max_texts (413 with the cap).
_LONG = " ".join(["guitar"] * 5000)                 # over any model's max_length in tokens (413)
TEXT_HEAD_BAD = {
    "rerank": (("no_texts", {"query": "who plays", "texts": []}), ("missing_query", {"texts": ["a text"]}),
               ("non_string_text", {"query": "who plays", "texts": ["a text", 3]}),
               ("too_many_texts", {"query": "who plays", "texts": ["a"] * 10000}),
               ("query_over_the_limit", {"query": _LONG, "texts": ["a text"]})),
    "text-classification": (("empty_inputs", {"inputs": []}), ("wrong_type", {"inputs": 42}),
                            ("too_many_texts", {"inputs": ["a"] * 10000})),
    "token-classification": (("wrong_type", {"inputs": 42}), ("text_over_the_limit", {"inputs": _LONG})),
}


@dataclass(frozen=True)
class BadCase:
    id: str
    content_type: Optional[str]
    body: bytes


def max_request_size(ts: Server) -> int:
    """The running server's request size limit (a TorchServe's config.properties, else its default; a Ray
    Serve's handler limit)."""
    return ts.max_request_size()


def bad_input_cases(task: str, cases: list[HttpCase], max_request_size: int) -> list[BadCase]:
    """Malformed requests for this task; each must get a 4xx and leave the worker up."""
    ct = cases[0].content_type or "application/json"
    bad = [BadCase("empty_body", ct, b""),
           BadCase("over_size_limit", ct, b"0" * (max_request_size + 1))]
    if task == "image-classification":
        image = next((c.body for c in cases if (c.content_type or "").startswith("image/")), b"")
        bad += [BadCase("invalid_json", "application/json", b'{"inputs": '),
                BadCase("wrong_content_type", "text/plain", b"a sentence, not an image"),
                BadCase("undecodable_image", "image/png", b"\x89PNG\r\n\x1a\n this is not really a PNG"),
                BadCase("truncated_image", "image/png", image[:max(8, len(image) // 2)]),
                BadCase("not_base64", "application/json", b'{"inputs": "not base64 at all!"}'),
                BadCase("bad_parameter", "application/json", json.dumps(
                    {"inputs": base64.b64encode(image).decode("ascii"), "parameters": {"top_k": 0}}).encode()),
                BadCase("decompression_bomb", "image/png", png_claiming(30000, 30000))]
    elif task == "text-embedding":
        bad += [BadCase("invalid_json", "application/json", b'{"text": "unterminated'),
                BadCase("wrong_content_type", "image/png", b"\x89PNG\r\n\x1a\n"),
                BadCase("wrong_type", "application/json", b'{"text": 42}'),
                BadCase("text_over_the_limit", "application/json", json.dumps({"text": _LONG}).encode()),
                BadCase("unknown_prompt_name", "application/json",
                        json.dumps({"text": "a query", "prompt_name": "no-such-prompt"}).encode())]
    elif task == "tensor":
        bad += [BadCase("invalid_json", "application/json", b"[[0.0, 1.0"),
                BadCase("wrong_content_type", "image/png", b"\x89PNG\r\n\x1a\n")]
        shape = _json_tensor_shape(cases)
        if shape:
            n = int(np.prod(shape))
            wrong = [0.0] * (n + 1) if len(shape) == 1 else np.zeros(shape[1:]).tolist()
            bad += [BadCase("wrong_shape", "application/json", json.dumps(wrong).encode()),
                    BadCase("wrong_dtype", "application/json",
                            json.dumps(np.full(shape, "x").tolist()).encode())]
    elif task in TEXT_HEAD_BAD:
        bad += [BadCase("invalid_json", "application/json", b'{"inputs": "unterminated'),
                BadCase("wrong_content_type", "image/png", b"\x89PNG\r\n\x1a\n")]
        bad += [BadCase(name, "application/json", json.dumps(doc).encode()) for name, doc in TEXT_HEAD_BAD[task]]
    else:
        raise ValueError(f"unknown task {task!r}; bad inputs are defined for image-classification, "
                         f"text-embedding, tensor, {', '.join(TEXT_HEAD_BAD)}")
    return bad


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG file whose header declares width x height pixels (a decompression bomb's shape)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)           # 8-bit grayscale
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


def _json_tensor_shape(cases: list[HttpCase]) -> Optional[tuple]:
    for c in cases:
        if (c.content_type or "").startswith("application/json"):
            try:
                doc = json.loads(c.body)
                if isinstance(doc, dict):
                    doc = doc.get("input", doc.get("inputs"))
                arr = np.asarray(doc, dtype=np.float64)
                return tuple(arr.shape)
            except (ValueError, TypeError):
                continue
    return None


def check_bad_inputs(ts: Server, bad: list[BadCase], good: list[HttpCase],
                     atol: float, rtol: float, gate: Optional[dict] = None, task: Optional[str] = None) -> dict:
    """Bad and valid requests sent together (so they share batches): every bad one → 4xx, every
    valid one → 200 with the reference answer, and the same workers still READY afterwards."""
    workers_before = ts.worker_pids()
    mixed: list[tuple[str, Any]] = []
    for i, b in enumerate(bad):
        mixed.append(("bad", b))
        mixed.append(("good", good[i % len(good)]))

    def send(item, client: Client):
        kind, case = item
        try:
            r = client.request("POST", ts.api.predictions_path(), case.body, case.content_type)
        except Exception as e:  # noqa: BLE001 — a dropped connection is a result here, not a crash
            return kind, case, None, f"{type(e).__name__}: {e}"
        return kind, case, r, None

    results = concurrently(mixed, send, ts, len(mixed))
    cases_out, good_fail, bad_ids, good_ids = [], [], set(), set()
    for kind, case, r, err in results:
        status = r.status if r is not None else None
        if kind == "bad":
            cases_out.append({"id": case.id, "status": status, "ok": status is not None and 400 <= status < 500,
                              "error": err or (None if r is None else r.error_text())})
            if r is not None and r.request_id:
                bad_ids.add(r.request_id)
        else:
            ok = status == 200 and response_within(r.json(), case.expected, atol, rtol, gate, task)[0]
            if not ok:
                good_fail.append({"id": case.id, "status": status, "error": err})
            if r is not None and r.request_id:
                good_ids.add(r.request_id)
    batches = [b for b in ts.log.batches() if b & (bad_ids | good_ids)]
    mixed_batches = sum(1 for b in batches if b & bad_ids and b & good_ids)
    worker_stayed_up = _same_workers_ready(ts, workers_before)
    return {"ok": all(c["ok"] for c in cases_out) and not good_fail and worker_stayed_up,
            "cases": cases_out, "valid_alongside_failed": good_fail,
            "valid_alongside": len(mixed) - len(bad),
            "mixed_batches": mixed_batches, "worker_stayed_up": worker_stayed_up}


def _same_workers_ready(ts: Server, workers_before: dict) -> bool:
    """Every worker READY and the same ones (ids → pids) as before: none crashed and was replaced."""
    desc = ts.api.describe_model()
    workers_after = {w["id"]: w.get("pid") for w in desc.get("workers", [])}
    ready_after = all(w.get("status") == "READY" for w in desc.get("workers", []))
    return ready_after and workers_after == workers_before
