"""The text tasks' gate figures (pipeline/accuracy/task_gate_text.py): they pass a faithful variant
and catch drift and collapse in each task's terms."""
from __future__ import annotations

import numpy as np

from pipeline.accuracy import task_gate, task_gate_text as g
from pipeline.core.params import Tolerance

TOL = Tolerance(atol=5e-2, rtol=1e-1, min_cosine=0.995, gate="task")
LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


def test_spans_are_bio_entities_exact_span_and_type():
    assert g.spans(["O", "B-PER", "I-PER", "O", "B-LOC", "B-LOC", "I-PER"]) == {(1, 3, "PER"), (4, 5, "LOC"),
                                                                               (5, 6, "LOC"), (6, 7, "PER")}


def test_text_classification_label_agreement_and_score_difference():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(40, 3)) * 3
    ok = task_gate.figures_from_outputs("text-classification", ref + 1e-3, ref, TOL)
    assert ok["label_agreement"] == 1.0 and ok["max_score_diff"] < 1e-3 and task_gate.judge(ok, TOL) is None
    flipped = ref.copy()
    flipped[:5] = -flipped[:5]
    bad = task_gate.figures_from_outputs("text-classification", flipped, ref, TOL)
    assert bad["label_agreement"] < 0.97 and "label agreement" in task_gate.judge(bad, TOL)


def test_rerank_top1_and_ndcg_per_query():
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(50, 1)) * 3
    same = g.rerank_figures(ref + 1e-4, ref)
    assert same["queries"] == 5 and same["top1_agreement"] == 1.0 and same["ndcg_at_10"] > 0.9999
    shuffled = g.rerank_figures(-ref, ref)
    assert shuffled["top1_agreement"] == 0.0 and shuffled["ndcg_at_10"] < 0.9
    assert "top-1 agreement" in task_gate.judge(shuffled, TOL)


def test_entity_f1_catches_a_collapse_not_only_drift():
    rng = np.random.default_rng(2)
    ref = [rng.normal(size=(4, 12, 5)) * 4, rng.normal(size=(2, 20, 5)) * 4]   # token counts differ per batch
    same = g.entity_figures([r + 1e-3 for r in ref], ref, LABELS)
    assert same["entity_f1"] == 1.0 and same["entities"] > 5 and task_gate.judge(same, TOL) is None
    collapsed = [np.zeros_like(r) + np.array([5.0, 0, 0, 0, 0]) for r in ref]  # everything "O"
    bad = g.entity_figures(collapsed, ref, LABELS)
    assert bad["entity_f1"] == 0.0 and "entity F1" in task_gate.judge(bad, TOL)
