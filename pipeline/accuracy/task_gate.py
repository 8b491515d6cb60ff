"""The accuracy gate in the task's language, for tolerances with `gate: task` (int8).

Per-element bounds suit float conversions, whose error is rounding noise. Quantization moves every
value a little and a few a lot; what a user of the model cares about is whether it still does its
job. So (thresholds from `conversion.tolerances.<dtype>`):
- text-embedding: every sample's cosine to the reference >= min_cosine, AND the reference's nearest
  neighbours survive: for each golden sample, its k nearest other samples by the reference embeddings
  vs by the variant's; recall@k = mean share of the reference neighbours found, >= min_recall_at_k.
  k = min(recall_k, (samples - 1) // 4), at least 1: neighbours stay a small share of the set, or
  recall would be near 1 by construction (MiniLM's 129 golden sentences: k = 10; 12 samples: k = 2).
- image-classification: top-1 agreement (share of samples whose top class is the reference's)
  >= min_top1_agreement, AND mean top-k overlap (share of the reference's top-k classes found in the
  variant's top-k, k = min(topk, classes)) >= min_topk_overlap; over HTTP, the answers' labels
  (`[{"label", "score"}]`, best first).
- tensor: the element-wise rule (atol/rtol + per-sample cosine), judged by pipeline.accuracy.verify.
The same figures judge the golden set (pipeline.accuracy.verify), the calibration set during the sensitivity
fallback (pipeline.build.variants.int8) and the HTTP responses of a served .mar (pipeline.serve.checks.parity).
Only numpy here.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from pipeline.accuracy import task_gate_text

EMBEDDING = "text-embedding"
CLASSIFICATION = "image-classification"
TASK_KINDS = (EMBEDDING, CLASSIFICATION, *task_gate_text.KINDS)     # tensor uses the element-wise rule


def _get(tol: Any, name: str):
    return tol[name] if isinstance(tol, dict) else getattr(tol, name)


def uses_task_gate(tol: Any, kind: Optional[str]) -> bool:
    """True when this tolerance judges this task by the task's figures instead of element-wise."""
    if tol is None:
        return False
    gate = tol.get("gate") if isinstance(tol, dict) else getattr(tol, "gate", "elementwise")
    return gate == "task" and kind in TASK_KINDS


