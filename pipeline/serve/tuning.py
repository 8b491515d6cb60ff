"""Tune and certify the served operating point in a real TorchServe, under the expected load.

The offline curve (pipeline/decide/serve_config.py) times the model call only. The server adds what that
model leaves out: queueing of `serve.expected_concurrency` requests in flight, IPC, JSON,
tokenization and a Java frontend on the same cores. So the configure stage's choice is a
*proposal*; this module serves a few candidate operating points taken from the same curve and
keeps the one that serves best, with the evidence:

1. candidates: the offline choice, the larger measured batch sizes up to what the load fills
   (each with its own delay), and the other workers × threads layout on the same cores;
2. each is served in a fresh TorchServe (pipeline/serve/torchserve.py) with `expected_concurrency`
   requests kept in flight (pipeline/serve_check.run_load, the task's golden HTTP cases), candidates
   interleaved round by round (order rotated) so host drift hits them all alike;
3. the decision: highest served throughput whose served p99 <= SLO (objective latency: lowest
   served p99); a challenger replaces the offline choice only by more than the measured noise
   (the rounds' spread, at least serve.min_batch_gain);
4. frontend settings (system-metrics collector, netty thread counts) measured the same way on the
   chosen point and kept only when they help beyond the noise;
5. the SLO verdict comes from the served p99; when nothing meets the SLO it says why in numbers:
   the best served p99 and throughput, Little's-law floor in-flight / max throughput, and the
   in-flight load one replica takes within the SLO (measured at lower concurrency), hence
   replicas = ceil(expected / that).

Before all that, `variant_contest` serves the variants selection found within the benchmark's noise
of its winner (each at its own offline point): a tie offline is decided by the server, and another
variant replaces the winner only by serving better beyond the rounds' noise.

Pure decision logic (`decide`, `slo_verdict`, `candidates_from_curve`) is separate from serving
(`Tuner`), so both are tested on their own.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from pipeline.serve.serve_check import HttpCase, run_load
from pipeline.decide.serve_config import (CurvePoint, batch_delay_ms, choose_operating_point, fill_limit)
from pipeline.serve.torchserve import ModelNotReady, TorchServe, TorchServeError

log = logging.getLogger(__name__)

# The settings a candidate varies, as derivation.json keys (pipeline/decide/serve_config.py).
TUNED_KEYS = ("batch_size", "max_batch_delay_ms", "workers", "threads_per_worker")

# Frontend settings tried on the chosen point (config.properties keys; TorchServe 0.12 defaults:
# system metrics collected every minute by a Python subprocess, netty threads = logical cores).
FRONTEND_CANDIDATES: tuple[tuple[str, dict], ...] = (
    ("no system metrics", {"disable_system_metrics": True}),
    ("1 netty thread each", {"number_of_netty_threads": 1, "netty_client_threads": 1}),
)


REQUEST_TIMEOUT_S = 60.0      # a slow answer in a short window is slow, not lost


class TuningError(RuntimeError):
    """Tuning cannot run or cannot decide; the message says what is missing."""


# --------------------------------------------------------------------------- candidates
@dataclass(frozen=True)
class OperatingCandidate:
    name: str
    batch_size: int
    delay_ms: int
    workers: int
    threads: int
    origin: str                                   # offline | larger batch | layout | frontend
    frontend: dict = field(default_factory=dict)  # extra config.properties settings
    predicted: Optional[dict] = None              # offline figures {request_p99_ms, throughput_rps} or None

    def key(self) -> tuple:
        return (self.batch_size, self.delay_ms, self.workers, self.threads, tuple(sorted(self.frontend.items())))

    def settings(self) -> dict:
        return {"batch_size": self.batch_size, "max_batch_delay_ms": self.delay_ms, "workers": self.workers,
                "threads_per_worker": self.threads, **({"frontend": dict(self.frontend)} if self.frontend else {})}

    def describe(self) -> str:
        fe = "".join(f", {k}={v}" for k, v in sorted(self.frontend.items()))
        return f"batch {self.batch_size}, delay {self.delay_ms} ms, {self.workers}×{self.threads}{fe}"


def _prediction(p: CurvePoint, delay: int, workers: int, threads: int, bench_threads: int) -> Optional[dict]:
    """What the offline model predicts for the point: per-request p99 = batch p99 + delay, throughput
    = workers × per-process samples/s. Only for the thread count the curve was measured with."""
    if threads != bench_threads:
        return None
    return {"request_p99_ms": round(p.p99_ms + delay, 3), "throughput_rps": round(p.throughput_sps * workers, 1)}


def candidates_from_curve(curve: list[CurvePoint], offline: dict, *, slo_ms: float, headroom_share: float,
                          expected_concurrency: int, cores: int, bench_threads: int,
                          overridden: frozenset = frozenset(), max_candidates: int = 5) -> list[OperatingCandidate]:
    """The offline choice first, then larger measured batches up to the fill bound (each with the
    delay the offline formula gives it), then the other workers × threads layout on the same cores
    with its own offline batch choice. Settings under serve.overrides stay as overridden."""
    by_batch = {p.batch_size: p for p in curve}
    w0, t0 = int(offline["workers"]), int(offline["threads_per_worker"])
    b0, d0 = int(offline["batch_size"]), int(offline["max_batch_delay_ms"])
    p0 = by_batch.get(b0)
    out = [OperatingCandidate("offline choice", b0, d0, w0, t0, "offline",
                              predicted=_prediction(p0, d0, w0, t0, bench_threads) if p0 else None)]

    def add(c: OperatingCandidate) -> None:
        if c.key() not in {o.key() for o in out} and len(out) < max_candidates:
            out.append(c)

    if not {"batch_size", "max_batch_delay_ms"} & overridden:
        bound = fill_limit(expected_concurrency, w0)
        for p in curve:
            if b0 < p.batch_size <= bound:
                d, _ = batch_delay_ms(p, slo_ms, headroom_share, w0)
                add(OperatingCandidate(f"batch {p.batch_size}", p.batch_size, d, w0, t0, "larger batch",
                                       predicted=_prediction(p, d, w0, t0, bench_threads)))
    if "max_batch_delay_ms" not in overridden and b0 > 1 and d0 > 2:
        # The same batch with half the wait: under a load that fills batches, a long delay only adds latency.
        add(OperatingCandidate(f"batch {b0}, delay {d0 // 2} ms", b0, d0 // 2, w0, t0, "shorter delay",
                               predicted=_prediction(p0, d0 // 2, w0, t0, bench_threads) if p0 else None))
    if not {"workers", "threads_per_worker"} & overridden and cores >= 2 and w0 * t0 == cores:
        # The other extreme of the same cores: one worker with every core, or one worker per core.
        w1, t1 = (1, cores) if w0 > 1 else (cores, 1)
        bound = fill_limit(expected_concurrency, w1)
        if "batch_size" in overridden:
            b1, d1 = b0, d0
        else:
            op = choose_operating_point(curve, slo_ms, workers=w1, max_batch=bound, headroom_share=headroom_share)
            b1, d1 = op.batch_size, op.delay_ms
        p1 = by_batch.get(b1)
        add(OperatingCandidate(f"{w1} worker(s) × {t1} thread(s)", b1, d1, w1, t1, "layout",
                               predicted=_prediction(p1, d1, w1, t1, bench_threads) if p1 else None))
    return out


def frontend_candidates(base: OperatingCandidate) -> list[OperatingCandidate]:
    """The chosen point with TorchServe's default frontend, then with each frontend alternative."""
    plain = dataclasses.replace(base, frontend={})
    return [plain] + [dataclasses.replace(base, name=f"{base.name} + {label}", origin="frontend",
                                          frontend={**base.frontend, **settings})
                      for label, settings in FRONTEND_CANDIDATES]


