"""Tune and certify the served operating point in a real TorchServe, under the expected load.

The offline curve (pipeline/decide/serve_config.py) times the model call only. The server adds what that
model leaves out: queueing of `serve.expected_concurrency` requests in flight, IPC, JSON,
tokenization and a Java frontend on the same cores. So the configure stage's choice is a
*proposal*; this module serves a few candidate operating points taken from the same curve and
keeps the one that serves best, with the evidence:

1. candidates (pipeline/serve/tune/candidates.py): the offline choice, the larger measured batch sizes
   up to what the load fills (each with its own delay), and the other workers × threads layout on
   the same cores;
2. each is served in a real TorchServe (pipeline/serve/tune/tuner.py) with `expected_concurrency`
   requests kept in flight (pipeline/serve/checks/load.py, the task's golden HTTP cases), candidates
   interleaved round by round (order rotated) so host drift hits them all alike;
3. the decision (pipeline/serve/tune/decision.py): highest served throughput whose served p99 <= SLO
   (objective latency: lowest served p99); a challenger replaces the offline choice only by more
   than the measured noise (the rounds' spread, at least serve.min_batch_gain);
4. frontend settings (system-metrics collector, netty thread counts) measured the same way on the
   chosen point and kept only when they help beyond the noise;
5. the SLO verdict comes from the served p99; when nothing meets the SLO it says why in numbers:
   the best served p99 and throughput, Little's-law floor in-flight / max throughput, and the
   in-flight load one replica takes within the SLO (measured at lower concurrency), hence
   replicas = ceil(expected / that).

Before all that, `variant_contest` serves the variants selection found within the benchmark's noise
of its winner (each at its own offline point): a tie offline is decided by the server, and another
variant replaces the winner only by serving better beyond the rounds' noise.

This module runs those steps and writes their record; the decision logic is pure and separate
from serving, so both are tested on their own.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from pipeline.serve.tune.candidates import FRONTEND_CANDIDATES, OperatingCandidate, frontend_candidates
from pipeline.serve.tune.decision import CandidateResult, decide, frontend_worth_tuning, settle, slo_verdict
from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.checks.load import LOAD_KIND
from pipeline.serve.tune.tuner import ServedModel, Tuner

log = logging.getLogger(__name__)

# The settings a candidate varies, as derivation.json keys (pipeline/decide/serve_config.py).
# batch_size counts requests (TorchServe's batchSize), batch_rows the rows per model call.
TUNED_KEYS = ("batch_size", "batch_rows", "max_batch_delay_ms", "workers", "threads_per_worker")


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
    objective = _served_objective(s)
    t0 = time.monotonic()
    runs = len(candidates) * s.rounds + ((len(FRONTEND_CANDIDATES) + 1) * s.rounds if s.frontend else 0)
    bar = progress_bar(runs, "tune: serving candidates")
    tuner = Tuner(model, cases, concurrency=s.expected_concurrency, measure_s=s.measure_s,
                  warmup_requests=s.warmup_requests, workroot=workroot, side_by_side=s.side_by_side,
                  progress=(bar.update if bar is not None else None))
    try:
        phase1, d1, extra1 = _served_phase(tuner, bar, candidates, s, objective, fresh=False)
        final, phase2, d2, extra2 = phase1[d1["chosen"]], [], None, 0
        if not s.frontend:
            worth, frontend_why = False, "tune.frontend is false"
        elif not final.served:
            worth, frontend_why = False, "the chosen point was not served"
        else:
            worth, frontend_why = frontend_worth_tuning(final)
        log.info("frontend settings: %s", frontend_why)
        # Side by side, the servers still up are stopped together. The frontend setups all start fresh
        # (the chosen point's server, warmed by the rounds above, would have the JVM's compiled code
        # ahead of them); the final point's server stays up for the capacity measurement.
        tuner.release(keep=() if worth else (final.candidate,))
        if worth:
            phase2, d2, extra2 = _served_phase(tuner, bar, frontend_candidates(final.candidate), s, objective,
                                               fresh=True)
            final = phase2[d2["chosen"]]
            tuner.release(keep=(final.candidate,))
        if bar is not None:
            bar.total += 1
        capacity = None
        if not (final.served and final.p99 <= s.latency_slo_ms) and final.served:
            capacity = tuner.capacity(final.candidate, s.latency_slo_ms)
        elif bar is not None:
            bar.update()
    finally:
        tuner.close()
        if bar is not None:
            bar.close()
        shutil.rmtree(tuner.workroot, ignore_errors=True)
    offline = phase1[0]
    verdict = slo_verdict(final, phase1 + phase2, slo_ms=s.latency_slo_ms, expected_concurrency=s.expected_concurrency,
                          capacity=capacity,
                          predicted_p99_ms=(offline.candidate.predicted or {}).get("request_p99_ms"))
    return {
        **chosen_record(final.candidate),
        "replaced_offline": final.candidate.point_key() != offline.candidate.point_key(),
        "objective": objective, "settings": dataclasses.asdict(s), "load": LOAD_KIND,
        "candidates": [r.summary(s.latency_slo_ms) for r in phase1],
        "decision_steps": d1["steps"],
        "frontend": ({"candidates": [r.summary(s.latency_slo_ms) for r in phase2], "decision_steps": d2["steps"],
                      "chosen": final.candidate.frontend, "why": frontend_why} if d2 else None),
        "frontend_skipped": None if d2 else frontend_why,
        **verdict,
        "extra_rounds": {"operating_point": extra1, "frontend": extra2},
        "server_starts": tuner.starts, "registrations": tuner.registrations, "servers_reused": tuner.reused,
        "server_start_s": [round(x, 2) for x in tuner.start_s],
        "duration_s": round(time.monotonic() - t0, 1),
    }


def chosen_record(c: OperatingCandidate) -> dict:
    """The tuning record's entries for the served point: its settings, name and the timeouts it was
    served with (derivation entries; `tuned_derivation` puts them in the tuned derivation.json)."""
    return {"chosen": c.settings(), "chosen_name": c.name, "chosen_timeouts": dict(c.timeouts) or None}


def _served_objective(s: TuneSettings) -> str:
    """What the served contest optimises: load time does not depend on the served settings, so the
    objective cold_load tunes for throughput within the SLO instead."""
    return "throughput" if s.objective == "cold_load" else s.objective


def _served_phase(tuner: Tuner, bar, candidates: list[OperatingCandidate], s: TuneSettings, objective: str, *,
                  fresh: bool) -> tuple[list[CandidateResult], dict, int]:
    """`candidates` served in s.rounds interleaved rounds, then decided, with more rounds for the
    undecided ones (`settle`) → (results, decision, extra rounds)."""
    results = tuner.run_rounds(candidates, s.rounds, fresh=fresh)

    def measure_round(idx: list[int], round_no: int) -> None:
        if bar is not None:
            bar.total += len(idx)
        for i, r in zip(idx, tuner.run_rounds([results[i].candidate for i in idx], 1, fresh=fresh)):
            results[i].rounds.extend(dict(x, round=round_no) for x in r.rounds)

    def decide_now() -> dict:
        return decide(results, objective=objective, slo_ms=s.latency_slo_ms, min_gain=s.min_gain)

    decision, extra = settle(results, decide_now, measure_round, rounds_done=s.rounds, max_rounds=s.max_rounds)
    return results, decision, extra


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
    better beyond the rounds' noise (pipeline.serve.tune.decision.decide). Returns the contest record."""
    objective = _served_objective(s)
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
    added as their own entries. Dependent limits follow the served point: the job queue its batch ×
    workers, responseTimeout and startupTimeout are those it was served with (record `chosen_timeouts`,
    derived for its own batch, rows, workers and threads: candidates.with_timeouts), each keeping the
    offline entry (`inputs.offline`); a timeout under serve.overrides stays as set."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in configured.items()}
    chosen = record["chosen"]
    cands = [{k: c[k] for k in ("name", "settings", "predicted", "throughput_rps", "p99_ms", "meets_slo",
                                "throughput_spread", "batches_formed")} for c in record["candidates"]]
    for key in TUNED_KEYS:
        old = configured.get(key) or {}
        if old.get("overridden") or key not in chosen:
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
    for key, served in (record.get("chosen_timeouts") or {}).items():
        old = configured.get(key) or {}
        if old.get("overridden"):
            continue        # serve.overrides win (the served one was derived with them too)
        point = ", ".join(f"{k} {chosen[k]}" for k in TUNED_KEYS if k in chosen)
        out[key] = {**served, "formula": f"{served['formula']} — for the served point ({point})",
                    "inputs": {**(served.get("inputs") or {}), "offline": old},
                    "confirmed_offline": old.get("value") == served.get("value")}
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
