"""Exact by default: a float variant's answers compared as a client reads them (pipeline/accuracy/answers.py),
through verify.compare on hand-made outputs shaped like each decision task's golden set."""
from __future__ import annotations

import numpy as np

from pipeline.accuracy import answers
from pipeline.accuracy.verify import compare
from pipeline.core.params import Tolerance

BF16 = Tolerance(atol=8e-2, rtol=1e-1, min_cosine=0.995)
LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


def check(task, got, ref, labels=None):
    results = [(len(r), [g], [r]) for g, r in zip(got, ref)]
    return compare(results, ["logits"], BF16, classification=False, min_topk_agreement=0.99,
                   task=task, labels=labels)


def test_order_breaks_counts_swaps_beyond_a_tie_and_new_ties():
    ref = np.array([0.9, 0.5, 0.49999999, 0.1])
    assert answers.order_breaks(ref.copy(), ref) == 0
    assert answers.order_breaks(np.array([0.9, 0.49999, 0.5, 0.1]), ref) == 0      # a tie may swap
    assert answers.order_breaks(np.array([0.5, 0.9, 0.4, 0.1]), ref) == 1          # a real swap
    assert answers.order_breaks(np.array([0.9, 0.5, 0.5, 0.5]), ref) == 2          # rounding made a tie of 0.5 vs 0.1
    # only the reference's top items are judged: a swap at the tail is no change of the top 2
    assert answers.order_breaks(np.array([0.9, 0.5, 0.1, 0.4]), ref, top=2) == 0


def test_rerank_variant_within_its_float_tolerance_that_swaps_close_texts_is_verified_but_not_exact():
    rng = np.random.default_rng(0)
    ref = [rng.normal(0, 3, (10, 1)).astype(np.float32) for _ in range(3)]
    ref[1][3, 0], ref[1][7, 0] = 1.00, 1.03            # two texts 0.03 logits apart in query 1
    got = [r.copy() for r in ref]
    got[1][3, 0], got[1][7, 0] = 1.04, 1.00            # rounding swaps them: within bf16's atol 0.08
    v = check("rerank", got, ref)
    assert v.passed
    assert v.answers["exact"] is False and v.answers["changed_samples"] == 1 and v.answers["queries"] == 3
    assert "1 of 3 queries' texts come in another order" in v.answers["reason"]
    same = check("rerank", [r + 1e-7 for r in ref], ref)
    assert same.passed and same.answers["exact"] is True and same.answers["changed_samples"] == 0


def test_ner_variant_that_moves_an_entity_boundary_is_not_exact():
    ref = np.full((1, 6, 5), -4.0, dtype=np.float32)
    ref[0, :, 0] = 4.0                                  # all O ...
    ref[0, 1, 1], ref[0, 1, 0] = 3.0, 2.0               # ... B-PER at 1
    ref[0, 2, 2], ref[0, 2, 0] = 2.03, 2.0              # I-PER at 2 by 0.03 logits
    got = ref.copy()
    got[0, 2, 2], got[0, 2, 0] = 2.0, 2.05              # bf16 rounding: token 2 becomes O
    v = check("token-classification", [got], [ref], LABELS)
    assert v.passed and v.answers["exact"] is False
    assert v.answers["entity_f1"] == 0.0 and "entities differ from eager's" in v.answers["reason"]
    assert check("token-classification", [ref.copy()], [ref], LABELS).answers["exact"] is True


def test_classification_scores_that_move_more_than_a_client_tolerates_are_not_exact():
    ref = np.array([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5]], dtype=np.float32)
    got = ref + np.array([[0.0, 0.0, 0.0], [0.0, 0.15, 0.0]], dtype=np.float32)   # same order, p moves ~0.03
    v = check("text-classification", [got], [ref])
    assert v.passed and v.answers["exact"] is False and "a score moves by" in v.answers["reason"]
    assert check("image-classification", [ref + 1e-6], [ref]).answers["exact"] is True


def test_embeddings_and_tensors_have_no_answers_to_change():
    ref = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    assert check("text-embedding", [ref.copy()], [ref]).answers is None
    assert check("tensor", [ref.copy()], [ref]).answers is None
    assert "answers" not in check("tensor", [ref.copy()], [ref]).as_dict()
