"""Prove a .mar inside a real TorchServe: readiness, HTTP parity, bad input, bounded load, baseline.

`check_server` runs every check against one server (started by `pipeline.serve.torchserve.TorchServe`
in its own working dir, always stopped); `serve_check` runs the winner and then the baseline under
the same load in the same run and computes the ratios (winner / baseline).

Batch sizes actually formed come from TorchServe itself: every batch the backend runs logs one
PredictionTime metric carrying all of its request ids, and every response carries its
`x-request-id`, so the load's own requests are matched to the batches that served them.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pipeline.serve.startup_check import diagnose_missed_startup
from pipeline.accuracy import task_gate
from pipeline.serve.torchserve import Client, ModelNotReady, TorchServe, TorchServeError, read_properties

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_SIZE = 6553500      # TorchServe's max_request_size default (bytes)
PROVENANCE = "provenance.json"          # written into the .mar by pipeline.serve.archive


# --------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class HttpCase:
    id: str
    content_type: Optional[str]
    body: bytes
    expected: Any = None


@dataclass(frozen=True)
class ServerSpec:
    """What to start: a model store holding `<name>.mar` and the config.properties to start it with."""
    name: str
    model_store: Path
    config: Optional[Path]
    mar: Optional[str] = None           # file name in the store; default <name>.mar
    env: Optional[dict] = None          # the start command's environment (thread counts)

    @property
    def models(self) -> str:
        return f"{self.name}={self.mar or self.name + '.mar'}"


def load_http_cases(path: Path) -> list[HttpCase]:
    """artifacts/golden/http_cases.json → cases with their bodies as bytes (body_file relative to it)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found; run the prepare stage (it writes the golden HTTP cases)") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: expected a non-empty JSON list of cases "
                         f'[{{"id", "content_type", "body" | "body_file", "expected"}}]')
    cases = []
    for i, c in enumerate(raw):
        if "body_file" in c:
            body = (path.parent / c["body_file"]).read_bytes()
        elif "body" in c:
            b = c["body"]
            body = b.encode("utf-8") if isinstance(b, str) else json.dumps(b).encode("utf-8")
        else:
            raise ValueError(f"{path}: case {i} ({c.get('id')}) has neither `body` nor `body_file`")
        cases.append(HttpCase(str(c.get("id", i)), c.get("content_type"), body, c.get("expected")))
    return cases


def tolerance_from_mar(mar: Path) -> Optional[dict]:
    """The variant's verification tolerance {atol, rtol, ...} recorded in the .mar's provenance.json."""
    try:
        with zipfile.ZipFile(mar) as z:
            prov = json.loads(z.read(PROVENANCE))
    except (KeyError, zipfile.BadZipFile, FileNotFoundError, json.JSONDecodeError):
        return None
    tol = (prov.get("verification") or {}).get("tolerance")
    return tol if isinstance(tol, dict) and "atol" in tol else None


# --------------------------------------------------------------------------- parity
def compare_response(got: Any, expected: Any, atol: float, rtol: float) -> tuple[bool, float, str]:
    """(ok, max_abs_error, first mismatch) between a handler response and the reference one.
    Numbers within atol + rtol·|expected|; everything else equal. Classification `top_k`: the top-1
    class must match and every class in both lists must have its probability within tolerance
    (near-ties may swap lower ranks)."""
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
            if "top_k" in e and isinstance(e["top_k"], list):
                msg = top_k(g["top_k"], e["top_k"], f"{where}.top_k")
                rest = {k: v for k, v in e.items() if k != "top_k"}
                return msg or next((m for k, v in rest.items() if (m := walk(g[k], v, f"{where}.{k}"))), "")
            return next((m for k, v in e.items() if (m := walk(g[k], v, f"{where}.{k}"))), "")
        if isinstance(e, list):
            if not isinstance(g, list) or len(g) != len(e):
                return f"{where}: got {type(g).__name__} of length {len(g) if isinstance(g, list) else '-'}, expected length {len(e)}"
            return next((m for i, (gi, ei) in enumerate(zip(g, e)) if (m := walk(gi, ei, f"{where}[{i}]"))), "")
        return "" if g == e else f"{where}: got {g!r}, expected {e!r}"

    def top_k(g, e, where) -> str:
        if not isinstance(g, list) or not g or not e:
            return f"{where}: got {g!r}, expected a non-empty list"
        if g[0].get("index") != e[0].get("index"):
            return f"{where}: top-1 class {g[0].get('index')} != expected {e[0].get('index')}"
        got_p = {c.get("index"): c for c in g}
        for c in e:
            if c.get("index") in got_p:
                m = walk(got_p[c["index"]], c, f"{where}[index={c['index']}]")
                if m:
                    return m
        return ""

    msg = walk(got, expected, "response")
    return (not msg, worst[0], msg)