# The frontend alternatives are served only when the server loses at least this share of the
# model's own throughput (the benchmark's prediction for the chosen point): where requests spend
# their time in the model (bert-large: 34.1 req/s served of 34.3 predicted) no frontend setting can
# give more, and six more server starts of a GB-sized model cost a minute; MiniLM serves ~300 of
# ~560 req/s, and there they are worth measuring.
FRONTEND_MIN_LOSS = 0.2


def frontend_worth_tuning(chosen: "CandidateResult") -> tuple[bool, str]:
    """(serve the frontend alternatives?, why), from the chosen point's served vs predicted throughput."""
    predicted = (chosen.candidate.predicted or {}).get("throughput_rps")
    served = chosen.throughput
    if not predicted or served is None:
        return True, "no offline prediction for the chosen point to compare its served throughput with"
    loss = 1.0 - served / predicted
    figures = (f"{chosen.candidate.name} served {served:.1f} req/s of the {predicted:.1f} the model alone "
               f"gives (benchmark)")
    if loss >= FRONTEND_MIN_LOSS:
        return True, f"{figures}: the server loses {loss:.0%} outside the model"
    return False, (f"{figures}: the server loses {max(loss, 0.0):.0%} < {FRONTEND_MIN_LOSS:.0%} outside the model, "
                   f"so no frontend setting can add throughput; not served")


