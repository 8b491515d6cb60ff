"""Quantize well or say why not: the whole model first, then per-layer sensitivity as the fallback.

`search` quantizes every candidate op (MatMul/Gemm/Conv with weights, or nn.Linear) and judges the
result on the calibration set with the variant's own gate (pipeline.verify.compare, so the same rule
as the golden-set verification). On a miss it measures each op's sensitivity — the output error when
ONLY that op is quantized (mean 1 - cosine per sample over the calibration set) — and keeps the most
sensitive ops in fp32: 1, 2, 4, ... of them until the gate passes, then bisects back to the fewest
that pass. It stops when `budget_s` is spent or `max_fp32_share` of the ops would be kept; then the
last (most-kept) attempt is returned and the golden-set verification rejects it with its figures.
The record says what was tried, each attempt's figures and which ops stayed fp32.

Format-agnostic: the caller passes `quantize(exclude, only)` → a handle and `run(handle)` → the
outputs per calibration batch (ONNX files or torch modules alike).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from pipeline.params import Tolerance
from pipeline.task_gate import row_cosines
from pipeline.verify import compare

log = logging.getLogger(__name__)

Outputs = list[list[np.ndarray]]          # per calibration batch: the outputs in order
TOP_RECORDED = 12                         # sensitivities kept in the record (most sensitive first)


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


def _figures(v) -> dict:
    if v.task_gate:
        return {name: {k: f[k] for k in ("min_cosine", "mean_cosine", "k", "recall_at_k", "top1_agreement",
                                         "topk_overlap") if k in f} for name, f in v.task_gate.items()}
    return {o.name: {"max_abs": o.max_abs, "min_cosine": o.min_cosine} for o in v.outputs}


def search(candidates: list[str], quantize: Callable[[list[str], Optional[list[str]]], Any],
           run: Callable[[Any], Outputs], cal: Calibration, tol: Tolerance, min_topk_agreement: float,
           budget_s: float, max_fp32_share: float) -> tuple[Any, dict]:
    """→ (the chosen quantized handle, the record for variant.json/conversion.json)."""
    t0 = time.perf_counter()
    record: dict[str, Any] = {"quantizable_ops": len(candidates), "ops": list(candidates), "judged_on": f"{len(cal.feeds)} calibration batches "
                              f"({sum(len(next(iter(f.values()))) for f in cal.feeds)} samples)", "attempts": []}

    def attempt(kept: list[str]):
        handle = quantize(kept, None)
        v = judge(cal, run(handle), tol, min_topk_agreement)
        record["attempts"].append({"fp32_ops": len(kept), "passed": v.passed, "figures": _figures(v),
                                   "reason": v.reason})
        log.info("int8 with %d op(s) kept fp32: %s — %s", len(kept), "passes" if v.passed else "misses", v.reason)
        return handle, v

    handle, v = attempt([])
    record["whole_model"] = record["attempts"][0]
    chosen, kept = handle, []
    spent = lambda: time.perf_counter() - t0 > budget_s  # noqa: E731
    if not v.passed and candidates and budget_s > 0:
        ranked, measured = _sensitivities(candidates, quantize, run, cal, t0, budget_s)
        record["sensitivity"] = {"measured": len(measured), "of": len(candidates),
                                 "most_sensitive": [{"op": op, "error": round(err, 7)}
                                                    for op, err in measured[:TOP_RECORDED]]}
        max_keep = max(1, math.floor(max_fp32_share * len(candidates)))
        fail_n, pass_n, handles = 0, None, {}
        n = 1
        while not spent():
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
                pass_n, handles[mid] = mid, h
            else:
                fail_n = mid
        n_final = pass_n if pass_n is not None else max(handles, default=0)
        if n_final:
            chosen, kept = handles[n_final], ranked[:n_final]
        record["stopped_by"] = ("gate passed" if pass_n is not None else
                                "budget" if spent() else "max_fp32_share")
    record["fp32_ops"] = kept
    record["passed_on_calibration"] = any(a["passed"] and a["fp32_ops"] == len(kept) for a in record["attempts"])
    record["search_s"] = round(time.perf_counter() - t0, 2)
    return chosen, record


def _sensitivities(candidates, quantize, run, cal, t0, budget_s) -> tuple[list[str], list[tuple[str, float]]]:
    """Each op's error when only it is quantized, most sensitive first; ops not measured within the
    budget follow in graph order (unknown sensitivity)."""
    measured = []
    for op in candidates:
        if time.perf_counter() - t0 > budget_s:
            break
        measured.append((op, output_error(run(quantize([], [op])), cal.reference)))
    measured.sort(key=lambda e: -e[1])
    seen = {op for op, _ in measured}
    return [op for op, _ in measured] + [op for op in candidates if op not in seen], measured