def response_within(got: Any, expected: Any, atol: float, rtol: float,
                    gate: Optional[dict] = None) -> tuple[bool, float, str]:
    """compare_response; for a tolerance with `gate: task` (int8) and an embedding / classification
    answer, the task gate's per-response part instead (pipeline/accuracy/task_gate.py)."""
    if task_gate.uses_task_gate(gate, task_gate.response_kind(expected)):
        return task_gate.check_response(got, expected, gate)
    return compare_response(got, expected, atol, rtol)


def check_parity(ts: TorchServe, cases: list[HttpCase], atol: float, rtol: float,
                 concurrency: int, gate: Optional[dict] = None) -> dict:
    """Every golden case one by one, then all of them concurrently (so they batch). With a task
    gate (int8) the sequential answers must also meet its figures over all cases (recall@k, top-1
    agreement...), recorded under `task_gate`."""
    answers: list[tuple[Any, Any]] = []

    def run(case: HttpCase, client: Client) -> dict:
        r = client.request("POST", ts.api.predictions_path(), case.body, case.content_type)
        if r.status != 200:
            return {"id": case.id, "ok": False, "max_abs": None,
                    "error": f"HTTP {r.status}: {r.body[:300].decode('utf-8', 'replace')}"}
        try:
            got = r.json()
        except (ValueError, UnicodeDecodeError):
            return {"id": case.id, "ok": False, "max_abs": None, "error": "response is not JSON"}
        ok, err, msg = response_within(got, case.expected, atol, rtol, gate)
        return {"id": case.id, "ok": ok, "max_abs": err, "error": msg or None, "_answer": (got, case.expected)}

    client = ts.api.client()
    try:
        sequential = [run(c, client) for c in cases]
    finally:
        client.close()
    answers = [r.pop("_answer") for r in sequential if "_answer" in r]
    concurrent = _concurrently(cases, lambda c, cl: run(c, cl), ts, max(1, concurrency))
    for r in concurrent:
        r.pop("_answer", None)
    results = sequential + concurrent
    failures = [r for r in results if not r["ok"]]
    errs = [r["max_abs"] for r in results if r["max_abs"] is not None]
    out = {"ok": not failures, "cases": len(cases), "atol": atol, "rtol": rtol,
           "max_abs_error": max(errs) if errs else None,
           "failures": failures[:10]}
    figures = task_gate.responses_figures(answers, gate) if gate and gate.get("gate") == "task" else None
    if figures is not None:
        miss = task_gate.judge(figures, gate)
        out.update(task_gate=figures, gate=gate, ok=out["ok"] and miss is None)
        if miss:
            out["failures"] = [{"id": "all cases", "ok": False, "error": miss}] + out["failures"][:9]
    return out


def _concurrently(items: list, fn, ts: TorchServe, threads: int) -> list:
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


# --------------------------------------------------------------------------- bad input
@dataclass(frozen=True)
class BadCase:
    id: str
    content_type: Optional[str]
    body: bytes


def bad_input_cases(task: str, cases: list[HttpCase], max_request_size: int) -> list[BadCase]:
    """Malformed requests for this task; each must get a 4xx and leave the worker up."""
    ct = cases[0].content_type or "application/json"
    bad = [BadCase("empty_body", ct, b""),
           BadCase("over_size_limit", ct, b"0" * (max_request_size + 1))]
    if task == "image-classification":
        bad += [BadCase("invalid_json", "application/json", b'{"image": '),
                BadCase("wrong_content_type", "text/plain", b"a sentence, not an image"),
                BadCase("undecodable_image", ct if ct.startswith("image/") else "image/png",
                        b"\x89PNG\r\n\x1a\n this is not really a PNG")]
    elif task == "text-embedding":
        bad += [BadCase("invalid_json", "application/json", b'{"text": "unterminated'),
                BadCase("wrong_content_type", "image/png", b"\x89PNG\r\n\x1a\n"),
                BadCase("wrong_type", "application/json", b'{"text": 42}')]
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
    else:
        raise ValueError(f"unknown task {task!r}; bad inputs are defined for image-classification, "
                         f"text-embedding and tensor")
    return bad


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


