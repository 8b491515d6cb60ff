"""Verify a built variant against the golden set, through the same runtime serving uses.

Every golden batch (every batch size present: batch 1, the largest, several distinct batches) runs
through `handlers.runtimes.load_runtime`, and each output is compared with the eager fp32 reference.

The rule (tolerances per dtype from `conversion.tolerances`); a variant passes when ALL hold:
1. shapes match and every value is finite where the reference is;
2. every element: |got - ref| <= atol + rtol * |ref|   (numpy.allclose's rule: atol covers values near
   zero, where a relative error means nothing; rtol scales with large values);
3. per sample (one row of the batch, flattened): cosine(got, ref) >= min_cosine — catches a
   systematic drift that stays inside the per-element band, e.g. a whole embedding rotated;
4. classification: the share of samples whose top-1 class matches >= min_topk_agreement.
A runtime error at some batch size (a trace that only works at its trace batch size) fails too,
naming the batch size. A tolerance with `gate: task` (int8) replaces rules 2-4 for embeddings and
classification by the task's figures over all golden samples (pipeline/accuracy/task_gate.py), recorded
under `task_gate`; tensors keep rules 1-3 with that tolerance's atol/rtol/cosine. The worst element is the one with the largest |diff| / (atol + rtol*|ref|).
`max_rel` is reported over elements with |ref| > atol (relative error of near-zero values is noise).
A float variant that passes, of a task whose answer is a decision (labels, an order, entities), is also
compared as a client reads it (pipeline/accuracy/answers.py), recorded under `answers`: one that changes
an answer stays verified but is not exact, and selection serves it only on opt-in.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from pipeline.accuracy import answers, task_gate
from pipeline.core.params import Tolerance
from pipeline.accuracy.task_gate import row_cosines as _cosines


@dataclass
class OutputCheck:
    name: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    min_cosine: float = 1.0
    topk_agreement: Optional[float] = None
    # internal tallies
    _worst_ratio: float = field(default=-1.0, repr=False)
    _worst: Optional[dict] = field(default=None, repr=False)
    _min_cos_at: Optional[dict] = field(default=None, repr=False)
    _top1_same: int = field(default=0, repr=False)
    _top1_total: int = field(default=0, repr=False)

    def as_dict(self) -> dict:
        return {"name": self.name, "max_abs": self.max_abs, "max_rel": self.max_rel,
                "min_cosine": self.min_cosine, "topk_agreement": self.topk_agreement}


@dataclass
class Verification:
    passed: bool
    reason: str
    batch_sizes: list[int]
    outputs: list[OutputCheck]
    worst: Optional[dict]
    seconds: float = 0.0
    task_gate: Optional[dict] = None      # gate 'task': {output: figures} (pipeline/accuracy/task_gate.py)
    answers: Optional[dict] = None        # float variants of a decision task: exact or not (pipeline/accuracy/answers.py)

    def as_dict(self) -> dict:
        d = {"passed": self.passed, "batch_sizes": self.batch_sizes,
             "outputs": [o.as_dict() for o in self.outputs], "worst": self.worst,
             "seconds": round(self.seconds, 3)}
        if self.task_gate is not None:
            d["task_gate"] = self.task_gate
        if self.answers is not None:
            d["answers"] = self.answers
        return d


def accumulate(check: OutputCheck, got: np.ndarray, ref: np.ndarray, tol: Tolerance,
               batch_size: int, classification: bool) -> Optional[str]:
    """Fold one batch's output into `check`; returns a reason when it cannot be compared at all."""
    if got.shape != ref.shape:
        return (f"output '{check.name}' has shape {tuple(got.shape)} at batch size {batch_size}, expected "
                f"{tuple(ref.shape)} (a trace that baked its example's batch size?)")
    got64, ref64 = got.astype(np.float64), ref.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(got64 - ref64)
        bound = tol.atol + tol.rtol * np.abs(ref64)
        ratio = np.where(np.isfinite(diff), diff / bound, np.inf)
    if ratio.size:
        i = int(np.argmax(ratio))
        if ratio.flat[i] > check._worst_ratio:
            check._worst_ratio = float(ratio.flat[i])
            check._worst = {"output": check.name, "batch_size": batch_size,
                            "index": [int(x) for x in np.unravel_index(i, ratio.shape)],
                            "got": float(got64.flat[i]), "expected": float(ref64.flat[i]),
                            "abs_diff": float(diff.flat[i]), "allowed": float(bound.flat[i])}
        finite = np.isfinite(diff)
        check.max_abs = max(check.max_abs, float(diff.max()) if finite.all() else float("inf"))
        big = np.abs(ref64) > tol.atol
        if big.any():
            with np.errstate(invalid="ignore"):
                rel = diff[big] / np.abs(ref64[big])
            check.max_rel = max(check.max_rel, float(np.nan_to_num(rel, nan=np.inf).max()))
        cos = _cosines(got64, ref64)
        j = int(np.argmin(cos))
        if check._min_cos_at is None or cos[j] < check.min_cosine:
            check.min_cosine = float(cos[j])
            check._min_cos_at = {"batch_size": batch_size, "sample": j}
    if classification and ref.ndim == 2:
        check._top1_same += int((np.argmax(got64, axis=1) == np.argmax(ref64, axis=1)).sum())
        check._top1_total += ref.shape[0]
        check.topk_agreement = check._top1_same / check._top1_total
    return None


