"""Gate figures of the text tasks with a head, in each task's terms (eager = the reference):
- text-classification: top-1 label agreement and the largest score difference (softmax, or sigmoid
  for one label) — a shifted score moves what a threshold on it decides;
- rerank: rows come in queries of `RERANK_GROUP` consecutive rows (the golden set's rows are each
  query's texts in a row); per query, top-1 agreement and NDCG@10 of the variant's order with the
  reference's sigmoid scores as the gains;
- token-classification: entity-level F1 of the variant's entities against the reference's (BIO spans
  from the argmax labels, exact span + type, seqeval-style): it catches a collapse (a static int8
  NER model has been reported at F1 10 against 94), not only drift.
Only numpy here.
"""
from __future__ import annotations

import numpy as np

TEXT_CLASSIFICATION, RERANK, TOKENS = "text-classification", "rerank", "token-classification"
KINDS = (TEXT_CLASSIFICATION, RERANK, TOKENS)
RERANK_GROUP = 10
NDCG_AT = 10


def probabilities(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, or the sigmoid of a single logit (transformers' default choice)."""
    x = np.asarray(logits, dtype=np.float64)
    if x.shape[-1] == 1:
        return 1.0 / (1.0 + np.exp(-x))
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _scores(logits: np.ndarray) -> np.ndarray:
    return probabilities(logits.reshape(logits.shape[0], -1))


def text_classification_figures(got: np.ndarray, ref: np.ndarray) -> dict:
    g, r = _scores(got), _scores(ref)
    same = g.argmax(axis=1) == r.argmax(axis=1)
    diff = np.abs(g - r).max(axis=1)
    return {"kind": TEXT_CLASSIFICATION, "samples": int(len(r)), "label_agreement": float(same.mean()),
            "max_score_diff": float(diff.max()), "disagreeing_samples": np.flatnonzero(~same)[:10].tolist(),
            "worst_score_sample": int(diff.argmax())}


def ndcg(order: np.ndarray, gains: np.ndarray, k: int = NDCG_AT) -> float:
    discounts = 1.0 / np.log2(np.arange(2, k + 2))
    got = (gains[order[:k]] * discounts[:len(order[:k])]).sum()
    ideal = (np.sort(gains)[::-1][:k] * discounts[:min(k, len(gains))]).sum()
    return float(got / ideal) if ideal > 0 else 1.0


def rerank_figures(got: np.ndarray, ref: np.ndarray, group: int = RERANK_GROUP) -> dict:
    g, r = got.reshape(-1).astype(np.float64), ref.reshape(-1).astype(np.float64)
    gains = 1.0 / (1.0 + np.exp(-r))
    top1, ndcgs = [], []
    for s in range(0, len(r), group):
        gq, rq = g[s:s + group], r[s:s + group]
        order = np.argsort(-gq, kind="stable")
        top1.append(order[0] == np.argsort(-rq, kind="stable")[0])
        ndcgs.append(ndcg(order, gains[s:s + group]))
    worst = int(np.argmin(ndcgs)) if ndcgs else None
    return {"kind": RERANK, "samples": int(len(r)), "queries": len(ndcgs),
            "top1_agreement": float(np.mean(top1)) if top1 else None,
            "ndcg_at_10": float(np.mean(ndcgs)) if ndcgs else None,
            "worst_ndcg": float(ndcgs[worst]) if worst is not None else None, "worst_query": worst}


def spans(labels: list[str]) -> set[tuple[int, int, str]]:
    """BIO spans (start, end exclusive, type); an I- without its B- opens a span (seqeval's lenient rule)."""
    out, start, kind = set(), None, None
    for i, name in enumerate(list(labels) + ["O"]):
        bi, tag = (name[:1], name[2:]) if name[:2] in ("B-", "I-") else ("O", None)
        if start is not None and (bi != "I" or tag != kind):
            out.add((start, i, kind))
            start = None
        if bi == "B" or (bi == "I" and start is None):
            start, kind = i, tag
    return out


def entity_figures(got_batches: list[np.ndarray], ref_batches: list[np.ndarray], labels: list[str]) -> dict:
    """Entity-level F1 of the variant against the reference over every row of every batch
    ([batch, tokens, labels] each; padded positions label alike in both and rarely matter).
    Without label names (a calibration set), label 0 is taken as "O" and each other as its own type."""
    if not labels:
        n = int(np.asarray(ref_batches[0]).shape[-1])
        labels = ["O"] + [f"B-L{i}" for i in range(1, n)]
    tp = n_got = n_ref = 0
    changed, row = [], 0
    for got, ref in zip(got_batches, ref_batches):
        for g, r in zip(np.asarray(got).argmax(-1), np.asarray(ref).argmax(-1)):
            gs, rs = spans([labels[i] for i in g]), spans([labels[i] for i in r])
            tp, n_got, n_ref = tp + len(gs & rs), n_got + len(gs), n_ref + len(rs)
            if gs != rs:
                changed.append(row)
            row += 1
    precision = tp / n_got if n_got else 1.0
    recall = tp / n_ref if n_ref else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"kind": TOKENS, "samples": int(sum(len(r) for r in ref_batches)), "entities": n_ref,
            "entity_f1": float(f1), "precision": float(precision), "recall": float(recall),
            "changed_rows": len(changed), "changed_row_examples": changed[:10]}


def judge(figures: dict, tol) -> str | None:
    get = (lambda k: tol[k]) if isinstance(tol, dict) else (lambda k: getattr(tol, k))
    kind = figures["kind"]
    if kind == TEXT_CLASSIFICATION:
        if figures["label_agreement"] < get("min_top1_agreement"):
            return (f"label agreement {figures['label_agreement']:.4f} < min_top1_agreement "
                    f"{get('min_top1_agreement')} (samples {figures['disagreeing_samples']})")
        if figures["max_score_diff"] > get("atol"):
            return (f"score difference {figures['max_score_diff']:.4f} > atol {get('atol')} "
                    f"(sample {figures['worst_score_sample']})")
    elif kind == RERANK:
        if figures["top1_agreement"] is not None and figures["top1_agreement"] < get("min_top1_agreement"):
            return f"per-query top-1 agreement {figures['top1_agreement']:.4f} < min_top1_agreement {get('min_top1_agreement')}"
        if figures["ndcg_at_10"] is not None and figures["ndcg_at_10"] < get("min_ndcg"):
            return (f"NDCG@10 against eager {figures['ndcg_at_10']:.4f} < min_ndcg {get('min_ndcg')} "
                    f"(worst query {figures['worst_query']}: {figures['worst_ndcg']:.3f})")
    elif figures["entity_f1"] < get("min_entity_f1"):
        return (f"entity F1 against eager {figures['entity_f1']:.4f} < min_entity_f1 {get('min_entity_f1')} "
                f"(precision {figures['precision']:.3f}, recall {figures['recall']:.3f})")
    return None


def summary(figures: dict) -> str:
    if figures["kind"] == TEXT_CLASSIFICATION:
        return (f"label agreement {figures['label_agreement']:.4f}, max score diff {figures['max_score_diff']:.4f} "
                f"over {figures['samples']} samples")
    if figures["kind"] == RERANK:
        return (f"top-1 agreement {figures['top1_agreement']:.4f}, NDCG@10 {figures['ndcg_at_10']:.4f} "
                f"over {figures['queries']} queries")
    return f"entity F1 {figures['entity_f1']:.4f} over {figures['entities']} entities"