def check_bad_inputs(ts: TorchServe, bad: list[BadCase], good: list[HttpCase],
                     atol: float, rtol: float, gate: Optional[dict] = None) -> dict:
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

    results = _concurrently(mixed, send, ts, len(mixed))
    cases_out, good_fail, bad_ids, good_ids = [], [], set(), set()
    for kind, case, r, err in results:
        status = r.status if r is not None else None
        if kind == "bad":
            cases_out.append({"id": case.id, "status": status, "ok": status is not None and 400 <= status < 500,
                              "error": err or (None if r is None else _error_text(r))})
            if r is not None and r.request_id:
                bad_ids.add(r.request_id)
        else:
            ok = status == 200 and response_within(r.json(), case.expected, atol, rtol, gate)[0]
            if not ok:
                good_fail.append({"id": case.id, "status": status, "error": err})
            if r is not None and r.request_id:
                good_ids.add(r.request_id)
    batches = [b for b in ts.log.batches() if b & (bad_ids | good_ids)]
    mixed_batches = sum(1 for b in batches if b & bad_ids and b & good_ids)
    desc = ts.api.describe_model()
    workers_after = {w["id"]: w.get("pid") for w in desc.get("workers", [])}
    ready_after = all(w.get("status") == "READY" for w in desc.get("workers", []))
    worker_stayed_up = ready_after and workers_after == workers_before
    return {"ok": all(c["ok"] for c in cases_out) and not good_fail and worker_stayed_up,
            "cases": cases_out, "valid_alongside_failed": good_fail,
            "valid_alongside": len(mixed) - len(bad),
            "mixed_batches": mixed_batches, "worker_stayed_up": worker_stayed_up}


def _error_text(r) -> str:
    try:
        doc = r.json()
        return str(doc.get("error") or doc.get("message") or doc)[:200] if isinstance(doc, dict) else str(doc)[:200]
    except (ValueError, UnicodeDecodeError):
        return r.body[:200].decode("utf-8", "replace")


# --------------------------------------------------------------------------- load
@dataclass
class LoadResult:
    requests_planned: int
    requests_sent: int
    requests_answered: int
    requests_ok: int
    errors_4xx: int
    errors_5xx: int
    lost: int                       # sent but never answered (connection error / timeout)
    p50_ms: Optional[float]
    p99_ms: Optional[float]
    mean_ms: Optional[float]
    throughput_rps: Optional[float]
    wall_s: float
    concurrency: int
    stopped_by_time_cap: bool
    batch_sizes_seen: dict = field(default_factory=dict)   # {"<size>": number of batches}
    mean_batch_size: Optional[float] = None
    failures: list = field(default_factory=list)            # first few non-200 / lost, for the log