def row_cosines(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    g = got.reshape(got.shape[0], -1).astype(np.float64)
    r = ref.reshape(ref.shape[0], -1).astype(np.float64)
    gn, rn = np.linalg.norm(g, axis=1), np.linalg.norm(r, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = (g * r).sum(axis=1) / (gn * rn)
    cos = np.where((gn == 0) & (rn == 0), 1.0, cos)
    return np.where(np.isfinite(cos), cos, 0.0)


def _neighbours(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of each row's k most cosine-similar OTHER rows (stable order)."""
    x = x.reshape(x.shape[0], -1).astype(np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    unit = x / np.where(norms == 0, 1.0, norms)
    sim = unit @ unit.T
    np.fill_diagonal(sim, -np.inf)
    return np.argsort(-sim, axis=1, kind="stable")[:, :k]


def embedding_figures(got: np.ndarray, ref: np.ndarray, recall_k: int) -> dict:
    """got/ref: (samples, dim). Every figure, and the worst sample by each."""
    n = got.shape[0]
    cos = row_cosines(got, ref)
    worst = int(np.argmin(cos)) if n else None
    out = {"kind": EMBEDDING, "samples": n, "min_cosine": float(cos.min()) if n else None,
           "mean_cosine": float(cos.mean()) if n else None, "worst_cosine_sample": worst,
           "k": None, "recall_at_k": None, "worst_recall": None, "worst_recall_sample": None}
    k = min(int(recall_k), max(1, (n - 1) // 4)) if n > 1 else 0
    if k >= 1:
        ref_nn, got_nn = _neighbours(ref, k), _neighbours(got, k)
        per = np.array([len(set(a) & set(b)) / k for a, b in zip(ref_nn, got_nn)])
        w = int(np.argmin(per))
        out.update(k=k, recall_at_k=float(per.mean()), worst_recall=float(per[w]), worst_recall_sample=w)
    return out


def topk_indices(logits: np.ndarray, k: int) -> np.ndarray:
    flat = logits.reshape(logits.shape[0], -1)
    return np.argsort(-flat, axis=1, kind="stable")[:, :min(k, flat.shape[1])]


def classification_figures(got_top: list[list[int]], ref_top: list[list[int]], topk: int) -> dict:
    """got_top/ref_top: per sample, class indices best first (at least 1 each)."""
    n = len(ref_top)
    same = [bool(g) and bool(r) and g[0] == r[0] for g, r in zip(got_top, ref_top)]
    k = min([topk] + [len(r) for r in ref_top] + [len(g) for g in got_top]) if n else topk
    overlap = [len(set(g[:k]) & set(r[:k])) / k for g, r in zip(got_top, ref_top)] if k else []
    disagree = [i for i, s in enumerate(same) if not s]
    w = int(np.argmin(overlap)) if overlap else None
    return {"kind": CLASSIFICATION, "samples": n, "k": k,
            "top1_agreement": (sum(same) / n) if n else None,
            "topk_overlap": float(np.mean(overlap)) if overlap else None,
            "top1_disagreements": len(disagree), "first_disagreeing_samples": disagree[:10],
            "worst_overlap": float(overlap[w]) if w is not None else None, "worst_overlap_sample": w}


def figures_from_outputs(kind: str, got: np.ndarray, ref: np.ndarray, tol: Any) -> dict:
    """The task figures of one output over all samples (rows of got/ref)."""
    if kind == EMBEDDING:
        return embedding_figures(got, ref, int(_get(tol, "recall_k")))
    if kind == CLASSIFICATION:
        k = int(_get(tol, "topk"))
        return classification_figures(topk_indices(got, k).tolist(), topk_indices(ref, k).tolist(), k)
    if kind == task_gate_text.TEXT_CLASSIFICATION:
        return task_gate_text.text_classification_figures(got, ref)
    if kind == task_gate_text.RERANK:
        return task_gate_text.rerank_figures(got, ref)
    raise ValueError(f"task {kind!r} has no task gate; it is judged element-wise")


def judge(figures: dict, tol: Any) -> Optional[str]:
    """The first reason the figures miss the gate, or None."""
    if figures["kind"] in task_gate_text.KINDS:
        return task_gate_text.judge(figures, tol)
    if figures["kind"] == EMBEDDING:
        if figures["min_cosine"] is not None and figures["min_cosine"] < _get(tol, "min_cosine"):
            return (f"cosine {figures['min_cosine']:.6f} < min_cosine {_get(tol, 'min_cosine')} "
                    f"(sample {figures['worst_cosine_sample']}; mean cosine {figures['mean_cosine']:.6f})")
        if figures["recall_at_k"] is not None and figures["recall_at_k"] < _get(tol, "min_recall_at_k"):
            return (f"recall@{figures['k']} of the reference's nearest neighbours {figures['recall_at_k']:.4f} "
                    f"< min_recall_at_k {_get(tol, 'min_recall_at_k')} (worst sample {figures['worst_recall_sample']}: "
                    f"{figures['worst_recall']:.2f}; min cosine {figures['min_cosine']:.6f})")
        return None
    if figures["kind"] == CLASSIFICATION:
        if figures["top1_agreement"] is not None and figures["top1_agreement"] < _get(tol, "min_top1_agreement"):
            return (f"top-1 agreement {figures['top1_agreement']:.4f} < min_top1_agreement "
                    f"{_get(tol, 'min_top1_agreement')} ({figures['top1_disagreements']} of {figures['samples']} "
                    f"samples differ, first {figures['first_disagreeing_samples']})")
        if figures["topk_overlap"] is not None and figures["topk_overlap"] < _get(tol, "min_topk_overlap"):
            return (f"top-{figures['k']} overlap {figures['topk_overlap']:.4f} < min_topk_overlap "
                    f"{_get(tol, 'min_topk_overlap')} (worst sample {figures['worst_overlap_sample']}: "
                    f"{figures['worst_overlap']:.2f})")
        return None
    raise ValueError(f"unknown gate figures kind {figures['kind']!r}")


def summary(figures: dict) -> str:
    """One line of the figures, for logs and reasons."""
    if figures["kind"] in task_gate_text.KINDS:
        return task_gate_text.summary(figures)
    if figures["kind"] == EMBEDDING:
        return (f"min cosine {figures['min_cosine']:.5f}, mean {figures['mean_cosine']:.5f}, "
                f"recall@{figures['k']} {figures['recall_at_k'] if figures['recall_at_k'] is None else round(figures['recall_at_k'], 4)}"
                f" over {figures['samples']} samples")
    return (f"top-1 agreement {figures['top1_agreement']:.4f}, top-{figures['k']} overlap "
            f"{figures['topk_overlap']:.4f} over {figures['samples']} samples")


# --------------------------------------------------------------------------- HTTP responses
def label_list(value: Any) -> bool:
    """A classification answer: `[{"label", "score"}, ...]`, best first."""
    return isinstance(value, list) and bool(value) and all(isinstance(c, dict) and "label" in c and "score" in c
                                                            for c in value)


def response_vector(kind: str, response: Any) -> Optional[list]:
    """What the gate compares in one JSON response: the embedding, or the labels best first."""
    if kind == EMBEDDING:
        v = response.get("embedding") if isinstance(response, dict) else None
        return v if isinstance(v, list) else None
    if kind == CLASSIFICATION and label_list(response):
        return [c["label"] for c in response]
    return None


def response_kind(expected: Any, task: Optional[str] = None) -> Optional[str]:
    """The gate an answer is judged by: an embedding's, or (image-classification) the labels' top-k."""
    if isinstance(expected, dict) and "embedding" in expected:
        return EMBEDDING
    if task == CLASSIFICATION and label_list(expected):
        return CLASSIFICATION
    return None


def check_response(got: Any, expected: Any, tol: Any, task: Optional[str] = None) -> tuple[bool, float, str]:
    """One response against the gate's per-sample part: (ok, error figure, first problem).
    Embedding: cosine >= min_cosine (error = 1 - cosine). Classification: same structure and the
    reference's top class among the variant's top-k (near-ties may swap; the shares are judged over
    all responses by `responses_figures`)."""
    kind = response_kind(expected, task)
    g, e = response_vector(kind, got), response_vector(kind, expected)
    if g is None or e is None:
        return False, math.inf, f"response: got {str(got)[:120]!r}, expected the shape of {str(expected)[:120]!r}"
    if kind == EMBEDDING:
        if len(g) != len(e):
            return False, math.inf, f"response.embedding: length {len(g)} != expected {len(e)}"
        cos = float(row_cosines(np.asarray([g], float), np.asarray([e], float))[0])
        if cos < _get(tol, "min_cosine"):
            return False, 1.0 - cos, f"response.embedding: cosine {cos:.6f} < min_cosine {_get(tol, 'min_cosine')}"
        return True, 1.0 - cos, ""
    if e[0] not in g:
        return False, 1.0, f"response: the reference's top label {e[0]!r} is not among the variant's {g}"
    return True, 0.0 if g[0] == e[0] else 1.0, ""


def responses_figures(pairs: list[tuple[Any, Any]], tol: Any, task: Optional[str] = None) -> Optional[dict]:
    """The gate's figures over (got, expected) response pairs; None when they carry no task output."""
    usable = [(response_vector(response_kind(e, task), g), response_vector(response_kind(e, task), e),
               response_kind(e, task)) for g, e in pairs]
    usable = [(g, e, k) for g, e, k in usable if g is not None and e is not None and k]
    if not usable:
        return None
    kind = usable[0][2]
    if kind == EMBEDDING:
        if len({len(e) for _, e, _ in usable} | {len(g) for g, _, _ in usable}) != 1:
            return None
        return embedding_figures(np.asarray([g for g, _, _ in usable], float),
                                 np.asarray([e for _, e, _ in usable], float), int(_get(tol, "recall_k")))
    return classification_figures([g for g, _, _ in usable], [e for _, e, _ in usable], int(_get(tol, "topk")))
