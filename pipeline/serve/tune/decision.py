"""Which served candidate wins, and the served SLO verdict: pure logic over the rounds' figures.

A challenger replaces the incumbent (the offline choice, or the point the frontend is tuned on)
only by serving better beyond the measured noise (the rounds' spread, at least min_gain); while
one is better by more than min_gain but within the noise, `settle` has more rounds served. The
verdict comes from the served p99; when nothing meets the SLO it says why in numbers (Little's-law
floor, the in-flight load one replica takes within the SLO, hence the replicas needed).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pipeline.core.numbers import rounded
from pipeline.serve.tune.candidates import OperatingCandidate


class TuningError(RuntimeError):
    """Tuning cannot run or cannot decide; the message says what is missing."""


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
                "throughput_rps": rounded(tp), "p99_ms": rounded(p99), "p50_ms": rounded(self._mean("p50_ms")),
                "meets_slo": bool(self.served and p99 is not None and p99 <= slo_ms),
                "throughput_spread": round(self.spread("throughput_rps"), 4),
                "p99_spread": round(self.spread("p99_ms"), 4),
                "batches_formed": self.batches_formed(),
                "ready_s": [rounded(r.get("ready_s")) for r in self.rounds],
                "rounds": self.rounds}


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
    key = "p99_ms" if objective == "latency" else "throughput_rps"
    if not fits:
        chosen, undecided = _choose_over_slo(served, incumbent, key, slo_ms, min_gain, steps), []
    else:
        chosen, undecided = _choose_within_slo(served, fits, incumbent, key, slo_ms, min_gain, steps)
    return {"chosen": results.index(chosen), "slo_met": chosen.p99 <= slo_ms, "steps": steps,
            "undecided": [results.index(r) for r in undecided if r is not chosen]}


def _better(a: CandidateResult, b: CandidateResult, key: str, min_gain: float) -> tuple[bool, float, float]:
    """Is a better than b by `key` beyond the noise? (verdict, relative gain, band)."""
    band = noise_band(a, b, key, min_gain)
    if key == "p99_ms":
        gain = 1 - a.p99 / b.p99 if b.p99 else 0.0
    else:
        gain = a.throughput / b.throughput - 1 if b.throughput else math.inf
    return gain > band, gain, band


def _choose_over_slo(served: list[CandidateResult], incumbent: CandidateResult, key: str, slo_ms: float,
                     min_gain: float, steps: list[str]) -> CandidateResult:
    """Nothing meets the SLO: the incumbent stays unless a candidate's p99 is lower beyond the noise
    (objective throughput: or it serves more beyond the noise at a p99 no worse beyond the noise)."""
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
                    and _better(r, chosen, key, min_gain)[0]]
        if no_worse:
            top = max(no_worse, key=lambda r: r.throughput)
            _, tp_gain, tp_band = _better(top, chosen, key, min_gain)
            steps.append(f"{top.candidate.name}: throughput {tp_gain:+.1%} vs {chosen.candidate.name} beyond the "
                         f"noise band {tp_band:.1%}, p99 {top.p99:.1f} ms not worse beyond the noise: taken")
            chosen = top
    return chosen


def _choose_within_slo(served: list[CandidateResult], fits: list[CandidateResult], incumbent: CandidateResult,
                       key: str, slo_ms: float, min_gain: float,
                       steps: list[str]) -> tuple[CandidateResult, list[CandidateResult]]:
    """Among the candidates within the SLO, the best by `key` beyond the noise, challengers taken in
    rank order → (chosen, undecided: better by more than min_gain but not beyond the noise yet)."""
    undecided: list[CandidateResult] = []
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
    what = "p99" if key == "p99_ms" else "throughput"
    for r in ranked:
        ok, gain, band = _better(r, chosen, key, min_gain)
        if not ok and gain > min_gain:
            undecided.append(r)
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
    return chosen, undecided


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
        "served_p99_ms": rounded(chosen.p99), "served_throughput_rps": rounded(chosen.throughput),
        "predicted_request_p99_ms": rounded(predicted_p99_ms),
        "best_served_p99_ms": rounded(best_p99), "max_served_throughput_rps": rounded(max_tp),
        "littles_law_floor_ms": rounded(floor_ms),
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



# The frontend alternatives are served only when the server loses at least this share of the
# model's own throughput (the benchmark's prediction for the chosen point): where requests spend
# their time in the model (bert-large: 34.1 req/s served of 34.3 predicted) no frontend setting can
# give more, and six more server starts of a GB-sized model cost a minute; MiniLM serves ~300 of
# ~560 req/s, and there they are worth measuring.
FRONTEND_MIN_LOSS = 0.2


def frontend_worth_tuning(chosen: CandidateResult) -> tuple[bool, str]:
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