# --------------------------------------------------------------------------- results and decisions
@dataclass
class CandidateResult:
    candidate: OperatingCandidate
    rounds: list[dict] = field(default_factory=list)   # one measurement per round (see Tuner.measure)

    def _ok_rounds(self) -> list[dict]:
        return [r for r in self.rounds if r.get("ok")]

    @property
    def served(self) -> bool:
        return bool(self._ok_rounds()) and len(self._ok_rounds()) == len(self.rounds)

    def _mean(self, key: str) -> Optional[float]:
        vals = [r[key] for r in self._ok_rounds() if r.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    @property
    def throughput(self) -> Optional[float]:
        return self._mean("throughput_rps")

    @property
    def p99(self) -> Optional[float]:
        return self._mean("p99_ms")

    def spread(self, key: str) -> float:
        """Two standard errors of the rounds' mean, relative to it: how far the mean may be off. For
        2 rounds this is exactly (max - min) / mean; unlike the range it shrinks as rounds are added,
        which is what lets an undecided comparison be settled by serving more rounds."""
        vals = [r[key] for r in self._ok_rounds() if r.get(key) is not None]
        if len(vals) < 2 or not statistics.fmean(vals):
            return 0.0
        return 2 * statistics.stdev(vals) / math.sqrt(len(vals)) / statistics.fmean(vals)

    def batches_formed(self) -> dict:
        total: dict[str, int] = {}
        for r in self.rounds:
            for k, v in (r.get("batch_sizes_seen") or {}).items():
                total[k] = total.get(k, 0) + v
        return dict(sorted(total.items(), key=lambda kv: int(kv[0])))

    def summary(self, slo_ms: float) -> dict:
        c = self.candidate
        tp, p99 = self.throughput, self.p99
        return {"name": c.name, "origin": c.origin, "settings": c.settings(), "predicted": c.predicted,
                "served": self.served,
                "throughput_rps": _r(tp), "p99_ms": _r(p99), "p50_ms": _r(self._mean("p50_ms")),
                "meets_slo": bool(self.served and p99 is not None and p99 <= slo_ms),
                "throughput_spread": round(self.spread("throughput_rps"), 4),
                "p99_spread": round(self.spread("p99_ms"), 4),
                "batches_formed": self.batches_formed(),
                "ready_s": [_r(r.get("ready_s")) for r in self.rounds],
                "rounds": self.rounds}


def _r(x: Optional[float], nd: int = 3) -> Optional[float]:
    return None if x is None else round(float(x), nd)


def noise_band(a: CandidateResult, b: CandidateResult, key: str, min_gain: float) -> float:
    """The relative difference two served figures must exceed to count as real: the rounds'
    spreads of both (independent, so in quadrature), at least min_gain."""
    return max(min_gain, math.hypot(a.spread(key), b.spread(key)))


def decide(results: list[CandidateResult], *, objective: str, slo_ms: float, min_gain: float) -> dict:
    """Which candidate to serve. results[0] is the incumbent (the offline choice, or the point the
    frontend is tuned on). A challenger must meet the SLO (or the incumbent must miss it) and beat
    the incumbent by more than the noise band; among those, the best by the objective."""
    if not results:
        raise TuningError("no candidate to decide between")
    served = [r for r in results if r.served]
    steps: list[str] = []
    for r in results:
        if not r.served:
            steps.append(f"{r.candidate.name}: not served in every round "
                         f"({[x.get('error') for x in r.rounds if not x.get('ok')][:1]}): out")
    if not served:
        return {"chosen": 0, "slo_met": False, "steps": steps + ["nothing was served: the incumbent stays"],
                "undecided": []}
    incumbent = results[0] if results[0].served else min(served, key=lambda r: r.p99)
    fits = [r for r in served if r.p99 <= slo_ms]
    undecided: list[CandidateResult] = []
    key = "p99_ms" if objective == "latency" else "throughput_rps"

    def better(a: CandidateResult, b: CandidateResult) -> tuple[bool, float, float]:
        """Is a better than b beyond the noise? (verdict, relative gain, band)."""
        band = noise_band(a, b, key, min_gain)
        if key == "p99_ms":
            gain = 1 - a.p99 / b.p99 if b.p99 else 0.0
        else:
            gain = a.throughput / b.throughput - 1 if b.throughput else math.inf
        return gain > band, gain, band

    if not fits:
        # Nothing meets the SLO: the incumbent stays unless a candidate's p99 is lower beyond the noise.
        best = min(served, key=lambda r: r.p99)
        band = noise_band(best, incumbent, "p99_ms", min_gain)
        gain = 1 - best.p99 / incumbent.p99 if incumbent.p99 else 0.0
        chosen = best if best is not incumbent and gain > band else incumbent
        versus = ("the incumbent" if best is incumbent else
                  f"{gain:.1%} below {incumbent.candidate.name}, noise band {band:.1%}")
        steps.append(f"no candidate's served p99 is within the SLO {slo_ms:g} ms; lowest p99: {best.candidate.name} "
                     f"({best.p99:.1f} ms, {versus}): {chosen.candidate.name} is served")
        if key == "throughput_rps":
            # Replicas will be needed anyway: a point that serves more beyond the noise without a worse
            # p99 (beyond the noise) needs fewer of them, so it is taken.
            no_worse = [r for r in served if r is not chosen
                        and r.p99 <= chosen.p99 * (1 + noise_band(r, chosen, "p99_ms", min_gain))
                        and better(r, chosen)[0]]
            if no_worse:
                top = max(no_worse, key=lambda r: r.throughput)
                _, tp_gain, tp_band = better(top, chosen)
                steps.append(f"{top.candidate.name}: throughput {tp_gain:+.1%} vs {chosen.candidate.name} beyond the "
                             f"noise band {tp_band:.1%}, p99 {top.p99:.1f} ms not worse beyond the noise: taken")
                chosen = top
    else:
        chosen = incumbent if incumbent in fits else None
        if chosen is None:
            chosen = (min(fits, key=lambda r: r.p99) if key == "p99_ms" else max(fits, key=lambda r: r.throughput))
            steps.append(f"{incumbent.candidate.name} misses the SLO (served p99 {incumbent.p99:.1f} ms > "
                         f"{slo_ms:g} ms): {chosen.candidate.name} meets it and is taken")
        else:
            steps.append(f"{chosen.candidate.name}: served {chosen.throughput:.1f} req/s, p99 {chosen.p99:.1f} ms "
                         f"(start)")
        ranked = sorted((r for r in fits if r is not chosen),
                        key=(lambda r: r.p99) if key == "p99_ms" else (lambda r: -r.throughput))
        for r in ranked:
            ok, gain, band = better(r, chosen)
            what = "p99" if key == "p99_ms" else "throughput"
            if not ok and gain > min_gain:
                undecided.append(r)           # better by more than min_gain, but not beyond the noise yet
            if ok:
                steps.append(f"{r.candidate.name}: {what} {gain:+.1%} vs {chosen.candidate.name}, beyond the noise "
                             f"band {band:.1%}: taken")
                chosen = r
            elif gain < -band:
                steps.append(f"{r.candidate.name}: {what} {gain:+.1%} vs {chosen.candidate.name}, worse beyond the "
                             f"noise band {band:.1%}: {chosen.candidate.name} stays")
            else:
                steps.append(f"{r.candidate.name}: {what} {gain:+.1%} vs {chosen.candidate.name}, within the noise "
                             f"band {band:.1%}: {chosen.candidate.name} stays")
        for r in served:
            if r not in fits:
                steps.append(f"{r.candidate.name}: served p99 {r.p99:.1f} ms > SLO {slo_ms:g} ms: out")
    return {"chosen": results.index(chosen), "slo_met": chosen.p99 <= slo_ms, "steps": steps,
            "undecided": [results.index(r) for r in undecided if r is not chosen]}


def settle(results: list[CandidateResult], decide_now: Callable[[], dict],
           measure_round: Callable[[list[int], int], None], *, rounds_done: int, max_rounds: int) -> tuple[dict, int]:
    """Decide (`decide_now()` over `results`); while a challenger is better by more than min_gain but
    not beyond the noise, serve the chosen one and those challengers one more interleaved round each
    (`measure_round(indices, round_no)` appends to their results) and decide again, up to
    `max_rounds`. → (decision, extra rounds)."""
    decided, extra = decide_now(), 0
    while decided.get("undecided") and rounds_done + extra < max_rounds:
        extra += 1
        idx = [decided["chosen"]] + decided["undecided"]
        measure_round(idx, rounds_done + extra)
        decided = decide_now()
        decided["steps"].insert(0, f"round {rounds_done + extra} served for "
                                   f"{', '.join(results[i].candidate.name for i in idx)}: undecided after "
                                   f"{rounds_done + extra - 1} (better by more than min_gain, within the noise)")
    return decided, extra


def slo_verdict(chosen: CandidateResult, results: list[CandidateResult], *, slo_ms: float,
                expected_concurrency: int, capacity: Optional[dict] = None,
                predicted_p99_ms: Optional[float] = None) -> dict:
    """The served SLO verdict with its numbers. `capacity`: {"levels": [{concurrency, p99_ms,
    throughput_rps}], "inflight_within_slo": n} measured on the chosen point at lower loads."""
    served = [r for r in results if r.served]
    max_tp = max((r.throughput for r in served), default=None)
    best_p99 = min((r.p99 for r in served), default=None)
    floor_ms = expected_concurrency / max_tp * 1000.0 if max_tp else None
    met = bool(chosen.served and chosen.p99 is not None and chosen.p99 <= slo_ms)
    out: dict[str, Any] = {
        "slo_met": met, "basis": f"served p99 in TorchServe with {expected_concurrency} requests in flight",
        "latency_slo_ms": slo_ms, "expected_concurrency": expected_concurrency,
        "served_p99_ms": _r(chosen.p99), "served_throughput_rps": _r(chosen.throughput),
        "predicted_request_p99_ms": _r(predicted_p99_ms),
        "best_served_p99_ms": _r(best_p99), "max_served_throughput_rps": _r(max_tp),
        "littles_law_floor_ms": _r(floor_ms),
    }
    if met:
        out["message"] = (f"SLO met in TorchServe: served p99 {chosen.p99:.1f} ms <= {slo_ms:g} ms at "
                          f"{expected_concurrency} requests in flight, {chosen.throughput:.1f} req/s "
                          f"({chosen.candidate.describe()})")
        return out
    inflight = (capacity or {}).get("inflight_within_slo")
    replicas = math.ceil(expected_concurrency / inflight) if inflight else None
    out.update(inflight_within_slo=inflight, replicas=replicas, capacity=capacity)
    parts = [f"SLO NOT met in TorchServe: with {expected_concurrency} requests in flight the best served p99 is "
             f"{best_p99:.1f} ms > {slo_ms:g} ms" if best_p99 is not None else
             f"SLO NOT met: no candidate could be served"]
    if max_tp:
        parts.append(f"the highest served throughput is {max_tp:.1f} req/s, so by Little's law the mean latency at "
                     f"{expected_concurrency} in flight is at least {expected_concurrency} / {max_tp:.1f} req/s = "
                     f"{floor_ms:.1f} ms, whatever the configuration"
                     + (" (above the SLO: no setting of one replica can meet it)" if floor_ms > slo_ms else ""))
    if inflight:
        parts.append(f"one replica answers within the SLO with up to {inflight} requests in flight (measured), so "
                     f"{expected_concurrency} in flight need replicas = ceil({expected_concurrency} / {inflight}) = "
                     f"{replicas}")
    elif capacity is not None:
        parts.append("even a single request in flight misses the SLO on this host: more replicas cannot help; a "
                     "faster variant or host is needed (or a looser serve.latency_slo_ms)")
    if predicted_p99_ms is not None:
        parts.append(f"(the offline prediction was {predicted_p99_ms:.1f} ms: it leaves out queueing and the server)")
    out["message"] = "; ".join(parts)
    return out


# --------------------------------------------------------------------------- serving
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
        handler = cfg.setdefault("handler", {})
        handler["threads"] = c.threads
        if "warmup_batch_size" in handler:
            handler["warmup_batch_size"] = c.batch_size
        (self.store / self.folder / "model-config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def thread_env(threads: int) -> dict:
    """The start command's thread variables (pipeline/properties.start_command)."""
    from pipeline.decide.properties import start_command
    return start_command(model_name="m", model_store=".", config_path=".", threads=threads)["env"]


class Tuner:
    """Serves candidates of one model in real TorchServes, always stopped.

    side_by_side (when the host's memory holds every candidate's workers at once): one server per
    candidate, all up together, measured one at a time, so each pays one start whatever the rounds.
    Otherwise candidates that differ only in model settings (batch, delay, workers, threads) share
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

    def _server(self, c: OperatingCandidate, env_threads: Optional[int] = None) -> TorchServe:
        self.model.write_yaml(c)
        self.starts += 1
        workdir = self.workroot / f"server-{self.starts}"
        workdir.mkdir(parents=True)
        return TorchServe(self.model.base_config, self.model.store, self.model.name,
                          models=f"{self.model.name}={self.model.folder}", workdir=workdir,
                          extra_properties={"default_workers_per_model": c.workers, "enable_model_api": True,
                                            **c.frontend},
                          env=thread_env(env_threads or c.threads))

    def _register(self, ts: TorchServe, c: OperatingCandidate) -> float:
        """Replace the served model by `c` (unregister, rewrite its yaml, register synchronously);
        returns the seconds until its workers were READY."""
        name = self.model.name
        t0 = time.monotonic()
        r = ts.api.management("DELETE", f"/models/{name}", timeout_s=60)
        if r.status != 200:
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
            out = [{"round": round_no, "ok": False, "concurrency": levels[0], "error": str(e)[:2000]}]
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
        first = candidates[order[0][1]]
        ts = self._server(first, env_threads=max(c.threads for c in candidates))
        try:
            with ts:
                self.start_s.append(ts.readiness.ready_s)
                loaded = first
                for rnd, i in order:
                    c = candidates[i]
                    try:
                        ready_s = ts.readiness.ready_s if c is loaded and rnd == 0 and i == order[0][1] \
                            else self._register(ts, c)
                        loaded = c
                        results[i].rounds.extend(self._load(ts, c, rnd + 1, ready_s, [self.concurrency]))
                    except (TorchServeError, OSError) as e:
                        results[i].rounds.append({"round": rnd + 1, "ok": False, "concurrency": self.concurrency,
                                                  "error": str(e)[:2000]})
                    self.progress()
        except (ModelNotReady, TorchServeError) as e:
            for r in results:
                if not r.rounds:
                    r.rounds.append({"round": 1, "ok": False, "concurrency": self.concurrency, "error": str(e)[:2000]})
        finally:
            shutil.rmtree(ts.workdir, ignore_errors=True)
        return results

    def _run_side_by_side(self, candidates: list[OperatingCandidate], results: list[CandidateResult],
                          order: list[tuple[int, int]]) -> list[CandidateResult]:
        """One server per candidate, all started first and kept up (idle ones cost memory, not
        CPU), measured one at a time in `order`, then all stopped: a server start per candidate
        instead of one per measurement."""
        servers: list[Optional[TorchServe]] = []
        try:
            for i, c in enumerate(candidates):
                ts = self._server(c)
                try:
                    ts.start()
                    self.start_s.append(ts.readiness.ready_s)
                    servers.append(ts)
                except (ModelNotReady, TorchServeError) as e:
                    servers.append(None)
                    results[i].rounds.append({"round": 1, "ok": False, "concurrency": self.concurrency,
                                              "error": str(e)[:2000]})
            for rnd, i in order:
                ts = servers[i]
                if ts is not None:
                    try:
                        results[i].rounds.extend(self._load(ts, candidates[i], rnd + 1, ts.readiness.ready_s,
                                                            [self.concurrency]))
                    except (TorchServeError, OSError) as e:
                        results[i].rounds.append({"round": rnd + 1, "ok": False, "concurrency": self.concurrency,
                                                  "error": str(e)[:2000]})
                self.progress()
        finally:
            for ts in servers:
                if ts is not None:
                    ts.stop(check=False)
                    shutil.rmtree(ts.workdir, ignore_errors=True)
        return results

    def capacity(self, c: OperatingCandidate, slo_ms: float) -> dict:
        """The in-flight load one replica takes within the SLO: the chosen point measured at
        halving concurrencies (one server) until its p99 fits."""
        levels, n = [], self.concurrency // 2
        while n >= 1:
            levels.append(n)
            n //= 2
        if not levels:
            return {"levels": [], "inflight_within_slo": None}
        measured = self.measure(c, 0, levels)
        fit = [m for m in measured if m.get("ok") and m["p99_ms"] is not None and m["p99_ms"] <= slo_ms]
        return {"levels": [{k: m.get(k) for k in ("concurrency", "ok", "p99_ms", "p50_ms", "throughput_rps",
                                                   "batch_sizes_seen", "error")} for m in measured],
                "inflight_within_slo": max((m["concurrency"] for m in fit), default=None)}


def progress_bar(total: int, desc: str):
    """A tqdm bar on stderr (the pipeline's logs go there too); a no-op when tqdm is missing."""
    try:
        from tqdm import tqdm
    except ImportError:     # pragma: no cover - tqdm is pinned in requirements.txt
        return None
    return tqdm(total=total, desc=desc, file=sys.stderr, unit="server", leave=True)


# --------------------------------------------------------------------------- the whole tuning
@dataclass(frozen=True)
class TuneSettings:
    latency_slo_ms: float
    objective: str = "throughput"
    min_gain: float = 0.05
    expected_concurrency: int = 16
    rounds: int = 2
    measure_s: float = 2.0
    warmup_requests: int = 32
    frontend: bool = True
    max_rounds: int = 4               # undecided comparisons get one more round at a time, up to this
    side_by_side: bool = False        # every candidate's server up at once (see Tuner)


def tune(model: ServedModel, cases: list[HttpCase], candidates: list[OperatingCandidate], s: TuneSettings,
         *, workroot: Optional[Path] = None) -> dict:
    """Serve the candidates, then the frontend alternatives on the chosen one, decide, and give the
    verdict. Returns the tuning record (artifacts/serve/tuning.json)."""
    if s.objective == "cold_load":
        # Load time does not depend on these settings: tune for throughput within the SLO instead.
        objective = "throughput"
    else:
        objective = s.objective
    t0 = time.monotonic()
    runs = len(candidates) * s.rounds + ((len(FRONTEND_CANDIDATES) + 1) * s.rounds if s.frontend else 0)
    bar = progress_bar(runs, "tune: serving candidates")
    tuner = Tuner(model, cases, concurrency=s.expected_concurrency, measure_s=s.measure_s,
                  warmup_requests=s.warmup_requests, workroot=workroot, side_by_side=s.side_by_side,
                  progress=(bar.update if bar is not None else None))
    try:
        def more(results: list[CandidateResult], fresh: bool):
            def measure_round(idx: list[int], round_no: int) -> None:
                if bar is not None:
                    bar.total += len(idx)
                for i, r in zip(idx, tuner.run_rounds([results[i].candidate for i in idx], 1, fresh=fresh)):
                    results[i].rounds.extend(dict(x, round=round_no) for x in r.rounds)
            return measure_round

        def decider(results):
            return lambda: decide(results, objective=objective, slo_ms=s.latency_slo_ms, min_gain=s.min_gain)

        phase1 = tuner.run_rounds(candidates, s.rounds)
        d1, extra1 = settle(phase1, decider(phase1), more(phase1, False), rounds_done=s.rounds,
                            max_rounds=s.max_rounds)
        final, phase2, d2, extra2 = phase1[d1["chosen"]], [], None, 0
        if not s.frontend:
            worth, frontend_why = False, "tune.frontend is false"
        elif not final.served:
            worth, frontend_why = False, "the chosen point was not served"
        else:
            worth, frontend_why = frontend_worth_tuning(final)
        log.info("frontend settings: %s", frontend_why)
        if worth:
            phase2 = tuner.run_rounds(frontend_candidates(final.candidate), s.rounds, fresh=True)
            d2, extra2 = settle(phase2, decider(phase2), more(phase2, True), rounds_done=s.rounds,
                                max_rounds=s.max_rounds)
            final = phase2[d2["chosen"]]
        if bar is not None:
            bar.total += 1
        capacity = None
        if not (final.served and final.p99 <= s.latency_slo_ms) and final.served:
            capacity = tuner.capacity(final.candidate, s.latency_slo_ms)
        elif bar is not None:
            bar.update()
    finally:
        if bar is not None:
            bar.close()
        shutil.rmtree(tuner.workroot, ignore_errors=True)
    offline = phase1[0]
    verdict = slo_verdict(final, phase1 + phase2, slo_ms=s.latency_slo_ms, expected_concurrency=s.expected_concurrency,
                          capacity=capacity,
                          predicted_p99_ms=(offline.candidate.predicted or {}).get("request_p99_ms"))
    return {
        "chosen": final.candidate.settings(), "chosen_name": final.candidate.name,
        "replaced_offline": final.candidate.key()[:4] != offline.candidate.key()[:4],
        "objective": objective, "settings": dataclasses.asdict(s),
        "candidates": [r.summary(s.latency_slo_ms) for r in phase1],
        "decision_steps": d1["steps"],
        "frontend": ({"candidates": [r.summary(s.latency_slo_ms) for r in phase2], "decision_steps": d2["steps"],
                      "chosen": final.candidate.frontend, "why": frontend_why} if d2 else None),
        "frontend_skipped": None if d2 else frontend_why,
        **verdict,
        "extra_rounds": {"operating_point": extra1, "frontend": extra2},
        "server_starts": tuner.starts, "registrations": tuner.registrations,
        "server_start_s": [round(x, 2) for x in tuner.start_s],
        "duration_s": round(time.monotonic() - t0, 1),
    }


@dataclass(frozen=True)
class Contender:
    """A variant in the served contest: its folder-form model and its own offline operating point."""
    variant: str
    model: ServedModel
    candidate: OperatingCandidate


def variant_contest(contenders: list[Contender], cases: list[HttpCase], s: TuneSettings,
                    *, workroot: Optional[Path] = None, progress: Optional[Callable] = None) -> dict:
    """Serve the variants selection could not tell apart (within the benchmark's noise), each at its
    own offline operating point, in interleaved rounds (a fresh server per measurement, the order
    rotated). contenders[0] is selection's winner: another variant replaces it only by serving
    better beyond the rounds' noise (pipeline.serve.tuning.decide). Returns the contest record."""
    objective = "throughput" if s.objective == "cold_load" else s.objective
    root = Path(workroot) if workroot else Path(tempfile.mkdtemp(prefix="contest-"))
    t0 = time.monotonic()
    tuners = [Tuner(c.model, cases, concurrency=s.expected_concurrency, measure_s=s.measure_s,
                    warmup_requests=s.warmup_requests, workroot=root / c.variant, progress=progress)
              for c in contenders]
    results = [CandidateResult(dataclasses.replace(c.candidate, name=c.variant, origin="variant"))
               for c in contenders]
    n = len(contenders)

    def decide_now():
        return decide(results, objective=objective, slo_ms=s.latency_slo_ms, min_gain=s.min_gain)

    def measure_round(idx: list[int], round_no: int) -> None:
        for k in range(len(idx)):
            i = idx[(k + round_no - 1) % len(idx)]          # rotated, as the first rounds
            results[i].rounds.extend(tuners[i].measure(contenders[i].candidate, round_no))

    try:
        for rnd in range(s.rounds):
            measure_round(list(range(n)), rnd + 1)
        d, extra = settle(results, decide_now, measure_round, rounds_done=s.rounds, max_rounds=s.max_rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    chosen = contenders[d["chosen"]].variant
    return {"contenders": [c.variant for c in contenders], "chosen": chosen,
            "replaced_selection": chosen != contenders[0].variant,
            "candidates": [dict(r.summary(s.latency_slo_ms), variant=c.variant) for r, c in zip(results, contenders)],
            "decision_steps": d["steps"], "extra_rounds": extra, "server_starts": sum(t.starts for t in tuners),
            "duration_s": round(time.monotonic() - t0, 1)}


def tuned_derivation(configured: dict, record: dict) -> dict:
    """configure's derivation.json with the tuned keys replaced by the served choice: each keeps
    the offline derivation (`offline`) beside the served evidence (`served`). Frontend settings are
    added as their own entries. Dependent limits (job queue) follow the served batch × workers."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in configured.items()}
    chosen = record["chosen"]
    cands = [{k: c[k] for k in ("name", "settings", "predicted", "throughput_rps", "p99_ms", "meets_slo",
                                "throughput_spread", "batches_formed")} for c in record["candidates"]]
    for key in TUNED_KEYS:
        old = configured.get(key) or {}
        if old.get("overridden"):
            continue        # serve.overrides win over the tuner too
        out[key] = {"value": chosen[key],
                    "formula": ("served in TorchServe with serve.expected_concurrency requests in flight: the "
                                "candidate with the highest served throughput whose served p99 <= SLO (objective "
                                "latency: lowest served p99); a candidate replaces the offline choice only by more "
                                "than the rounds' noise"),
                    "inputs": {"offline": old, "served": {"chosen": record["chosen_name"],
                                                          "slo_met": record["slo_met"],
                                                          "served_p99_ms": record["served_p99_ms"],
                                                          "served_throughput_rps": record["served_throughput_rps"],
                                                          "candidates": cands,
                                                          "steps": record["decision_steps"]}},
                    "overridden": False, "confirmed_offline": old.get("value") == chosen[key]}
    fe = record.get("frontend")
    for name, settings in FRONTEND_CANDIDATES:
        for key, value in settings.items():
            kept = bool(fe) and fe["chosen"].get(key) == value
            out[key] = {"value": value if kept else None,
                        "formula": f"kept only if '{name}' served measurably better (beyond the rounds' noise) "
                                   f"than TorchServe's default on the chosen point; null = TorchServe default",
                        "inputs": {"served": ({"candidates": [{k: c[k] for k in ("name", "throughput_rps", "p99_ms",
                                                                                 "throughput_spread")}
                                                              for c in fe["candidates"]],
                                               "steps": fe["decision_steps"]} if fe else
                                              f"not measured: {record.get('frontend_skipped') or 'not tuned'}")},
                        "overridden": False}
    w, b = chosen["workers"], chosen["batch_size"]
    q = out.get("job_queue_size") or {}
    conc = ((q.get("inputs") or {}).get("expected_concurrency"))
    if conc is not None and not q.get("overridden"):
        out["job_queue_size"] = {**q, "value": max(2 * int(conc), 2 * w * b),
                                 "inputs": {**q.get("inputs", {}), "workers": w, "batch_size": b}}
    return out


def frontend_properties(derivation: dict) -> dict:
    """The frontend settings the tuner kept (config.properties keys → values)."""
    keys = {k for _, s in FRONTEND_CANDIDATES for k in s}
    return {k: derivation[k]["value"] for k in sorted(keys)
            if isinstance(derivation.get(k), dict) and derivation[k].get("value") is not None}
