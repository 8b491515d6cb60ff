"""Does a float variant still give the model's answers? The check behind "exact by default".

A variant within its dtype's element-wise tolerance can still change what a client reads: a bf16
NER tagger moves an entity boundary, a bf16 cross-encoder swaps two passages whose scores are close
(two logits a few thousandths apart round to the same bf16 value). For the tasks whose answer is a
decision, the golden set's answers are compared as the client reads them, against eager's:
- text-classification, image-classification: the reference's top `ORDER_TOP` labels keep their order
  and nothing else enters them (transformers' image pipeline answers 5 labels; text classifiers
  rarely have more), scores (softmax, or sigmoid for one logit) within `SCORE_ATOL`;
- rerank: every query's texts (`RERANK_GROUP` consecutive rows) in the same order, sigmoid scores
  within `SCORE_ATOL`;
- token-classification: the same entities (exact span and type: entity F1 1.0 against eager's),
  token scores within `SCORE_ATOL`.
Items whose reference scores are within `TIE` of each other may swap: a tie has no order.
A variant that changes an answer is still verified (it is within its float tolerance), but it is
not exact: selection holds it back as it holds back int8, unless params opt in. Embeddings and
tensors are not decisions: their float tolerance is their whole check. Only numpy here.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from pipeline.accuracy import task_gate_text as text

SCORE_ATOL = 0.01       # the scores a client reads (probabilities), as transformers' own tests compare them
TIE = 1e-5
ORDER_TOP = 5
CLASSIFICATION_KINDS = (text.TEXT_CLASSIFICATION, "image-classification")
KINDS = (*CLASSIFICATION_KINDS, text.RERANK, text.TOKENS)


def order_breaks(got: np.ndarray, ref: np.ndarray, top: Optional[int] = None, tie: float = TIE) -> int:
    """Pairs (i, j) where the reference puts i above j by more than a tie and the variant does not
    put i strictly above j; i ranges over the reference's `top` best (all when None)."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    lead = np.argsort(-ref, kind="stable")[:top] if top else np.arange(len(ref))
    above = ref[lead, None] - ref[None, :] > tie
    kept = got[lead, None] - got[None, :] > 0
    return int((above & ~kept).sum())


def _figures(kind: str, samples: int, changed: list[int], score_diff: float, n_changed: Optional[int] = None,
             **extra) -> dict:
    n = len(changed) if n_changed is None else n_changed
    return {"kind": kind, "samples": samples, "changed_samples": n, "changed_examples": changed[:5],
            "max_score_diff": round(float(score_diff), 6), **extra}


def figures(kind: str, got_batches: list[np.ndarray], ref_batches: list[np.ndarray],
            labels: Optional[list] = None) -> Optional[dict]:
    """The answer figures of one output over every golden batch; None for a task without decisions."""
    if kind not in KINDS:
        return None
    if kind == text.TOKENS:
        ents = text.entity_figures(got_batches, ref_batches, labels)
        diff = max((float(np.abs(text.probabilities(g) - text.probabilities(r)).max())
                    for g, r in zip(got_batches, ref_batches)), default=0.0)
        return _figures(kind, ents["samples"], ents["changed_row_examples"], diff, n_changed=ents["changed_rows"],
                        entities=ents["entities"], entity_f1=ents["entity_f1"], precision=ents["precision"],
                        recall=ents["recall"])
    got = np.concatenate([np.asarray(g) for g in got_batches])
    ref = np.concatenate([np.asarray(r) for r in ref_batches])
    gp, rp = text.probabilities(got.reshape(len(got), -1)), text.probabilities(ref.reshape(len(ref), -1))
    diff = float(np.abs(gp - rp).max()) if gp.size else 0.0
    if kind == text.RERANK:
        g, r = gp.reshape(-1), rp.reshape(-1)
        starts = range(0, len(r), text.RERANK_GROUP)
        changed = [q for q, s in enumerate(starts)
                   if order_breaks(g[s:s + text.RERANK_GROUP], r[s:s + text.RERANK_GROUP])]
        return _figures(kind, len(r), changed, diff, queries=len(starts))
    changed = [i for i in range(len(rp)) if order_breaks(gp[i], rp[i], top=ORDER_TOP)]
    return _figures(kind, len(rp), changed, diff)


def changed(f: dict) -> Optional[str]:
    """Why these answers are not eager's, or None when every answer a client reads is the same."""
    if f["kind"] == text.TOKENS and f["changed_samples"]:
        return (f"{f['changed_samples']} of {f['samples']} samples' entities differ from eager's: entity F1 "
                f"{f['entity_f1']:.4f} over {f['entities']} entities (samples {f['changed_examples']})")
    if f["kind"] == text.RERANK and f["changed_samples"]:
        return (f"{f['changed_samples']} of {f['queries']} queries' texts come in another order than eager's "
                f"(queries {f['changed_examples']})")
    if f["kind"] in CLASSIFICATION_KINDS and f["changed_samples"]:
        return (f"{f['changed_samples']} of {f['samples']} samples' top-{ORDER_TOP} labels differ from eager's "
                f"(samples {f['changed_examples']})")
    if f["max_score_diff"] > SCORE_ATOL:
        return f"a score moves by {f['max_score_diff']:.4f} against eager's (more than {SCORE_ATOL})"
    return None


def summary(f: dict) -> str:
    head = (f"entity F1 {f['entity_f1']:.4f}" if f["kind"] == text.TOKENS else
            f"{f['changed_samples']} of {f.get('queries', f['samples'])} "
            f"{'queries' if f['kind'] == text.RERANK else 'samples'} reordered")
    return f"{head}, max score diff {f['max_score_diff']:.4g}"