def run_load(ts: TorchServe, cases: list[HttpCase], requests: int, concurrency: int,
             time_cap_s: float, request_timeout_s: Optional[float] = None) -> LoadResult:
    """A fixed number of requests from `concurrency` keep-alive clients, cycling through the
    cases; no new request after `time_cap_s`, and no request waits longer than that (or than
    `request_timeout_s` when given: a short timed window must not count slow answers as lost)."""
    lock = threading.Lock()
    counter = iter(range(requests))
    records: list[tuple[int, Optional[int], float, Optional[str], Optional[str]]] = []
    t0 = time.perf_counter()
    deadline = t0 + time_cap_s
    capped = [False]

    def worker():
        client = ts.api.client(timeout_s=request_timeout_s or time_cap_s, retry_stale=False)
        try:
            while True:
                with lock:
                    if time.perf_counter() > deadline:
                        capped[0] = True
                        return
                    i = next(counter, None)
                if i is None:
                    return
                case = cases[i % len(cases)]
                try:
                    r = client.request("POST", ts.api.predictions_path(), case.body, case.content_type)
                    rec = (i, r.status, r.ms, r.request_id, None if r.status == 200 else _error_text(r))
                except Exception as e:   # noqa: BLE001 — a lost request is a result, recorded
                    client.close()
                    rec = (i, None, 0.0, None, f"{type(e).__name__}: {e}")
                with lock:
                    records.append(rec)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(time_cap_s + (request_timeout_s or time_cap_s) + 30)
    wall = time.perf_counter() - t0
    answered = [r for r in records if r[1] is not None]
    ok = [r for r in answered if r[1] == 200]
    lat = np.asarray([r[2] for r in ok], dtype=np.float64)
    sizes = ts.log.batch_sizes_for(r[3] for r in ok)
    n_batches = sum(sizes.values())
    return LoadResult(
        requests_planned=requests, requests_sent=len(records), requests_answered=len(answered),
        requests_ok=len(ok), errors_4xx=sum(1 for r in answered if 400 <= r[1] < 500),
        errors_5xx=sum(1 for r in answered if r[1] >= 500), lost=len(records) - len(answered),
        p50_ms=_pct(lat, 50), p99_ms=_pct(lat, 99), mean_ms=float(lat.mean()) if lat.size else None,
        throughput_rps=len(ok) / wall if wall > 0 else None, wall_s=wall, concurrency=concurrency,
        stopped_by_time_cap=capped[0],
        batch_sizes_seen={str(k): v for k, v in sorted(sizes.items())},
        mean_batch_size=(sum(k * v for k, v in sizes.items()) / n_batches) if n_batches else None,
        failures=[{"i": r[0], "status": r[1], "error": r[4]} for r in records if r[1] != 200][:5])


def _pct(a: np.ndarray, q: float) -> Optional[float]:
    return float(np.percentile(a, q)) if a.size else None


# --------------------------------------------------------------------------- one server
def check_server(spec: ServerSpec, cases: list[HttpCase], *, task: str, atol: float, rtol: float,
                 gate: Optional[dict] = None, requests: int, concurrency: int, time_cap_s: float, bad_inputs: bool = True,
                 parity: bool = True, workdir: Optional[Path] = None) -> dict:
    """Start `spec` in isolation, run every check, stop it (always). Never raises for a check that
    fails: the figures say what failed (`ready: false` + `error` when it never became READY)."""
    ts = TorchServe(spec.config, spec.model_store, spec.name, models=spec.models, workdir=workdir,
                    env=spec.env)
    out: dict[str, Any] = {"model": spec.name, "mar": str(spec.model_store / (spec.mar or spec.name + ".mar")),
                           "config": str(spec.config) if spec.config else None, "server_dir": str(ts.workdir)}
    try:
        with ts:
            ready = ts.readiness
            out.update(ready=True, ready_s=ready.ready_s, all_workers_ready_s=ready.all_ready_s,
                       worker_load_ms=ready.worker_load_ms, settings=_settings(ready.description),
                       token_authorization=ts.api.inference_key() is not None)
            log.info("%s READY in %.2f s (WorkerLoadTime %s ms), %d worker(s)", spec.name, ready.ready_s,
                     ready.worker_load_ms, len(ready.description.get("workers", [])))
            first = ts.api.predict(cases[0].body, cases[0].content_type)
            out["first_request_ms"] = first.ms
            out["first_request_status"] = first.status
            if parity:
                out["parity"] = check_parity(ts, cases, atol, rtol, concurrency, gate=gate)
                log.info("%s parity ok=%s max_abs_error=%s", spec.name, out["parity"]["ok"],
                         out["parity"]["max_abs_error"])
            if bad_inputs:
                limit = int(read_properties(ts.workdir / "config.properties").get(
                    "max_request_size", DEFAULT_MAX_REQUEST_SIZE))
                out["bad_inputs"] = check_bad_inputs(ts, bad_input_cases(task, cases, limit), cases, atol, rtol,
                                                     gate=gate)
                log.info("%s bad inputs: %s", spec.name,
                         {c["id"]: c["status"] for c in out["bad_inputs"]["cases"]})
            load = run_load(ts, cases, requests, concurrency, time_cap_s)
            out["load"] = asdict(load)
            # Peak over the worker's life so far: its load, the checks and the load above.
            rss = ts.worker_peak_rss_mb()
            out["worker_peak_rss_mb"] = max((v for v in rss.values() if v is not None), default=None)
            # Read last: the frontend copies the worker's log lines asynchronously.
            out["handler_load_ms"] = ts.log.handler_load_ms()     # inside WorkerLoadTime: the handler's own phases
            log.info("%s handler load phases (slowest worker): %s", spec.name, out["handler_load_ms"])
            log.info("%s load: %d/%d ok, %d 5xx, %d lost, p50 %.1f ms, p99 %.1f ms, %.1f req/s, batches %s",
                     spec.name, load.requests_ok, load.requests_sent, load.errors_5xx, load.lost,
                     load.p50_ms or float("nan"), load.p99_ms or float("nan"),
                     load.throughput_rps or 0.0, load.batch_sizes_seen)
    except ModelNotReady as e:
        out.update(ready=False, reason=e.reason, error=str(e), startup_timeout_s=e.startup_timeout_s,
                   waited_s=e.waited_s)
    except TorchServeError as e:
        out.update(ready=out.get("ready", False), error=str(e))
    else:
        ts.cleanup()
    return out


