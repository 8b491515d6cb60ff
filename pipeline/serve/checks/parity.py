"""HTTP parity: the served answers against the reference ones, one by one and concurrently (so they batch)."""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np

from pipeline.accuracy import task_gate
from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.server.interface import Server
from pipeline.serve.server.torchserve_http import Client


def compare_response(got: Any, expected: Any, atol: float, rtol: float) -> tuple[bool, float, str]:
    """(ok, max_abs_error, first mismatch) between a handler response and the reference one.
    Numbers within atol + rtol·|expected|; everything else equal. A classification answer
    (`[{"label", "score"}]`, best first): as long as expected, the top-1 label must match and every
    label in both lists must have its score within tolerance (near-ties may swap lower ranks). A
    rerank answer (`[{"index", "score"}]`, best first): the same indices, each one's score within
    tolerance, and the order never puts a text before one whose expected score is higher by more
    than the tolerance (texts within it may swap)."""
    worst = [0.0]

    def walk(g, e, where) -> str:
        if isinstance(e, bool) or e is None or isinstance(e, str):
            return "" if g == e else f"{where}: got {g!r}, expected {e!r}"
        if isinstance(e, (int, float)):
            if isinstance(g, bool) or not isinstance(g, (int, float)):
                return f"{where}: got {g!r}, expected the number {e!r}"
            err = abs(float(g) - float(e))
            if not math.isfinite(err):
                return f"{where}: got {g!r}, expected {e!r}"
            worst[0] = max(worst[0], err)
            return "" if err <= atol + rtol * abs(float(e)) else f"{where}: got {g!r}, expected {e!r} (|err| {err:.3g})"
        if isinstance(e, dict):
            if not isinstance(g, dict):
                return f"{where}: got {type(g).__name__}, expected an object"
            if set(g) != set(e):
                return f"{where}: keys {sorted(g)} != expected {sorted(e)}"
            return next((m for k, v in e.items() if (m := walk(g[k], v, f"{where}.{k}"))), "")
        if isinstance(e, list):
            if task_gate.label_list(e) and task_gate.label_list(g) and len(g) == len(e):
                return ranked(g, e, where)
            if _index_list(e) and _index_list(g) and len(g) == len(e):
                return reranked(g, e, where)
            if not isinstance(g, list) or len(g) != len(e):
                return f"{where}: got {type(g).__name__} of length {len(g) if isinstance(g, list) else '-'}, expected length {len(e)}"
            return next((m for i, (gi, ei) in enumerate(zip(g, e)) if (m := walk(gi, ei, f"{where}[{i}]"))), "")
        return "" if g == e else f"{where}: got {g!r}, expected {e!r}"

    def ranked(g, e, where) -> str:
        if g[0]["label"] != e[0]["label"]:
            return f"{where}: top-1 label {g[0]['label']!r} != expected {e[0]['label']!r}"
        got_by_label = {c["label"]: c for c in g}
        for c in e:
            if c["label"] in got_by_label:
                m = walk(got_by_label[c["label"]], c, f"{where}[label={c['label']!r}]")
                if m:
                    return m
        return ""

    def reranked(g, e, where) -> str:
        expected_by_index = {c["index"]: c for c in e}
        if set(expected_by_index) != {c["index"] for c in g}:
            return f"{where}: indices {sorted(c['index'] for c in g)} != expected {sorted(expected_by_index)}"
        for c in g:
            m = walk(c, expected_by_index[c["index"]], f"{where}[index={c['index']}]")
            if m:
                return m
        for k, ahead in enumerate(g):
            for behind in g[k + 1:]:
                s_ahead = float(expected_by_index[ahead["index"]]["score"])
                s_behind = float(expected_by_index[behind["index"]]["score"])
                if s_behind - s_ahead > atol + rtol * abs(s_behind):
                    return (f"{where}: index {ahead['index']} ranked before index {behind['index']}, whose expected "
                            f"score is higher by {s_behind - s_ahead:.3g} (beyond the tolerance)")
        return ""

    msg = walk(got, expected, "response")
    return (not msg, worst[0], msg)


RERANK_KEYS = frozenset({"index", "score", "text"})


def _index_list(value: Any) -> bool:
    """A rerank answer: `[{"index", "score", "text"?}, ...]`, best first (a token-classification answer
    without aggregation also carries "index" and "score", but in text order, with its entity and word)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(c, dict) and "index" in c and "score" in c and set(c) <= RERANK_KEYS for c in value)


def response_within(got: Any, expected: Any, atol: float, rtol: float,
                    gate: Optional[dict] = None, task: Optional[str] = None) -> tuple[bool, float, str]:
    """compare_response; for a tolerance with `gate: task` (int8) and an embedding / image
    classification answer, the task gate's per-response part instead (pipeline/accuracy/task_gate.py)."""
    if task_gate.uses_task_gate(gate, task_gate.response_kind(expected, task)):
        return task_gate.check_response(got, expected, gate, task)
    return compare_response(got, expected, atol, rtol)


