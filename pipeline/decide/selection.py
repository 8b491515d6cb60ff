"""Choose one variant from the measurements: constraints, an objective, a noise-aware tie-break.

Strategies only — nothing is measured here. Inputs are the plain records other stages wrote
(conversion.json, metrics/benchmark/<v>.json); the output is exactly one decision (the
`artifacts/selection.json` record), even when nothing meets the SLO.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pipeline.accuracy.exactness import OPT_IN, inexact_because
from pipeline.decide.serve_config import (DerivationError, OperatingPoint, choose_operating_point,
                                   cold_load_ms, curve_from_benchmark, fill_limit, worker_memory_mb)

# Tie-break order among variants whose figures are within measured noise: simplest and most
# portable first.
#   onnx        — the handler needs only onnxruntime (no torch import in the handler: ~1.3 s less
#                 cold load), one file, runs on CPU and GPU execution providers alike.
#   torchscript — one self-contained file, no Python model code, but needs torch.
#   eager       — needs the model's Python code (and e.g. transformers) in the archive; pickled state.
#   aoti        — compiled for one CPU ISA / GPU arch and one torch version: least portable of fp32.
#   onnx-fp16, fp16, bf16 — reduced precision: larger numerical error and speed that depends on the
#                 hardware (fp16 was slower than fp32 on our CPUs); only worth it when measurably faster.
#   onnx-int8-dynamic, onnx-int8-static, int8 — quantized: judged by the task's gate rather than
#                 per element, hardware-dependent speed (VNNI/AMX), last: they win only when faster
#                 beyond the noise.
SIMPLICITY_ORDER = ("onnx", "torchscript", "eager", "aoti", "onnx-fp16", "fp16", "bf16",
                    "onnx-int8-dynamic", "onnx-int8-static", "int8")


class SelectionError(RuntimeError):
    """No decision is possible, or serve.require_slo is set and the decision misses the SLO."""


@dataclass(frozen=True)
class Criteria:
    latency_slo_ms: float = 200.0
    objective: str = "throughput"
    memory_budget_mb: float = 4096.0
    max_cold_load_s: Optional[float] = None
    require_slo: bool = False
    allow_quantized: bool = False
    min_batch_gain: float = 0.05
    noise_floor: float = 0.03
    delay_headroom_share: float = 0.5
    expected_concurrency: int = 16
    rows_per_request: float = 1.0       # of the expected load (pipeline/decide/rows.py); not a serve.* key

    @classmethod
    def from_serve(cls, serve: Any) -> "Criteria":
        s = dataclasses.asdict(serve) if dataclasses.is_dataclass(serve) else dict(serve)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in s.items() if k in names})


@dataclass
class Candidate:
    variant: str
    status: str                         # winner | eligible | rejected | skipped | failed
    reasons: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    accurate: bool = False              # converted, verification passed, benchmarked
    slo_ok: bool = False
    budget_failures: int = 0            # constraints other than the latency SLO that failed
    op: Optional[OperatingPoint] = None
    was: str = ""                       # status before a quantized variant was held back (opt-in)

    def record(self) -> dict:
        return {"status": self.status, "reasons": self.reasons, "figures": self.figures}


# --------------------------------------------------------------------------- objectives
@dataclass(frozen=True)
class Objective:
    """score: higher is better. noise: the relative difference below which two scores tie."""
    name: str
    score: Callable[[Candidate], float]
    noise: Callable[[Candidate, Candidate], float]
    describe: str


def _steady_noise(a: Candidate, b: Candidate) -> float:
    return math.hypot(a.figures.get("noise") or 0.0, b.figures.get("noise") or 0.0)


def _cold_spread(c: Candidate) -> float:
    med, mx = c.figures.get("cold_load_median_ms") or 0.0, c.figures.get("cold_load_max_ms") or 0.0
    return (mx - med) / med if med > 0 else 0.0


OBJECTIVES: dict[str, Objective] = {
    "throughput": Objective("throughput", lambda c: c.figures["throughput_sps"], _steady_noise,
                            "highest throughput at the served batch within the SLO"),
    "latency": Objective("latency", lambda c: -c.figures["request_p99_ms"], _steady_noise,
                         "lowest p99 per request"),
    "cold_load": Objective("cold_load", lambda c: -c.figures["cold_load_median_ms"],
                           lambda a, b: math.hypot(_cold_spread(a), _cold_spread(b)),
                           "shortest cold load (median of fresh processes)"),
}


def simplicity_rank(variant: str) -> int:
    return SIMPLICITY_ORDER.index(variant) if variant in SIMPLICITY_ORDER else len(SIMPLICITY_ORDER)


# --------------------------------------------------------------------------- evaluation
def evaluate(variant: str, conversion: Optional[dict], benchmark: Optional[dict], criteria: Criteria,
             workers_for: Optional[Callable[[dict], int]] = None) -> Candidate:
    """One variant against the constraints; never raises for a bad variant, records why instead.
    workers_for(benchmark): the worker count it would be served with (configure's; 1 when None)."""
    c = Candidate(variant, "failed")
    if conversion is None:
        c.reasons.append(f"no conversion record (artifacts/variants/{variant}/conversion.json): "
                         f"run `dvc repro convert@{variant}`")
        return c
    cstatus = conversion.get("status")
    ver = conversion.get("verification") or {}
    outs = ver.get("outputs") or []
    if outs:
        c.figures["max_abs_error"] = max(float(o.get("max_abs", 0.0)) for o in outs)
        cos = [o["min_cosine"] for o in outs if o.get("min_cosine") is not None]
        if cos:
            c.figures["min_cosine"] = min(cos)
    c.figures["dtype"] = conversion.get("dtype")
    if ver.get("task_gate"):          # int8: the gate's figures (recall@k, top-1 agreement...) travel with it
        c.figures["task_gate"] = ver["task_gate"]
    if ver.get("answers"):            # a decision task's answers against eager's (pipeline/accuracy/answers.py)
        c.figures["answers"] = ver["answers"]
    if cstatus == "skipped":          # the plan's screen: measured too slow on this device, never verified
        c.status = "skipped"
        c.reasons.append(f"skipped before verification: {conversion.get('reason') or 'no reason recorded'}")
        return c
    if cstatus == "rejected":
        c.status = "rejected"
        c.reasons.append(f"verification failed: {conversion.get('reason') or 'outside tolerance'}")
        return c
    if cstatus != "converted":
        c.reasons.append(f"conversion {cstatus or 'status missing'}: {conversion.get('reason') or 'no reason recorded'}")
        return c
    if benchmark is None:
        c.reasons.append(f"no benchmark record (metrics/benchmark/{variant}.json): run `dvc repro benchmark@{variant}`")
        return c
    if benchmark.get("status") != "ok":
        c.reasons.append(f"benchmark {benchmark.get('status')}: {benchmark.get('reason') or 'no reason recorded'}")
        return c
    try:
        curve = curve_from_benchmark(benchmark)
        cold_med, cold_max = cold_load_ms(benchmark)
    except DerivationError as e:
        c.reasons.append(str(e))
        return c

    # Judged at the point configure will serve it at: same worker count, same batch limit, same delay.
    workers = workers_for(benchmark) if workers_for else 1
    r = criteria.rows_per_request
    op = choose_operating_point(curve, criteria.latency_slo_ms, objective=criteria.objective,
                                min_gain=criteria.min_batch_gain, noise_floor=criteria.noise_floor,
                                headroom_share=criteria.delay_headroom_share, workers=workers,
                                max_batch=fill_limit(criteria.expected_concurrency, workers, r),
                                rows_per_request=r, fill_requests=max(1, criteria.expected_concurrency // workers))
    point = next(p for p in curve if p.batch_size == op.batch_size)
    rss, gpu = worker_memory_mb(benchmark, point)
    device = benchmark.get("device") or "cpu"
    mem, mem_kind = (gpu, "gpu") if device == "cuda" and gpu is not None else (rss, "rss")
    c.op, c.accurate = op, True
    c.figures.update({
        "device": device, "threads": benchmark.get("threads"), "artifact_bytes": benchmark.get("artifact_bytes"),
        "workers": workers, "batch_size": op.batch_size, "max_batch_delay_ms": op.delay_ms, "batch_p99_ms": op.batch_p99_ms,
        "request_p99_ms": op.request_p99_ms, "throughput_sps": op.throughput_sps,
        "cv": point.cv, "spread": point.spread, "noise": op.noise,
        "noisy": bool(benchmark.get("noisy") or point.noisy),
        "worker_memory_mb": mem, "memory_kind": mem_kind,
        "cold_load_median_ms": cold_med, "cold_load_max_ms": cold_max,
    })
    effort = benchmark.get("effort") or {}
    if effort.get("level") == "brief":     # pipeline/measure/effort.py: an inexact variant, measured in 2 rounds
        c.figures["benchmark_effort"] = "brief"
        c.reasons.append("benchmark: measured briefly (2 rounds, no start from disk; benchmark.inexact: brief)")
    if r != 1.0:   # batch_size and throughput_sps are rows; TorchServe's batch is batch_requests requests
        c.figures.update({"rows_per_request": r, "batch_requests": op.batch_requests})

    c.slo_ok = op.fits_slo
    if not op.fits_slo:
        over = op.request_p99_ms - criteria.latency_slo_ms
        c.reasons.append(f"latency SLO: p99 per request {op.request_p99_ms:.1f} ms (batch {op.batch_size} p99 "
                         f"{op.batch_p99_ms:.1f} ms + {op.delay_ms} ms delay) exceeds serve.latency_slo_ms "
                         f"{criteria.latency_slo_ms:g} ms by {over:.1f} ms")
    if mem is None:
        c.reasons.append("memory: no peak memory measured; cannot check serve.memory_budget_mb")
        c.budget_failures += 1
    elif mem > criteria.memory_budget_mb:
        c.reasons.append(f"memory: peak {mem_kind.upper()} {mem:.0f} MB per worker exceeds serve.memory_budget_mb "
                         f"{criteria.memory_budget_mb:g} MB by {mem - criteria.memory_budget_mb:.0f} MB")
        c.budget_failures += 1
    if criteria.max_cold_load_s is not None and cold_max / 1000.0 > criteria.max_cold_load_s:
        c.reasons.append(f"cold load: worst {cold_max / 1000.0:.2f} s exceeds serve.max_cold_load_s "
                         f"{criteria.max_cold_load_s:g} s by {cold_max / 1000.0 - criteria.max_cold_load_s:.2f} s")
        c.budget_failures += 1
    c.status = "eligible" if c.slo_ok and not c.budget_failures else "rejected"
    return c


def pick(cands: list[Candidate], objective: Objective, noise_floor: float) -> tuple[Candidate, dict]:
    """Best by the objective; among those within noise of the best, the simplest by SIMPLICITY_ORDER."""
    ranked = sorted(cands, key=lambda c: (-objective.score(c), simplicity_rank(c.variant)))
    best = ranked[0]
    sb = objective.score(best)
    tied = []
    for c in ranked:
        rel = abs(sb - objective.score(c)) / abs(sb) if sb else 0.0
        band = max(noise_floor, objective.noise(best, c))
        if rel <= band:
            tied.append({"variant": c.variant, "relative_gap": round(rel, 4), "noise_band": round(band, 4)})
    chosen = min((c for c in ranked if c.variant in {t["variant"] for t in tied}),
                 key=lambda c: simplicity_rank(c.variant))
    tie = {"best_by_figure": best.variant, "within_noise": tied, "chosen": chosen.variant,
           "order": list(SIMPLICITY_ORDER)}
    return chosen, tie


def select(variants: list[str], conversions: dict[str, Optional[dict]], benchmarks: dict[str, Optional[dict]],
           criteria: Criteria, workers_for: Optional[Callable[[dict], int]] = None) -> dict:
    """The decision record. Only `variants` (params order) are considered. workers_for: see `evaluate`."""
    if criteria.objective not in OBJECTIVES:
        raise SelectionError(f"serve.objective {criteria.objective!r} unknown; use one of {', '.join(OBJECTIVES)}")
    objective = OBJECTIVES[criteria.objective]
    cands = [evaluate(v, conversions.get(v), benchmarks.get(v), criteria, workers_for) for v in variants]
    held = hold_back_quantized(cands, criteria)
    eligible = [c for c in cands if c.status == "eligible"]
    accurate = [c for c in cands if c.accurate]
    tie = None
    if eligible:
        winner, tie = pick(eligible, objective, criteria.noise_floor)
        slo_met = True
        msg = (f"{winner.variant}: {objective.describe}: {winner.figures['throughput_sps']:.1f} samples/s at batch "
               f"{winner.figures['batch_size']}, p99 per request {winner.figures['request_p99_ms']:.1f} ms "
               f"<= SLO {criteria.latency_slo_ms:g} ms")
        if winner.figures.get("noisy"):
            msg += (" (its measurements are flagged noisy: a per-call CV above benchmark.max_cv after a "
                    "re-measure, or rounds whose p50s spread more than that; see metrics/benchmark)")
        if tie["best_by_figure"] != winner.variant:
            msg += (f"; chosen over {tie['best_by_figure']} because their figures are within measured noise "
                    f"and {winner.variant} is simpler (order {' > '.join(SIMPLICITY_ORDER)})")
    elif accurate:
        # Nothing meets every constraint: the accurate variant closest to meeting them — fewest budget
        # failures, then lowest p99 per request.
        winner = min(accurate, key=lambda c: (c.budget_failures, c.figures["request_p99_ms"],
                                              simplicity_rank(c.variant)))
        slo_met = False
        msg = (f"NO VARIANT MEETS THE CONSTRAINTS (SLO {criteria.latency_slo_ms:g} ms): serving the closest "
               f"accurate one, {winner.variant} (p99 per request {winner.figures['request_p99_ms']:.1f} ms at batch "
               f"{winner.figures['batch_size']}); its misses: {'; '.join(winner.reasons)}")
    else:
        winner, slo_met = None, False
        msg = ("no variant converted, passed verification and was benchmarked; nothing can be served: "
               + "; ".join(f"{c.variant}: {' / '.join(c.reasons)}" for c in cands))
    if winner is not None:
        winner.status = "winner"
    return {
        "winner": winner.variant if winner else None,
        "objective": criteria.objective,
        "slo_met": slo_met,
        "latency_slo_ms": criteria.latency_slo_ms,
        "message": msg,
        "operating_point": winner.op.as_dict() if winner and winner.op else None,
        "tie_break": tie,
        "criteria": dataclasses.asdict(criteria),
        "variants": {c.variant: c.record() for c in cands},
        "quantized_alternative": quantized_alternative(held, objective),
    }


def hold_back_quantized(cands: list[Candidate], criteria: Criteria) -> list[Candidate]:
    """Exact by default: unless the user opts in, quantized variants, and float ones that change the
    task's answers, cannot win (nor be the closest accurate fallback); they keep their figures so the
    decision can show what they would give."""
    if criteria.allow_quantized:
        return []
    held = [c for c in cands if c.accurate and inexact_because(c.variant, c.figures.get("answers"))]
    for c in held:
        c.was = c.status
        c.status, c.accurate = "opt-in", False
        why = inexact_because(c.variant, c.figures.get("answers"))
        c.reasons.append(f"{why}, so it is served only when params.yaml says `{OPT_IN}`")
    return held


def quantized_alternative(held: list[Candidate], objective: Objective) -> Optional[dict]:
    """The best held-back quantized variant: its speed and task-gate figures, and the line to opt in."""
    usable = [c for c in held if c.was == "eligible"] or held
    if not usable:
        return None
    best = max(usable, key=objective.score)
    return {"variant": best.variant, "opt_in": OPT_IN, "met_constraints": best.was == "eligible",
            "figures": {k: best.figures.get(k) for k in ("throughput_sps", "request_p99_ms", "batch_size",
                                                          "worker_memory_mb", "task_gate", "answers")
                        if k in best.figures}}


def check_decision(decision: dict, require_slo: bool) -> None:
    """Raise when the decision cannot be served, or misses the SLO and serve.require_slo is set."""
    if decision["winner"] is None:
        raise SelectionError(decision["message"])
    if require_slo and not decision["slo_met"]:
        raise SelectionError(decision["message"] + " — failing because serve.require_slo is true "
                             "(raise serve.latency_slo_ms / memory_budget_mb, or set require_slo false)")


def tied_contenders(selection: dict) -> list[str]:
    """The eligible variants tied with the winner within the measured noise, closest first."""
    tied = ((selection.get("tie_break") or {}).get("within_noise")) or []
    ranked = sorted(tied, key=lambda t: t.get("relative_gap", 0.0))
    return [t["variant"] for t in ranked if t.get("variant") != selection.get("winner")]