def check_ready(spec: ServerSpec, *, workdir: Optional[Path] = None) -> dict:
    """Start `spec`, record READY (and TorchServe's WorkerLoadTime), stop it: the other store form's
    start-up, measured in the same run as the served one."""
    ts = TorchServe(spec.config, spec.model_store, spec.name, models=spec.models, workdir=workdir,
                    env=spec.env)
    out: dict[str, Any] = {"models": spec.models}
    try:
        with ts:
            r = ts.readiness
            out.update(ready=True, ready_s=r.ready_s, all_workers_ready_s=r.all_ready_s,
                       worker_load_ms=r.worker_load_ms)
            log.info("%s (%s) READY in %.2f s (WorkerLoadTime %s ms)", spec.name, spec.models, r.ready_s,
                     r.worker_load_ms)
    except ModelNotReady as e:
        out.update(ready=False, reason=e.reason, error=str(e))
    except TorchServeError as e:
        out.update(ready=False, error=str(e))
    else:
        ts.cleanup()
    return out


def _settings(desc: dict) -> dict:
    keys = ("batchSize", "maxBatchDelay", "minWorkers", "maxWorkers", "responseTimeout", "startupTimeout")
    return {**{k: desc.get(k) for k in keys}, "workers": len(desc.get("workers", []))}


# --------------------------------------------------------------------------- winner vs baseline
def serve_check(winner: ServerSpec, baseline: Optional[ServerSpec], cases: list[HttpCase], *,
                task: str, atol: float, rtol: float, gate: Optional[dict] = None, requests: int, concurrency: int,
                time_cap_s: float, alternate: Optional[ServerSpec] = None,
                store_form: str = "mar", startup: Optional[dict] = None) -> dict:
    """The metrics/serve_check.json record: the winner's figures at the top level, the baseline's
    under `baseline`, `ratios` winner/baseline, and `ok` + `failures` (why the stage must fail).

    alternate: the same model in the other store form (pipeline/decide/store_form.py), READY only;
    `store_forms` records READY of both. startup: `startup_check.startup_evidence` of the
    derivation, to say what a worker killed at its startupTimeout needed."""
    w = check_server(winner, cases, task=task, atol=atol, rtol=rtol, gate=gate, requests=requests,
                     concurrency=concurrency, time_cap_s=time_cap_s)
    if w.get("reason") == "startup_timeout":
        w["startup_diagnosis"] = diagnose_missed_startup(w.get("startup_timeout_s"), w.get("waited_s"), startup)
    forms = None
    if alternate is not None:
        other = check_ready(alternate)
        forms = {"chosen": store_form,
                 store_form: {k: w.get(k) for k in ("ready", "ready_s", "all_workers_ready_s", "worker_load_ms")},
                 ("mar" if store_form == "folder" else "folder"): other}
    b = None
    if baseline is not None:
        # Same load, same run. No bad inputs (the naive handler is not expected to survive them) and
        # no parity pass (the baseline is the reference model itself; at its speed it would double
        # the stage's time).
        b = check_server(baseline, cases, task=task, atol=atol, rtol=rtol, requests=requests,
                         concurrency=concurrency, time_cap_s=time_cap_s, bad_inputs=False, parity=False)
    record = {**_flat(w), "winner": w, "baseline": _flat(b) if b else None,
              "baseline_detail": b, "ratios": _ratios(w, b), "store_form": store_form, "store_forms": forms,
              "startup_diagnosis": w.get("startup_diagnosis")}
    record["failures"] = _failures(w)
    record["ok"] = not record["failures"]
    return record


