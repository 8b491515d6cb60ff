"""Quantize well or say why not: the whole model first, then per-layer sensitivity as the fallback.

`search` quantizes every candidate op (MatMul/Gemm/Conv with weights, or nn.Linear) and judges the
result on the calibration set with the variant's own gate (pipeline.accuracy.verify.compare, so the same rule
as the golden-set verification) tightened by a MARGIN: every "at least" figure must reach a quarter
of the way from its threshold to 1 (min cosine 0.995 → 0.99625, recall@10 0.95 → 0.9625), every
"at most" bound is cut to three quarters — a calibration pass by a hair would miss the held-out
golden gate by a hair. The golden-set verification stays the only acceptance test.

On a miss it ranks the ops by sensitivity and keeps the most sensitive in fp32: 1, 2, 4, ... of them
until the (margined) gate passes, then bisects back to the fewest that pass. It starts no attempt
that would end past `budget_s` (by the mean attempt so far), nor one keeping more than
`max_fp32_share` of the ops; then the last (most-kept) attempt is returned and the golden-set
verification rejects it with its figures.

Ranking, cheap (`op_errors`, one model setup): the model's output error (mean 1 - cosine) when only
that op is int8, SIMULATED — its input fake-quantized u8 per tensor per call, its weight s8 per
channel — in one ORT session (switchable QDQ per op, overridable weights) or in the eager module
(hooks), over the first RANKING_BATCHES calibration batches: one forward pass per op instead of a
quantizer pass and a new session. Without `op_errors`: each op really quantized alone (slow). Real
quantized models are built only for the 1, 2, 4, ... attempts, judged over the whole calibration set.

Ranking, cheapest (`local_errors`, ONE forward pass for all ops): each op's own output error — its
fp32 input fake-quantized, its weight s8, against its fp32 output — a proxy that ignores how the error
propagates. It replaces the per-op ranking where that would not fit in RANKING_SHARE of the budget
(estimated from the whole-model attempt's run time): on a big model with a slow forward, the per-op
ranking would reach only some of its ops within the budget, the rest left in graph order.

Out of reach: before each 1, 2, 4, ... attempt the search asks whether the largest set of ops the
budget still allows to keep fp32 could remove the error the gate needs gone (`_reach`): the
whole-model attempt's missed figures say how much (a figure's miss, 1 - cosine or 1 - recall, taken
as proportional to the output error's variance: exact for cosine, optimistic for recall, whose miss
shrinks more slowly), the ranking says how much of it those ops carry. Where they carry less than
half of it (REACH_SLACK), the search stops there: a model whose error is spread evenly over many
ops, with slow attempts, could keep only a few of them fp32 within the budget, and would spend it on
attempts that end in the same rejection.

`state` (a dict the converter keeps across its build methods) caches the ranking per candidate set
and the time already spent, so a second build method neither re-ranks nor gets a second budget.

Format-agnostic: the caller passes `quantize(exclude, only)` → a handle and `run(handle, cal)` → the
outputs per batch of `cal` (ONNX files or torch modules alike).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import dataclasses

import numpy as np
import torch

from pipeline.core.params import Tolerance
from pipeline.accuracy.task_gate import row_cosines
from pipeline.accuracy.verify import compare

log = logging.getLogger(__name__)

Outputs = list[list[np.ndarray]]          # per calibration batch: the outputs in order
TOP_RECORDED = 12                         # sensitivities kept in the record (most sensitive first)
RANKING_BATCHES = 2                       # calibration batches the ranking looks at (judging uses all)
MARGIN = 0.25                             # share of the way from a threshold to 1 a calibration pass must reach
RANKING_SHARE = 0.25                      # the per-op ranking may take this share of the budget, else local errors
REACH_SLACK = 2.0                         # give up only when the reachable ops carry < 1/2 of the error to remove


@dataclass
class Calibration:
    """Representative inputs and the fp32 reference outputs on them."""
    feeds: list[dict[str, np.ndarray]]
    reference: Outputs
    output_names: list[str]
    task: str                              # golden task kind
    classification: bool = False


def output_error(got: Outputs, ref: Outputs) -> float:
    """Mean over samples (and outputs) of 1 - cosine(got, ref): how far an attempt moved the outputs."""
    errs = [1.0 - row_cosines(np.asarray(g), np.asarray(r)) for gb, rb in zip(got, ref) for g, r in zip(gb, rb)]
    return float(np.mean(np.concatenate(errs))) if errs else 0.0


def judge(cal: Calibration, got: Outputs, tol: Tolerance, min_topk_agreement: float):
    results = [(len(next(iter(f.values()))), g, r) for f, g, r in zip(cal.feeds, got, cal.reference)]
    return compare(results, cal.output_names, tol, cal.classification, min_topk_agreement, task=cal.task)


def with_margin(tol: Tolerance) -> Tolerance:
    """The gate the search must pass on the calibration set: stricter than the golden gate by MARGIN."""
    up = lambda t: round(t + MARGIN * (1.0 - t), 9)  # noqa: E731
    return dataclasses.replace(tol, atol=tol.atol * (1 - MARGIN), rtol=tol.rtol * (1 - MARGIN),
                               min_cosine=up(tol.min_cosine), min_recall_at_k=up(tol.min_recall_at_k),
                               min_top1_agreement=up(tol.min_top1_agreement),
                               min_topk_overlap=up(tol.min_topk_overlap))


def fake_quant_activation(x: torch.Tensor, lo: float, hi: float, reduce_range: bool) -> torch.Tensor:
    """u8 asymmetric per-tensor quantize → dequantize over [lo, hi] (widened to hold 0, as ORT does)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    levels = 127 if reduce_range else 255
    scale = (hi - lo) / levels or 1.0
    zp = round(-lo / scale)
    return (torch.clamp(torch.round(x / scale) + zp, 0, levels) - zp) * scale


