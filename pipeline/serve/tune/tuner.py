"""Serving candidates in real TorchServes (pipeline/serve/server/torchserve.py), always stopped: the
`Tuner` starts servers, warms them up and puts `expected_concurrency` requests in flight for a timed
window (pipeline/serve/checks/load.py), one measurement per candidate and round."""
from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import yaml

from pipeline.decide.properties import warmup_rows
from pipeline.serve.tune.candidates import OperatingCandidate
from pipeline.serve.tune.decision import CandidateResult
from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.checks.load import run_load
from pipeline.serve.server.torchserve import ModelNotReady, TorchServe, TorchServeError, start_command_env, stop_all

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 60.0      # a slow answer in a short window is slow, not lost


@dataclass
class ServedModel:
    """A folder-form model (torch-model-archiver --archive-format no-archive) in its own store:
    each candidate rewrites its model-config.yaml before its server starts (servers run one at a
    time), so no archive is built per candidate."""
    store: Path
    name: str
    folder: str
    base_config: Path                      # config.properties from the configure stage
    base_yaml: dict                        # model-config.yaml from the configure stage

    def write_yaml(self, c: OperatingCandidate) -> None:
        cfg = yaml.safe_load(yaml.safe_dump(self.base_yaml))
        cfg.update(batchSize=c.batch_size, maxBatchDelay=c.delay_ms, minWorkers=c.workers, maxWorkers=c.workers)
        # Timeouts derived for this point (candidates.with_timeouts), not the offline point's: a larger
        # batch run past configure's responseTimeout answers 5xx.
        for key, ykey in (("response_timeout_s", "responseTimeout"), ("startup_timeout_s", "startupTimeout")):
            if key in c.timeouts:
                cfg[ykey] = int(c.timeouts[key]["value"])
        handler = cfg.setdefault("handler", {})
        handler["threads"] = c.threads
        # Rows per model call (pipeline/decide/rows.py): the handler's own setting only where it
        # differs from batchSize (a request of many rows); the warm-up at warmup_rows (1 on a CPU).
        handler.pop("batch_rows", None)
        if c.rows != c.batch_size:
            handler["batch_rows"] = c.rows
        if "warmup_batch_size" in handler:
            handler["warmup_batch_size"] = warmup_rows(handler.get("device"), c.rows)
        (self.store / self.folder / "model-config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


class Tuner:
    """Serves candidates of one model in real TorchServes, always stopped.

    side_by_side (when the host's memory holds every candidate's workers at once): one server per
    candidate, all up together, measured one at a time, so each pays one start whatever the rounds.
    They stay up between calls (`release` stops those no longer needed, all at once, so their JVMs'
    shutdowns overlap; `close` the rest): an undecided candidate's extra round and the chosen
    point's capacity measurement are served by the server it already has (a 2 GB model's start and
    stop took ~9 s each). Otherwise candidates that differ only in model settings (batch, delay, workers, threads) share
    ONE server: the model is unregistered and registered again through the management API (enabled
    only in the tuner's own servers), a worker start per measurement instead of a JVM start; and
    frontend settings (`fresh=True`) get a fresh server per measurement."""

    def __init__(self, model: ServedModel, cases: list[HttpCase], *, concurrency: int, measure_s: float,
                 warmup_requests: int, workroot: Optional[Path] = None, progress: Optional[Callable] = None,
                 side_by_side: bool = False):
        self.model, self.cases = model, cases
        self.side_by_side = side_by_side
        self.concurrency, self.measure_s, self.warmup_requests = concurrency, measure_s, warmup_requests
        self.workroot = Path(workroot) if workroot else Path(tempfile.mkdtemp(prefix="tune-"))
        self.progress = progress or (lambda: None)
        self.starts = 0
        self.registrations = 0
        self.start_s: list[float] = []            # what one server start (to READY) cost
        self.reused = 0                           # measurements served by a side-by-side server already up
        self._live: dict[tuple, TorchServe] = {}  # side by side: candidate key -> its server, up

    def _server(self, c: OperatingCandidate, env_threads: Optional[int] = None) -> TorchServe:
        self.model.write_yaml(c)
        self.starts += 1
        workdir = self.workroot / f"server-{self.starts}"
        workdir.mkdir(parents=True)
        return TorchServe(self.model.base_config, self.model.store, self.model.name,
                          models=f"{self.model.name}={self.model.folder}", workdir=workdir,
                          extra_properties={"default_workers_per_model": c.workers, "enable_model_api": True,
                                            **c.frontend},
                          env=start_command_env(env_threads or c.threads))

    def _register(self, ts: TorchServe, c: OperatingCandidate, *, retry: bool = False) -> float:
        """Replace the served model by `c` (unregister, rewrite its yaml, register synchronously);
        returns the seconds until its workers were READY."""
        name = self.model.name
        t0 = time.monotonic()
        r = ts.api.management("DELETE", f"/models/{name}", timeout_s=60)
        if r.status == 404 and retry:
            pass                # a failed attempt's registration left nothing to unregister
        elif r.status != 200:
            raise TorchServeError(f"unregistering {name} → {r.status}: {r.body[:300]!r}")
        while ts.api.management("GET", f"/models/{name}", timeout_s=10).status == 200 and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        self.model.write_yaml(c)
        # Threads per worker come from the yaml (handler.threads: the runtimes set intra-op threads
        # from it); the server's thread variables only cap libraries that would spawn more.
        r = ts.api.management("POST", f"/models?url={self.model.folder}&model_name={name}&batch_size={c.batch_size}"
                                  f"&max_batch_delay={c.delay_ms}&initial_workers={c.workers}&synchronous=true",
                          timeout_s=300)
        if r.status != 200:
            raise TorchServeError(f"registering {name} ({c.describe()}) → {r.status}: {r.body[:300]!r}")
        self.registrations += 1
        desc = ts.api.describe_model()
        if len([w for w in desc.get("workers", []) if w.get("status") == "READY"]) != c.workers:
            raise TorchServeError(f"{c.describe()}: workers after registration {desc.get('workers')}")
        return time.monotonic() - t0

    def _load(self, ts: TorchServe, c: OperatingCandidate, round_no: int, ready_s: float, levels: list[int]) -> list[dict]:
        out = []
        run_load(ts, self.cases, self.warmup_requests, max(levels), 60.0)
        for conc in levels:
            load = run_load(ts, self.cases, 10 ** 9, conc, self.measure_s, request_timeout_s=REQUEST_TIMEOUT_S)
            ok = load.requests_ok > 0 and load.errors_5xx == 0 and load.lost == 0
            out.append({"round": round_no, "ok": ok, "concurrency": conc, "ready_s": ready_s,
                        "throughput_rps": load.throughput_rps, "p50_ms": load.p50_ms, "p99_ms": load.p99_ms,
                        "mean_ms": load.mean_ms, "requests_ok": load.requests_ok,
                        "errors_5xx": load.errors_5xx, "lost": load.lost,
                        "batch_sizes_seen": load.batch_sizes_seen, "mean_batch_size": load.mean_batch_size,
                        "error": None if ok else f"{load.errors_5xx} 5xx, {load.lost} lost: {load.failures[:2]}"})
        return out

    def measure(self, c: OperatingCandidate, round_no: int, concurrencies: Optional[list[int]] = None) -> list[dict]:
        """`c` in a fresh server: start, warm up, `measure_s` of load at each concurrency (default: the
        expected one), stop. Never raises for a candidate that fails: the record says why."""
        levels = concurrencies or [self.concurrency]
        ts = self._server(c)
        try:
            with ts:
                self.start_s.append(ts.readiness.ready_s)
                out = self._load(ts, c, round_no, ts.readiness.ready_s, levels)
        except (ModelNotReady, TorchServeError) as e:
            out = [_failed_round(round_no, levels[0], e)]
        finally:
            shutil.rmtree(ts.workdir, ignore_errors=True)
        self.progress()
        return out

    def run_rounds(self, candidates: list[OperatingCandidate], rounds: int, *, fresh: bool = False) -> list[CandidateResult]:
        """Every candidate once per round, the order rotated each round (no candidate always first).
        fresh: a new server per measurement (frontend settings); else candidates with the same
        frontend and thread count share one server, re-registering the model between them."""
        results = [CandidateResult(c) for c in candidates]
        n = len(candidates)
        order = [(rnd, (k + rnd) % n) for rnd in range(rounds) for k in range(n)]
        if self.side_by_side:
            return self._run_side_by_side(candidates, results, order)
        shareable = not fresh and len({tuple(sorted(c.frontend.items())) for c in candidates}) == 1
        if not shareable:
            for rnd, i in order:
                results[i].rounds.extend(self.measure(candidates[i], rnd + 1))
            return results
        return self._run_on_one_server(candidates, results, order)

    def _run_on_one_server(self, candidates: list[OperatingCandidate], results: list[CandidateResult],
                           order: list[tuple[int, int]]) -> list[CandidateResult]:
        """One server started with the first candidate in `order` (and the most threads any of them
        uses), the model re-registered as each next candidate before its measurement."""
        first = candidates[order[0][1]]
        ts = self._server(first, env_threads=max(c.threads for c in candidates))
        try:
            with ts:
                self.start_s.append(ts.readiness.ready_s)
                for k, (rnd, i) in enumerate(order):
                    # the first measurement is of the model the server started with: no registration
                    results[i].rounds.extend(self._measure_registered(ts, candidates[i], rnd + 1, started=k == 0))
                    self.progress()
        except (ModelNotReady, TorchServeError) as e:
            for r in results:
                if not r.rounds:
                    r.rounds.append(_failed_round(1, self.concurrency, e))
        finally:
            shutil.rmtree(ts.workdir, ignore_errors=True)
        return results

    def _measure_registered(self, ts: TorchServe, c: OperatingCandidate, round_no: int, *, started: bool) -> list[dict]:
        """One measurement of `c` on the shared server, registered first unless the server `started`
        with it. A measurement that raised (a registration or connection error, not a slow or failing
        candidate: those are measured) is made once more on a fresh registration, so one transient
        error does not decide the contest alone."""
        try:
            ready_s = ts.readiness.ready_s if started else self._register(ts, c)
            return self._load(ts, c, round_no, ready_s, [self.concurrency])
        except (TorchServeError, OSError) as e:
            log.warning("%s, round %d, attempt 1: %s", c.name, round_no, e)
            first_error = str(e)[:2000]
        try:
            ready_s = self._register(ts, c, retry=True)
            return [dict(m, retried_after=first_error) for m in self._load(ts, c, round_no, ready_s, [self.concurrency])]
        except (TorchServeError, OSError) as e:
            log.warning("%s, round %d, attempt 2: %s", c.name, round_no, e)
            return [_failed_round(round_no, self.concurrency, e, first_error=first_error)]

    def _run_side_by_side(self, candidates: list[OperatingCandidate], results: list[CandidateResult],
                          order: list[tuple[int, int]]) -> list[CandidateResult]:
        """One server per candidate, all started first and kept up (idle ones cost memory, not
        CPU), measured one at a time in `order`: a server start per candidate instead of one per
        measurement. A candidate whose server is already up (an earlier call's) is served by it.
        The servers stay up (`release`, `close`); on an error here they are all stopped."""
        servers: list[Optional[TorchServe]] = []
        try:
            for i, c in enumerate(candidates):
                ts = self._live.get(c.key())
                if ts is not None:
                    self.reused += 1
                    servers.append(ts)
                    continue
                ts = self._server(c)
                try:
                    ts.start()
                    self.start_s.append(ts.readiness.ready_s)
                    self._live[c.key()] = ts
                    servers.append(ts)
                except (ModelNotReady, TorchServeError) as e:
                    servers.append(None)
                    shutil.rmtree(ts.workdir, ignore_errors=True)
                    results[i].rounds.append(_failed_round(1, self.concurrency, e))
            for rnd, i in order:
                ts = servers[i]
                if ts is not None:
                    try:
                        results[i].rounds.extend(self._load(ts, candidates[i], rnd + 1, ts.readiness.ready_s,
                                                            [self.concurrency]))
                    except (TorchServeError, OSError) as e:
                        results[i].rounds.append(_failed_round(rnd + 1, self.concurrency, e))
                self.progress()
        except BaseException:
            self.close()
            raise
        return results

    def release(self, keep: tuple = ()) -> None:
        """Stop the side-by-side servers of every candidate not in `keep`, all at once."""
        keys = {c.key() for c in keep}
        gone = [k for k in self._live if k not in keys]
        servers = [self._live.pop(k) for k in gone]
        stop_all(servers)
        for ts in servers:
            shutil.rmtree(ts.workdir, ignore_errors=True)

    def close(self) -> None:
        """Stop every server still up, all at once."""
        self.release()

    def capacity(self, c: OperatingCandidate, slo_ms: float) -> dict:
        """The in-flight load one replica takes within the SLO: the chosen point measured at
        halving concurrencies (one server) until its p99 fits."""
        levels, n = [], self.concurrency // 2
        while n >= 1:
            levels.append(n)
            n //= 2
        if not levels:
            return {"levels": [], "inflight_within_slo": None}
        ts = self._live.get(c.key())
        if ts is not None:
            # The chosen point's side-by-side server is up: measured there, no new start.
            self.reused += 1
            try:
                measured = self._load(ts, c, 0, ts.readiness.ready_s, levels)
            except (TorchServeError, OSError) as e:
                measured = [_failed_round(0, levels[0], e)]
            self.progress()
        else:
            measured = self.measure(c, 0, levels)
        fit = [m for m in measured if m.get("ok") and m["p99_ms"] is not None and m["p99_ms"] <= slo_ms]
        return {"levels": [{k: m.get(k) for k in ("concurrency", "ok", "p99_ms", "p50_ms", "throughput_rps",
                                                   "batch_sizes_seen", "error")} for m in measured],
                "inflight_within_slo": max((m["concurrency"] for m in fit), default=None)}


def _failed_round(round_no: int, concurrency: int, error: Exception, first_error: Optional[str] = None) -> dict:
    """A measurement that could not be made: the record says why (the error, bounded; and the
    first attempt's, when it was tried twice)."""
    out = {"round": round_no, "ok": False, "concurrency": concurrency, "error": str(error)[:2000]}
    if first_error is not None:
        out["retried_after"] = first_error
    return out