def judge(checks: list[OutputCheck], tol: Tolerance, min_topk_agreement: float) -> Optional[str]:
    """The first reason the collected figures fail the rule, or None."""
    for c in checks:
        if c._worst_ratio > 1.0:
            w = c._worst
            idx = ", ".join(map(str, w["index"]))
            what = "a non-finite value (fp16 overflow?)" if not np.isfinite(w["got"]) else f"{w['got']:.6g}"
            return (f"output '{c.name}' at batch size {w['batch_size']}, element [{idx}]: got {what}, expected "
                    f"{w['expected']:.6g} (|diff| {w['abs_diff']:.3g} > atol {tol.atol:g} + rtol {tol.rtol:g}*|ref| "
                    f"= {w['allowed']:.3g})")
    for c in checks:
        if c.min_cosine < tol.min_cosine:
            at = c._min_cos_at or {}
            return (f"output '{c.name}': cosine {c.min_cosine:.6f} < min_cosine {tol.min_cosine} "
                    f"(batch size {at.get('batch_size')}, sample {at.get('sample')})")
    for c in checks:
        if c.topk_agreement is not None and c.topk_agreement < min_topk_agreement:
            return (f"output '{c.name}': top-1 agreement {c.topk_agreement:.4f} < min_topk_agreement "
                    f"{min_topk_agreement}")
    return None


def task_gate_figures(results: list, output_names: list[str], tol: Tolerance, kind: str,
                      labels: Optional[list] = None) -> dict:
    """Every 2-D output's task figures over all samples of all batches; each sample named by its
    (batch number, row) so the worst can be found in the golden set."""
    figures = {}
    if kind == task_gate.task_gate_text.TOKENS:      # [batch, tokens, labels], tokens differ per batch
        return {output_names[0]: task_gate.task_gate_text.entity_figures(
            [g[0] for _, g, _ in results], [r[0] for _, _, r in results], labels)}
    where = [(k, row) for k, (_, got, _) in enumerate(results) for row in range(np.asarray(got[0]).shape[0])]
    for i, name in enumerate(output_names):
        got = np.concatenate([np.asarray(g[i]) for _, g, _ in results])
        ref = np.concatenate([np.asarray(r[i]) for _, _, r in results])
        if got.ndim != 2:
            continue
        f = task_gate.figures_from_outputs(kind, got, ref, tol)
        for key in ("worst_cosine_sample", "worst_recall_sample", "worst_overlap_sample"):
            if f.get(key) is not None:
                batch, row = where[f[key]]
                f[key] = {"sample": f[key], "batch": batch, "batch_size": results[batch][0], "row": row}
        figures[name] = f
    return figures


