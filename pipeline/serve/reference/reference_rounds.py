"""The winner against the references (hand-tuned, naive baseline) in interleaved rounds.

On a shared host the speed drifts 10–25% for minutes at a time (docs/handtuned.md), so setups are only
comparable inside one interleaved run: each round serves every setup once, in a rotated order,
each in a fresh TorchServe (READY measured every time) under the same load. Round 1 may reuse the
full checks serve_check already ran (winner, baseline); later rounds are load-only.

The ratios winner / hand-tuned are the medians of the rounds: throughput (also counted only when
the median p99 is within the SLO), p99 and time to READY.

A later round serves only the references whose comparison is still undecided — throughput, p99 or
READY within `decided_band` of parity — with the winner beside them: the host's drift cannot turn a
22× throughput or a 0.45× READY around, and for a 1.3 GB model the naive baseline's round takes
~50 s. No reference left undecided: no more rounds (the record lists each setup's rounds).
"""
from __future__ import annotations

import logging
import statistics
from typing import Any, Optional

from pipeline.core.numbers import rounded
from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.serve_check import ServerSpec, check_server

log = logging.getLogger(__name__)


def _figures(result: dict, round_no: int) -> dict:
    load = result.get("load") or {}
    ok = bool(result.get("ready")) and load.get("requests_ok", 0) > 0 and not load.get("errors_5xx") \
        and not load.get("lost")
    return {"round": round_no, "ok": ok, "ready_s": result.get("ready_s"), "worker_load_ms": result.get("worker_load_ms"),
            "throughput_rps": load.get("throughput_rps"), "p50_ms": load.get("p50_ms"), "p99_ms": load.get("p99_ms"),
            "batch_sizes_seen": load.get("batch_sizes_seen"), "error": result.get("error"),
            "warmup_s": (result.get("warmup") or {}).get("seconds"),
            "load_jit_compiler_cores": result.get("load_jit_compiler_cores"),
            "load_discarded": result.get("load_discarded")}


def _median(rounds: list[dict], key: str) -> Optional[float]:
    vals = [r[key] for r in rounds if r.get("ok") and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarise(rounds: list[dict], slo_ms: float) -> dict:
    tp, p99 = _median(rounds, "throughput_rps"), _median(rounds, "p99_ms")
    return {"rounds": rounds, "ready_s": _median(rounds, "ready_s"), "throughput_rps": tp, "p99_ms": p99,
            "p50_ms": _median(rounds, "p50_ms"),
            "within_slo": p99 is not None and p99 <= slo_ms,
            "throughput_within_slo_rps": tp if p99 is not None and p99 <= slo_ms else 0.0}


def ratios(a: dict, b: dict) -> dict:
    """a / b of the summarised figures (throughput > 1 is better; p99 and ready < 1 are better)."""
    def div(x, y):
        return round(x / y, 4) if x is not None and y else None
    return {"throughput": div(a.get("throughput_rps"), b.get("throughput_rps")),
            "throughput_within_slo": div(a.get("throughput_within_slo_rps"), b.get("throughput_within_slo_rps")),
            "p99": div(a.get("p99_ms"), b.get("p99_ms")), "ready": div(a.get("ready_s"), b.get("ready_s"))}


def undecided(per: dict[str, list[dict]], band: float, winner: str = "winner",
              uncompared: frozenset = frozenset()) -> list[str]:
    """The references whose ratios to the winner (medians so far) are not all beyond `band` of
    parity (1/(1+band) .. 1+band) on throughput, p99 and READY; every reference when band <= 0.
    `uncompared`: setups served for a figure of their own (the bound's ceilings), never open."""
    refs = [n for n in per if n != winner and n not in uncompared]
    if band <= 0 or winner not in per:
        return refs
    w = summarise(per[winner], float("inf"))
    open_ = []
    for name in refs:
        r = ratios(w, summarise(per[name], float("inf")))
        if any(r[k] is None or 1 / (1 + band) < r[k] < 1 + band for k in ("throughput", "p99", "ready")):
            open_.append(name)
    return open_


def interleaved_rounds(specs: dict[str, ServerSpec], cases: list[HttpCase], *, task: str, rounds: int,
                       requests: int, concurrency: int, time_cap_s: float, slo_ms: float,
                       first_round: Optional[dict[str, dict]] = None, decided_band: float = 0.0,
                       warmup_s: float = 0.0, uncompared: frozenset = frozenset()) -> dict[str, Any]:
    """{setup: summary} over up to `rounds` rounds (see `undecided` for `decided_band`). first_round:
    check_server results already measured in this run (they count as round 1; the setups missing
    from it are served after them). uncompared: setups that decide no further round (a ceiling's
    READY near the winner's is no contest) but are served again in any round that happens."""
    names = list(specs)
    per: dict[str, list[dict]] = {n: [] for n in names}
    done = dict(first_round or {})

    def serve(name: str, round_no: int) -> None:
        r = check_server(specs[name], cases, task=task, atol=0.0, rtol=0.0, requests=requests,
                         concurrency=concurrency, time_cap_s=time_cap_s, bad_inputs=False, parity=False,
                         warmup_s=warmup_s)
        per[name].append(_figures(r, round_no))
        f = per[name][-1]
        log.info("round %d %-10s READY %s s, %s req/s, p99 %s ms", round_no, name, rounded(f["ready_s"], 2),
                 rounded(f["throughput_rps"], 2), rounded(f["p99_ms"], 2))

    for name in names:
        if name in done:
            per[name].append(_figures(done[name], 1))
        else:
            serve(name, 1)
    for rnd in range(1, rounds):
        open_ = undecided(per, decided_band, uncompared=uncompared)
        if not open_:
            log.info("after round %d every comparison with the winner is beyond %.0f%% of parity "
                     "(serve_check.decided_band): no further round", rnd, 100 * decided_band)
            break
        served = [n for n in names if n == "winner" or n in open_ or n in uncompared]
        for k in range(len(served)):
            serve(served[(k + rnd) % len(served)], rnd + 1)
    return {n: summarise(per[n], slo_ms) for n in names}
