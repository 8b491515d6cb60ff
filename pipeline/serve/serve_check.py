"""Prove a .mar inside a real TorchServe: readiness, HTTP parity, bad input, bounded load, baseline.

`check_server` runs every check against one server (started by `pipeline.serve.server.torchserve.TorchServe`
in its own working dir, always stopped); `serve_check` runs the winner and then the baseline under
the same load in the same run and computes the ratios (winner / baseline). The checks themselves:
pipeline/serve/checks/parity.py, bad_input.py and load.py.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from pipeline.serve.server import jvm_jit
from pipeline.serve.checks.bad_input import bad_input_cases, check_bad_inputs, max_request_size
from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.checks.load import LoadResult, run_load
from pipeline.serve.checks.parity import check_parity
from pipeline.serve.server.startup_check import diagnose_missed_startup
from pipeline.serve.server.interface import Server
from pipeline.serve.server.torchserve import ModelNotReady, TorchServe, TorchServeError

log = logging.getLogger(__name__)

# How long a request of the measured load may wait for its answer: TorchServe's default
# responseTimeout, which the naive baseline runs with (a GB-sized model's baseline answers in ~10 s
# under 16 clients); the load's time cap only stops new requests.
ANSWER_WAIT_S = 120.0
# The warm-up's windows, and how close the last WARMUP_SETTLED_WINDOWS windows' rates must be to call it
# warm (two could agree on a step of a server still speeding up).
WARMUP_WINDOW_S = 1.0
WARMUP_SETTLED = 0.05
WARMUP_SETTLED_WINDOWS = 3
# Warm also means the frontend's JIT compilers have gone quiet (pipeline/serve/server/jvm_jit.py): at most this
# share of a core over the last WARMUP_SETTLED_WINDOWS windows. While they are busier, the warm-up may run on to
# WARMUP_JIT_EXTENSION x its cap; a server whose compilers are quiet stops at the cap as before.
WARMUP_JIT_QUIET_CORES = 0.1
WARMUP_JIT_EXTENSION = 3.0
# Where the frontend's own request work is a notable share of the host (at least WARMUP_BUSY_FRONTEND_CORES
# of a core over the judged windows: a small model at hundreds of requests/s, a do-nothing ceiling), code
# still being compiled sits on every request's path, and C2's late bursts of 0.05-0.12 of a core cost
# its rate ~15%: its compilers must be quieter (WARMUP_BUSY_JIT_QUIET_CORES), within WARMUP_BUSY_JIT_EXTENSION
# x the cap. A model that dominates (tens of requests/s) keeps the looser rule.
WARMUP_BUSY_FRONTEND_CORES = 0.05
WARMUP_BUSY_JIT_QUIET_CORES = 0.03
WARMUP_BUSY_JIT_EXTENSION = 5.0


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


# --------------------------------------------------------------------------- one server
def check_server(spec: ServerSpec, cases: list[HttpCase], *, task: str, atol: float, rtol: float,
                 gate: Optional[dict] = None, requests: int, concurrency: int, time_cap_s: float, bad_inputs: bool = True,
                 parity: bool = True, workdir: Optional[Path] = None, warmup_s: float = 0.0,
                 server: Any = None) -> dict:
    """Start `spec` in isolation, run every check, stop it (always). Never raises for a check that
    fails: the figures say what failed (`ready: false` + `error` when it never became READY).
    warmup_s: seconds of the same load before the measured one, not counted: a fresh server's first
    thousands of requests run through the JVM's interpreter and the model's first calls.
    server: an unstarted server of another kind to run the same checks in (a RayServe,
    pipeline/serve/server/ray_server.py); default a TorchServe of `spec`."""
    ts = server if server is not None else TorchServe(spec.config, spec.model_store, spec.name, models=spec.models,
                                                      workdir=workdir, env=spec.env)
    out: dict[str, Any] = {"model": spec.name, "server": "torchserve" if server is None else "ray-serve",
                           "mar": str(spec.model_store / (spec.mar or spec.name + ".mar")),
                           "config": str(spec.config) if spec.config else None, "server_dir": str(ts.workdir)}
    try:
        with ts:
            # `out` fills as the checks go: a server error midway keeps what was measured before it.
            _record_ready(ts, spec, cases[0], out)
            if parity:
                out["parity"] = check_parity(ts, cases, atol, rtol, concurrency, gate=gate, task=task)
                log.info("%s parity ok=%s max_abs_error=%s", spec.name, out["parity"]["ok"],
                         out["parity"]["max_abs_error"])
            if bad_inputs:
                bad = bad_input_cases(task, cases, max_request_size(ts))
                out["bad_inputs"] = check_bad_inputs(ts, bad, cases, atol, rtol, gate=gate, task=task)
                log.info("%s bad inputs: %s", spec.name,
                         {c["id"]: c["status"] for c in out["bad_inputs"]["cases"]})
            if warmup_s > 0:
                out["warmup"] = _warmup(ts, cases, concurrency, warmup_s)
            quiet = (out.get("warmup") or {}).get("jit_quiet_cores", WARMUP_JIT_QUIET_CORES)
            load, out["load_jit_compiler_cores"], out["load_discarded"] = _measured_load(
                ts, cases, requests, concurrency, time_cap_s, quiet)
            _record_load(ts, spec, load, out)
    except ModelNotReady as e:
        out.update(ready=False, reason=e.reason, error=str(e), startup_timeout_s=e.startup_timeout_s,
                   waited_s=e.waited_s)
    except TorchServeError as e:
        out.update(ready=out.get("ready", False), error=str(e))
    else:
        ts.cleanup()
    return out


def _measured_load(ts: Server, cases: list[HttpCase], requests: int, concurrency: int, time_cap_s: float,
                   quiet_cores: float) -> tuple[LoadResult, Optional[float], Optional[dict]]:
    """The measured load, and the JIT compilers' share of a core during it. A load during which they
    took more than `quiet_cores` (the warm-up's own criterion) ran beside a late compiler burst on the
    request path, not at the server's steady state: it is measured once more, and the first one's
    figures stay in the record. → (load, compilers' cores, the discarded load's figures or None)."""
    def once() -> tuple[LoadResult, Optional[float]]:
        c0 = jvm_jit.compiler_cpu_s(ts.java_pid)
        load = run_load(ts, cases, requests, concurrency, time_cap_s,
                        request_timeout_s=max(time_cap_s, ANSWER_WAIT_S))
        c1 = jvm_jit.compiler_cpu_s(ts.java_pid)
        return load, (round((c1 - c0) / load.wall_s, 3) if None not in (c0, c1) and load.wall_s else None)

    load, jit = once()
    if jit is None or jit <= quiet_cores or load.errors_5xx or load.lost:
        return load, jit, None
    discarded = {"throughput_rps": load.throughput_rps, "p99_ms": load.p99_ms, "jit_compiler_cores": jit,
                 "quiet_cores": quiet_cores}
    log.info("measured load beside a compiler burst (%.3f of a core > %.3f): measured again", jit, quiet_cores)
    load, jit = once()
    return load, jit, discarded


def _warmup(ts: Server, cases: list[HttpCase], concurrency: int, seconds: float) -> dict:
    """The same load in windows of WARMUP_WINDOW_S until the last WARMUP_SETTLED_WINDOWS windows' rates
    are within WARMUP_SETTLED of each other (the server has stopped speeding up) and the JVM's JIT
    compilers used at most WARMUP_JIT_QUIET_CORES over those windows, or `seconds` have passed (up to
    WARMUP_JIT_EXTENSION x `seconds` while the compilers are still busy); at most WARMUP_BUSY_JIT_QUIET_CORES,
    within WARMUP_BUSY_JIT_EXTENSION x, while the frontend's own work is WARMUP_BUSY_FRONTEND_CORES or more.
    A window lasts until its requests are answered: no window is started that would end past the cap
    by the longest one so far (a 2 GB naive baseline's window, 16 requests of ~5 s queued behind two
    workers, took ~6 s, and three of them 19 s against a 10 s cap); the first always runs."""
    t0, windows, jit, frontend, longest = time.perf_counter(), [], [], [], 0.0
    while True:
        # Its requests are waited for: one abandoned would still be queued when the measured load starts.
        t_w = time.perf_counter()
        c0, p0 = jvm_jit.compiler_cpu_s(ts.java_pid), jvm_jit.process_cpu_s(ts.java_pid)
        w = run_load(ts, cases, 10 ** 9, concurrency, WARMUP_WINDOW_S, request_timeout_s=ANSWER_WAIT_S)
        c1, p1 = jvm_jit.compiler_cpu_s(ts.java_pid), jvm_jit.process_cpu_s(ts.java_pid)
        wall = time.perf_counter() - t_w
        longest = max(longest, wall)
        windows.append(w.throughput_rps or 0.0)
        jit.append(None if c0 is None or c1 is None else (c1 - c0) / wall)
        frontend.append(None if None in (c0, c1, p0, p1) else max(0.0, (p1 - p0) - (c1 - c0)) / wall)
        last = windows[-WARMUP_SETTLED_WINDOWS:]
        settled = len(last) == WARMUP_SETTLED_WINDOWS and min(last) > 0 and max(last) / min(last) - 1 <= WARMUP_SETTLED
        # Over the windows the rates are judged on: a compiler is bursty, one window may be a lull.
        recent = [x for x in jit[-WARMUP_SETTLED_WINDOWS:] if x is not None]
        work = [x for x in frontend[-WARMUP_SETTLED_WINDOWS:] if x is not None]
        busy = bool(work) and sum(work) / len(work) >= WARMUP_BUSY_FRONTEND_CORES
        quiet_cores, extension = ((WARMUP_BUSY_JIT_QUIET_CORES, WARMUP_BUSY_JIT_EXTENSION) if busy
                                  else (WARMUP_JIT_QUIET_CORES, WARMUP_JIT_EXTENSION))
        jit_quiet = not recent or sum(recent) / len(recent) <= quiet_cores
        ends_at = time.perf_counter() - t0 + longest
        past_cap = ends_at > seconds and (jit_quiet or ends_at > seconds * extension)
        if (settled and jit_quiet) or past_cap or w.errors_5xx or w.lost:
            break
    return {"seconds": round(time.perf_counter() - t0, 2), "cap_s": seconds, "settled": settled,
            "jit_quiet": jit_quiet, "jit_quiet_cores": quiet_cores, "frontend_busy": busy,
            "windows_rps": [round(x, 1) for x in windows],
            "jit_compiler_cores": [None if x is None else round(x, 3) for x in jit],
            "frontend_cores": [None if x is None else round(x, 3) for x in frontend],
            "longest_window_s": round(longest, 2),
            "errors_5xx": w.errors_5xx, "lost": w.lost}


def _record_ready(ts: Server, spec: ServerSpec, first_case: HttpCase, out: dict) -> None:
    """READY, the settings the server reports and the first request into `out`."""
    ready = ts.readiness
    out.update(ready=True, ready_s=ready.ready_s, all_workers_ready_s=ready.all_ready_s,
               worker_load_ms=ready.worker_load_ms, settings=_settings(ready.description),
               token_authorization=ts.api.inference_key() is not None)
    log.info("%s READY in %.2f s (WorkerLoadTime %s ms), %d worker(s)", spec.name, ready.ready_s,
             ready.worker_load_ms, len(ready.description.get("workers", [])))
    first = ts.api.predict(first_case.body, first_case.content_type)
    out["first_request_ms"] = first.ms
    out["first_request_status"] = first.status


def _record_load(ts: Server, spec: ServerSpec, load: LoadResult, out: dict) -> None:
    """The load's figures, then the workers' peak memory and the handler's load phases into `out`."""
    out["load"] = asdict(load)
    # Peak over the worker's life so far: its load, the checks and the load above.
    rss = ts.worker_peak_rss_mb()
    out["worker_peak_rss_mb"] = max((v for v in rss.values() if v is not None), default=None)
    # Read last: the frontend copies the worker's log lines asynchronously.
    out["handler_load_ms"] = ts.log.handler_load_ms()     # inside WorkerLoadTime: the handler's own phases
    out["handler_profile"] = ts.log.handler_profile()     # per request under the load: decode, collate, model, respond
    log.info("%s handler load phases (slowest worker): %s", spec.name, out["handler_load_ms"])
    log.info("%s load: %d/%d ok, %d 5xx, %d lost, p50 %.1f ms, p99 %.1f ms, %.1f req/s, batches %s",
             spec.name, load.requests_ok, load.requests_sent, load.errors_5xx, load.lost,
             load.p50_ms or float("nan"), load.p99_ms or float("nan"),
             load.throughput_rps or 0.0, load.batch_sizes_seen)


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
def serve_check(winner: ServerSpec, baseline: ServerSpec | Callable[[], Optional[ServerSpec]] | None,
                cases: list[HttpCase], *,
                task: str, atol: float, rtol: float, gate: Optional[dict] = None, requests: int, concurrency: int,
                time_cap_s: float, alternate: Optional[ServerSpec] = None,
                store_form: str = "mar", startup: Optional[dict] = None, warmup_s: float = 0.0) -> dict:
    """The metrics/serve_check.json record: the winner's figures at the top level, the baseline's
    under `baseline`, `ratios` winner/baseline, and `ok` + `failures` (why the stage must fail).

    baseline: its spec, or a callable returning it, called once the winner's starts are measured
    (the stage packs the references' archives there). alternate: the same model in the other store form (pipeline/decide/store_form.py), READY only;
    `store_forms` records READY of both. startup: `startup_check.startup_evidence` of the
    derivation, to say what a worker killed at its startupTimeout needed."""
    w = check_server(winner, cases, task=task, atol=atol, rtol=rtol, gate=gate, requests=requests,
                     concurrency=concurrency, time_cap_s=time_cap_s, warmup_s=warmup_s)
    if w.get("reason") == "startup_timeout":
        w["startup_diagnosis"] = diagnose_missed_startup(w.get("startup_timeout_s"), w.get("waited_s"), startup)
    forms = None
    if alternate is not None:
        other = check_ready(alternate)
        forms = {"chosen": store_form,
                 store_form: {k: w.get(k) for k in ("ready", "ready_s", "all_workers_ready_s", "worker_load_ms")},
                 ("mar" if store_form == "folder" else "folder"): other}
    b = None
    if callable(baseline):
        baseline = baseline()
    if baseline is not None:
        # Same load, same run. No bad inputs (the naive handler is not expected to survive them) and
        # no parity pass (the baseline is the reference model itself; at its speed it would double
        # the stage's time).
        b = check_server(baseline, cases, task=task, atol=atol, rtol=rtol, requests=requests,
                         concurrency=concurrency, time_cap_s=time_cap_s, bad_inputs=False, parity=False,
                         warmup_s=warmup_s)
    record = {**_flat(w), "winner": w, "baseline": _flat(b) if b else None,
              "baseline_detail": b, "ratios": _ratios(w, b), "store_form": store_form, "store_forms": forms,
              "startup_diagnosis": w.get("startup_diagnosis")}
    record["failures"] = _failures(w)
    record["ok"] = not record["failures"]
    return record


def with_baseline(record: dict, baseline: Optional[dict]) -> dict:
    """`record` (serve_check's) with the naive baseline's figures and the winner / baseline ratios,
    from the baseline's check_server record as the references stage measured it (None: none)."""
    record.update(baseline=_flat(baseline) if baseline else None, baseline_detail=baseline,
                  ratios=_ratios(record["winner"], baseline))
    return record


def _flat(r: dict) -> dict:
    load = r.get("load") or {}
    parity = r.get("parity") or {}
    bad = r.get("bad_inputs") or {}
    return {
        "ready": r.get("ready", False), "ready_s": r.get("ready_s"), "worker_load_ms": r.get("worker_load_ms"),
        "handler_load_ms": r.get("handler_load_ms"), "handler_profile": r.get("handler_profile"),
        "first_request_ms": r.get("first_request_ms"),
        "parity_ok": parity.get("ok", False) if "parity" in r or not r.get("ready") else None,
        "max_abs_error": parity.get("max_abs_error"),
        **({"parity_embedding": parity["embedding"]} if parity.get("embedding") else {}),
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