def _flat(r: dict) -> dict:
    load = r.get("load") or {}
    parity = r.get("parity") or {}
    bad = r.get("bad_inputs") or {}
    return {
        "ready": r.get("ready", False), "ready_s": r.get("ready_s"), "worker_load_ms": r.get("worker_load_ms"),
        "handler_load_ms": r.get("handler_load_ms"), "first_request_ms": r.get("first_request_ms"),
        "parity_ok": parity.get("ok", False) if "parity" in r or not r.get("ready") else None,
        "max_abs_error": parity.get("max_abs_error"),
        "requests_sent": load.get("requests_sent", 0), "requests_answered": load.get("requests_answered", 0),
        "requests_ok": load.get("requests_ok", 0), "requests_lost": load.get("lost", 0),
        "errors_5xx": load.get("errors_5xx", 0), "p50_ms": load.get("p50_ms"), "p99_ms": load.get("p99_ms"),
        "throughput_rps": load.get("throughput_rps"), "batch_sizes_seen": load.get("batch_sizes_seen", {}),
        "bad_inputs": {c["id"]: c["status"] for c in bad.get("cases", [])},
        "settings": r.get("settings"), "token_authorization": r.get("token_authorization"),
        "error": r.get("error"), "worker_peak_rss_mb": r.get("worker_peak_rss_mb"),
    }


def _ratios(w: dict, b: Optional[dict]) -> dict:
    """winner / baseline: load and p99 < 1 is better, throughput > 1 is better."""
    if not b:
        return {"load": None, "throughput": None, "p99": None}
    wl, bl = w.get("load") or {}, b.get("load") or {}

    def div(x, y):
        return x / y if x is not None and y else None
    return {"load": div(w.get("ready_s"), b.get("ready_s")),
            "throughput": div(wl.get("throughput_rps"), bl.get("throughput_rps")),
            "p99": div(wl.get("p99_ms"), bl.get("p99_ms"))}


def _failures(w: dict) -> list[str]:
    if not w.get("ready"):
        diagnosis = (w.get("startup_diagnosis") or {}).get("message")
        return [f"the model never became READY: {diagnosis + ' — ' if diagnosis else ''}"
                f"{w.get('error', 'unknown error')}"]
    out = []
    if w.get("error"):
        out.append(w["error"])
    parity = w.get("parity") or {}
    if not parity.get("ok"):
        out.append(f"HTTP parity failed (max_abs_error {parity.get('max_abs_error')}, tolerance atol "
                   f"{parity.get('atol')} rtol {parity.get('rtol')}): {parity.get('failures')}")
    load = w.get("load") or {}
    if load.get("lost") or load.get("requests_answered") != load.get("requests_sent"):
        out.append(f"{load.get('lost')} of {load.get('requests_sent')} requests were lost: {load.get('failures')}")
    if load.get("errors_5xx"):
        out.append(f"{load['errors_5xx']} requests got a 5xx under load: {load.get('failures')}")
    if load.get("requests_ok", 0) == 0:
        out.append("no request succeeded under load")
    bad = w.get("bad_inputs")
    if bad is not None and not bad.get("ok"):
        out.append(f"bad-input check failed: cases {[(c['id'], c['status']) for c in bad['cases'] if not c['ok']]}, "
                   f"valid requests alongside that failed {bad['valid_alongside_failed']}, "
                   f"worker stayed up: {bad['worker_stayed_up']}")
    return out