def check_parity(ts: Server, cases: list[HttpCase], atol: float, rtol: float,
                 concurrency: int, gate: Optional[dict] = None, task: Optional[str] = None) -> dict:
    """Every golden case one by one, then all of them concurrently (so they batch). With a task
    gate (int8) the sequential answers must also meet its figures over all cases (recall@k, top-1
    agreement...), recorded under `task_gate`. Embedding answers also record their lowest cosine and
    norm error under `embedding`; unit reference vectors must be served unit within UNIT_NORM_ATOL."""
    def run(case: HttpCase, client: Client) -> dict:
        r = client.request("POST", ts.api.predictions_path(), case.body, case.content_type)
        if r.status != 200:
            return {"id": case.id, "ok": False, "max_abs": None,
                    "error": f"HTTP {r.status}: {r.body[:300].decode('utf-8', 'replace')}"}
        try:
            got = r.json()
        except (ValueError, UnicodeDecodeError):
            return {"id": case.id, "ok": False, "max_abs": None, "error": "response is not JSON"}
        ok, err, msg = response_within(got, case.expected, atol, rtol, gate, task)
        return {"id": case.id, "ok": ok, "max_abs": err, "error": msg or None, "_answer": (got, case.expected)}

    client = ts.api.client()
    try:
        sequential = [run(c, client) for c in cases]
    finally:
        client.close()
    answers = [r.pop("_answer") for r in sequential if "_answer" in r]
    concurrent = concurrently(cases, run, ts, max(1, concurrency))
    for r in concurrent:
        r.pop("_answer", None)
    results = sequential + concurrent
    failures = [r for r in results if not r["ok"]]
    errs = [r["max_abs"] for r in results if r["max_abs"] is not None]
    out = {"ok": not failures, "cases": len(cases), "atol": atol, "rtol": rtol,
           "max_abs_error": max(errs) if errs else None,
           "failures": failures[:10]}
    if gate and gate.get("gate") == "task":
        out = _judged_by_task_gate(out, answers, gate, task)
    return _with_embedding_figures(out, answers)


UNIT_NORM_ATOL = 1e-5     # a model ending in Normalize: clients take dot products as cosines


def embedding_figures(answers: list[tuple[Any, Any]]) -> Optional[dict]:
    """Over the sequential embedding answers: the lowest cosine to the reference, and how far the
    served vectors' norms are from 1 (and the reference's: only a unit reference asks for unit answers)."""
    pairs = [(np.asarray(g, float), np.asarray(e, float)) for g, e in
             ((task_gate.response_vector(task_gate.EMBEDDING, g), task_gate.response_vector(task_gate.EMBEDDING, e))
              for g, e in answers) if g is not None and e is not None and len(g) == len(e)]
    if not pairs:
        return None
    got, ref = np.stack([g for g, _ in pairs]), np.stack([e for _, e in pairs])
    norms, ref_norms = np.linalg.norm(got, axis=1), np.linalg.norm(ref, axis=1)
    return {"answers": len(pairs), "min_cosine": round(float(task_gate.row_cosines(got, ref).min()), 7),
            "max_norm_error": float(np.abs(norms - 1.0).max()),
            "reference_max_norm_error": float(np.abs(ref_norms - 1.0).max()),
            "unit_reference": bool(np.abs(ref_norms - 1.0).max() <= UNIT_NORM_ATOL)}


def _with_embedding_figures(out: dict, answers: list[tuple[Any, Any]]) -> dict:
    """The parity record with the embeddings' cosine and norm; a unit reference served off unit fails."""
    figures = embedding_figures(answers)
    if figures is None:
        return out
    out["embedding"] = figures
    if figures["unit_reference"] and figures["max_norm_error"] > UNIT_NORM_ATOL:
        out["ok"] = False
        out["failures"] = [{"id": "all cases", "ok": False, "error": (
            f"served embeddings are not unit vectors: |norm - 1| up to {figures['max_norm_error']:.2g} > "
            f"{UNIT_NORM_ATOL:g}, while the model's own are (it ends in Normalize)")}] + out["failures"][:9]
    return out


def _judged_by_task_gate(out: dict, answers: list[tuple[Any, Any]], gate: dict, task: Optional[str]) -> dict:
    """The parity record with the task gate's figures over all sequential answers, failing on a miss."""
    figures = task_gate.responses_figures(answers, gate, task)
    if figures is None:
        return out
    miss = task_gate.judge(figures, gate)
    out.update(task_gate=figures, gate=gate, ok=out["ok"] and miss is None)
    if miss:
        out["failures"] = [{"id": "all cases", "ok": False, "error": miss}] + out["failures"][:9]
    return out


def concurrently(items: list, fn, ts: Server, threads: int) -> list:
    """fn(item, client) for every item, up to `threads` at once, released together."""
    threads = min(threads, len(items))
    barrier = threading.Barrier(threads)
    local = threading.local()

    def call(item):
        if not hasattr(local, "client"):
            local.client = ts.api.client()
            try:
                barrier.wait(timeout=10)
            except threading.BrokenBarrierError:
                pass
        return fn(item, local.client)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(call, items))