def fake_quant_weight(w: torch.Tensor, axis: Optional[int], reduce_range: bool) -> torch.Tensor:
    """s8 symmetric quantize → dequantize, per channel along `axis` (None: per tensor)."""
    qmax = 63 if reduce_range else 127
    if axis is None:
        amax = w.abs().max()
    else:
        amax = w.abs().amax(dim=[d for d in range(w.dim()) if d != axis % w.dim()], keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return torch.clamp(torch.round(w / scale), -qmax, qmax) * scale


class LocalErrors:
    """Each op's own relative output error, sqrt(sum |y_q - y|^2 / sum |y|^2) over the batches it saw."""

    def __init__(self):
        self._num: dict[str, float] = {}
        self._den: dict[str, float] = {}

    def add(self, op: str, y: torch.Tensor, y_q: torch.Tensor) -> None:
        y, y_q = y.double(), y_q.double()
        self._num[op] = self._num.get(op, 0.0) + float(((y_q - y) ** 2).sum())
        self._den[op] = self._den.get(op, 0.0) + float((y ** 2).sum())

    def result(self) -> dict[str, float]:
        return {op: math.sqrt(n / self._den[op]) if self._den[op] > 0 else (0.0 if n == 0 else math.inf)
                for op, n in self._num.items()}


def _figures(v) -> dict:
    if v.task_gate:
        return {name: {k: f[k] for k in ("min_cosine", "mean_cosine", "k", "recall_at_k", "top1_agreement",
                                         "topk_overlap") if k in f} for name, f in v.task_gate.items()}
    return {o.name: {"max_abs": o.max_abs, "min_cosine": o.min_cosine} for o in v.outputs}


def search(candidates: list[str], quantize: Callable[[list[str], Optional[list[str]]], Any],
           run: Callable[[Any], Outputs], cal: Calibration, tol: Tolerance, min_topk_agreement: float,
           budget_s: float, max_fp32_share: float,
           op_errors: Optional[Callable[[list[str], float], dict[str, float]]] = None,
           state: Optional[dict] = None,
           local_errors: Optional[Callable[[list[str]], dict[str, float]]] = None) -> tuple[Any, dict]:
    """→ (the chosen quantized handle, the record for variant.json/conversion.json).
    `op_errors(candidates, deadline)` → each op's proxy error (one pass per op; see the module
    docstring), for the ops it reached before `deadline` (time.perf_counter()).
    `local_errors(candidates)` → each op's own output error, all from one pass."""
    state = {} if state is None else state
    budget_s = max(0.0, budget_s - state.get("spent_s", 0.0))    # one budget over all build methods
    t0 = time.perf_counter()
    margined = with_margin(tol)
    record: dict[str, Any] = {"quantizable_ops": len(candidates), "ops": list(candidates), "judged_on": f"{len(cal.feeds)} calibration batches "
                              f"({sum(len(next(iter(f.values()))) for f in cal.feeds)} samples)",
                              "margin": {"share_to_1": MARGIN, "min_cosine": margined.min_cosine,
                                         "min_recall_at_k": margined.min_recall_at_k,
                                         "min_top1_agreement": margined.min_top1_agreement,
                                         "min_topk_overlap": margined.min_topk_overlap,
                                         "atol": margined.atol, "rtol": margined.rtol},
                              "attempts": []}

    run_s: list[float] = []

    attempt_times: list[float] = []

    def attempt(kept: list[str]):
        t_attempt = time.perf_counter()
        handle = quantize(kept, None)
        t_run = time.perf_counter()
        got = run(handle, cal)
        run_s.append(time.perf_counter() - t_run)
        v = judge(cal, got, margined, min_topk_agreement)
        record["attempts"].append({"fp32_ops": len(kept), "passed": v.passed, "figures": _figures(v),
                                   "reason": v.reason})
        log.info("int8 with %d op(s) kept fp32: %s — %s", len(kept), "passes" if v.passed else "misses", v.reason)
        attempt_times.append(time.perf_counter() - t_attempt)
        return handle, v

    chosen, v = attempt([])
    record["whole_model"] = record["attempts"][0]
    kept: list[str] = []
    def spent() -> bool:
        """No attempt is started that would end past the budget (by the mean attempt so far): with
        slow attempts, one begun just inside the budget would end well past it."""
        attempt_s = sum(attempt_times) / len(attempt_times)
        return time.perf_counter() - t0 + attempt_s > budget_s
    if not v.passed and candidates and budget_s > 0:
        t_rank = time.perf_counter()
        cached = state.setdefault("rankings", {}).get(tuple(candidates))
        if cached:
            (ranked, measured, how, variance_like), reused = cached, True
        else:
            # One ranking forward ≈ the whole-model attempt's run over RANKING_BATCHES of its batches.
            forward_s = run_s[0] * min(RANKING_BATCHES, len(cal.feeds)) / max(1, len(cal.feeds))
            ranked, measured, how, variance_like = _rank(candidates, quantize, run, cal, t0, budget_s, op_errors,
                                                         local_errors, forward_s)
            state["rankings"][tuple(candidates)], reused = (ranked, measured, how, variance_like), False
        record["sensitivity"] = {"measured": len(measured), "of": len(candidates), "by": how,
                                 "reused_from_an_earlier_build_method": reused,
                                 "ranking_s": round(time.perf_counter() - t_rank, 2),
                                 "most_sensitive": [{"op": op, "error": round(err, 7)}
                                                    for op, err in measured[:TOP_RECORDED]]}
        max_keep = max(1, math.floor(max_fp32_share * len(candidates)))
        fail_n, pass_n, handles = 0, None, {}
        n = 1
        needed = needed_share(record["whole_model"]["figures"], margined)
        out_of_reach = False
        while not spent():
            reach = _reach(measured, variance_like, needed, n, max_keep,
                           budget_s - (time.perf_counter() - t0), sum(attempt_times) / len(attempt_times))
            if reach is not None:
                record["reach"] = reach
                if reach["out_of_reach"]:
                    out_of_reach = True
                    log.info("int8: %s", reach["why"])
                    break
            # Only the latest attempt can be chosen (a pass ends this loop; else the most-kept miss), so
            # no other is held: a torch attempt is a whole quantized model.
            chosen, handles = None, {}
            handles[n], v = attempt(ranked[:n])
            if v.passed:
                pass_n = n
                break
            fail_n = n
            if n >= max_keep:
                break
            n = min(2 * n, max_keep)
        while pass_n is not None and pass_n - fail_n > 1 and not spent():
            mid = (pass_n + fail_n) // 2
            h, v = attempt(ranked[:mid])
            if v.passed:
                pass_n, handles = mid, {mid: h}       # fewer kept fp32: the earlier pass is not needed
            else:
                fail_n = mid
            h = None
        n_final = pass_n if pass_n is not None else max(handles, default=0)
        if n_final:
            chosen, kept = handles[n_final], ranked[:n_final]
        record["stopped_by"] = ("gate passed" if pass_n is not None else "out of reach" if out_of_reach else
                                "budget" if spent() else "max_fp32_share")
    record["fp32_ops"] = kept
    record["passed_on_calibration"] = any(a["passed"] and a["fp32_ops"] == len(kept) for a in record["attempts"])
    record["search_s"] = round(time.perf_counter() - t0, 2)
    state["spent_s"] = state.get("spent_s", 0.0) + record["search_s"]
    return chosen, record


def needed_share(figures: dict, margined: Tolerance) -> Optional[float]:
    """The share of the quantization error an attempt must remove for these (missed) figures to pass
    `margined`: each missed "at least" figure's miss (1 - figure) must shrink to the gate's (1 -
    threshold), a miss taken as proportional to the error's variance. None when nothing known missed
    (e.g. only max_abs: no such figure), so no projection is made."""
    limits = {"min_cosine": margined.min_cosine, "recall_at_k": margined.min_recall_at_k,
              "top1_agreement": margined.min_top1_agreement, "topk_overlap": margined.min_topk_overlap}
    needed = None
    for output in figures.values():
        for key, limit in limits.items():
            got = output.get(key)
            if got is None or limit is None or got >= limit:
                continue
            share = 1.0 - (1.0 - limit) / max(1.0 - got, 1e-12)
            needed = share if needed is None else max(needed, share)
    return needed


def _reach(measured: list[tuple[str, float]], variance_like: bool, needed: Optional[float], n: int,
           max_keep: int, left_s: float, attempt_s: float) -> Optional[dict]:
    """Whether the most ops the doubling can still keep fp32 in `left_s` (n, 2n, ... ≤ max_keep, one
    attempt each) carry enough of the ranked error to remove `needed` of it. Unmeasured ops count as
    error-free (the optimistic side). None when no projection can be made."""
    if needed is None or not measured or attempt_s <= 0:
        return None
    weights = [max(e, 0.0) if variance_like else max(e, 0.0) ** 2 for _, e in measured]
    total = sum(weights)
    if not math.isfinite(total) or total <= 0:
        return None
    attempts = int(left_s // attempt_s)
    keep = 0 if attempts < 1 else min(n * 2 ** (attempts - 1), max_keep)
    share = sum(weights[:keep]) / total
    out = share < needed / REACH_SLACK
    why = (f"the budget's {attempts} more attempt(s) of ~{attempt_s:.2g} s can keep at most {keep} op(s) fp32, "
           f"carrying {share:.1%} of the ranked error; the gate needs {needed:.1%} of it removed"
           + (f" (less than 1/{REACH_SLACK:g} of that: out of reach, no further attempt)" if out else ""))
    return {"attempts_left": attempts, "attempt_s": round(attempt_s, 2), "keepable_ops": keep,
            "error_share_keepable": round(share, 4), "error_share_needed": round(needed, 4),
            "out_of_reach": out, "why": why}


def _rank(candidates, quantize, run, cal, t0, budget_s, op_errors, local_errors=None, forward_s=0.0):
    """→ (ops most sensitive first, [(op, error)] measured, how, variance_like): variance_like when the
    errors are the model's output error (1 - cosine, which adds up like variance), not an op's own
    relative RMS error (whose square does)."""
    per_op_s = len(candidates) * forward_s
    if local_errors is not None and (op_errors is None or per_op_s > RANKING_SHARE * budget_s):
        errors = local_errors(candidates)
        measured = sorted(errors.items(), key=lambda e: -e[1])
        seen = set(errors)
        why = (f"one forward per op would take ~{per_op_s:.0f} s of the {budget_s:.0f} s budget"
               if op_errors is not None else "no per-op ranking for this format")
        return ([op for op, _ in measured] + [op for op in candidates if op not in seen], measured,
                f"each op's own output error (its fp32 input fake-quantized u8, its weight s8, against its fp32 "
                f"output), all ops from one forward over {min(RANKING_BATCHES, len(cal.feeds))} calibration "
                f"batch(es) ({why})", False)
    if op_errors is not None:
        # The ranking spends the same budget: on a big model one forward per op can cost more than
        # the whole budget; ops not reached follow in graph order.
        errors = op_errors(candidates, t0 + budget_s)
        measured = sorted(errors.items(), key=lambda e: -e[1])
        seen = set(errors)
        return ([op for op, _ in measured] + [op for op in candidates if op not in seen], measured,
                f"the model's output error with only that op fake-quantized (u8 input per call, s8 weight), over "
                f"{min(RANKING_BATCHES, len(cal.feeds))} calibration batch(es)", True)
    ranked, measured = _sensitivities(candidates, quantize, run, cal, t0, budget_s)
    return ranked, measured, (f"the full model with only that op quantized, over "
                              f"{min(RANKING_BATCHES, len(cal.feeds))} calibration batch(es)"), True


def _sensitivities(candidates, quantize, run, cal, t0, budget_s) -> tuple[list[str], list[tuple[str, float]]]:
    """Each op's error when only it is quantized, most sensitive first; ops not measured within the
    budget follow in graph order (unknown sensitivity)."""
    few = dataclasses.replace(cal, feeds=cal.feeds[:RANKING_BATCHES], reference=cal.reference[:RANKING_BATCHES])
    measured = []
    for op in candidates:
        if time.perf_counter() - t0 > budget_s:
            break
        measured.append((op, output_error(run(quantize([], [op]), few), few.reference)))
    measured.sort(key=lambda e: -e[1])
    seen = {op for op, _ in measured}
    return [op for op, _ in measured] + [op for op in candidates if op not in seen], measured