def compare(results: list[tuple[int, list[np.ndarray], list[np.ndarray]]], output_names: list[str],
            tol: Tolerance, classification: bool, min_topk_agreement: float,
            task: Optional[str] = None, labels: Optional[list] = None) -> Verification:
    """Pure comparison: `results` = [(batch_size, got_outputs, reference_outputs)] per golden batch.
    `task` (the golden set's task kind) matters only for a tolerance with `gate: task`."""
    checks = [OutputCheck(n) for n in output_names]
    sizes: list[int] = []
    for batch_size, got, ref in results:
        if len(got) != len(ref):
            return Verification(False, f"the variant returns {len(got)} output(s) at batch size {batch_size}, "
                                f"expected {len(ref)} ({output_names})", sorted(set(sizes)), checks, None)
        for c, g, r in zip(checks, got, ref):
            problem = accumulate(c, np.asarray(g), np.asarray(r), tol, batch_size, classification)
            if problem:
                return Verification(False, problem, sorted(set(sizes)), checks, c._worst)
        sizes.append(batch_size)
    worst = max(checks, key=lambda c: c._worst_ratio)._worst if checks else None
    if task_gate.uses_task_gate(tol, task):
        figures = task_gate_figures(results, output_names, tol, task, labels)
        reason = next((f"output '{name}': {r} (task gate figures: {task_gate.summary(f)})"
                       for name, f in figures.items() if (r := task_gate.judge(f, tol))), None)
        if not figures:
            reason = f"no 2-D output to judge by the {task} gate"
        ok_text = "verified (task gate: " + "; ".join(f"{n}: {task_gate.summary(f)}" for n, f in figures.items()) + ")"
        return Verification(reason is None, reason or ok_text, sorted(set(sizes)), checks, worst, task_gate=figures)
    reason = judge(checks, tol, min_topk_agreement)
    v = Verification(reason is None, reason or "verified", sorted(set(sizes)), checks, worst)
    if v.passed:
        v.answers = answers_check(results, task, labels)
    return v


def answers_check(results: list, task: Optional[str], labels: Optional[list]) -> Optional[dict]:
    """Whether a verified float variant still gives eager's answers in the task's terms (the first
    output: the head's logits); None for a task without decisions."""
    f = answers.figures(task, [g[0] for _, g, _ in results], [r[0] for _, _, r in results], labels)
    if f is None:
        return None
    why = answers.changed(f)
    return {"exact": why is None, "reason": why or f"the same answers as eager ({answers.summary(f)})", **f}


def verify_variant(model_dir: str | Path, golden, tol: Tolerance, min_topk_agreement: float = 0.99,
                   device: str = "cpu", threads: Optional[int] = None) -> Verification:
    """Run every golden batch through the variant's runtime and compare (see the module docstring)."""
    from handlers.runtimes import load_runtime
    t0 = time.perf_counter()
    classification = golden.task.get("kind") == "image-classification"
    runtime = load_runtime(model_dir, device=device, threads=threads)
    results = []
    try:
        for batch in golden.batches:
            try:
                got = runtime.run(batch.feeds)
            except Exception as e:
                last = traceback.format_exception_only(type(e), e)[-1].strip().splitlines()[0][:300]
                sizes = sorted({b for b, _, _ in results})
                v = Verification(False, f"running golden batch '{batch.file}' at batch size {batch.batch_size} "
                                 f"raised {last}", sizes, [OutputCheck(n) for n in golden.outputs], None)
                v.seconds = time.perf_counter() - t0
                return v
            results.append((batch.batch_size, got, batch.outputs))
    finally:
        runtime.close()
    v = compare(results, list(golden.outputs), tol, classification, min_topk_agreement,
                task=golden.task.get("kind"), labels=golden.task.get("labels"))
    v.seconds = time.perf_counter() - t0
    return v


FP16_MAX = 65504.0


def fp16_range_violation(dtype: str, golden) -> Optional[str]:
    """Why a float16 variant cannot be trusted, from the reference activations' range; None if it can.
    Checked before building: an overflow is a property of the model, whatever a runtime does with it."""
    if dtype != "float16":
        return None
    summary = (getattr(golden, "manifest", None) or {}).get("activation_range") or {}
    over = [m for m in summary.get("top_modules", []) if m["max_abs"] > FP16_MAX]
    if not over:
        return None
    worst = over[0]
    return (f"activations overflow float16: `{worst['module']}` (module: op) of the fp32 reference reaches "
            f"|x| = {worst['max_abs']:.4g} on the golden set, above the fp16 maximum {FP16_MAX:.0f} "
            f"({len(over)} of the largest modules are over); use bf16 or fp32 for this model")


def tolerance_for(params, dtype: str) -> Tolerance:
    return params.conversion.tolerances[dtype]
