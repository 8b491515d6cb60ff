"""One served answer against its reference: every key exact but the score (within atol), near ties
let through in either order, and the cause of a mismatch in a few words."""
from __future__ import annotations

import json
from typing import Any, Optional

from scripts.served_compare.cases import Case

ATOL = 0.01
TIE_EPS = 1e-5


def same_answers(got, want, atol: float = ATOL) -> list[str]:
    """Differences between two answers: every key exact except `score` (within atol)."""
    problems = []
    if isinstance(want, dict):
        want = [want]
    if not isinstance(got, list):
        return [f"a {type(got).__name__} served vs a list of {len(want)} expected: {str(got)[:200]}"]
    if len(got) != len(want):
        k = next((i for i, (g, w) in enumerate(zip(got, want)) if not _same_item(g, w)), min(len(got), len(want)))
        return [f"{len(got)} items served vs {len(want)} expected; the first difference at item {k}: served "
                f"{_short(got[k:k + 1])} vs expected {_short(want[k:k + 1])}"]
    for k, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, list):
            problems += same_answers(g, w, atol)
            continue
        if not isinstance(g, dict):
            problems.append(f"item {k}: {g!r} vs {w!r}")
            continue
        w = {key: (float(v) if key == "score" else v) for key, v in w.items()}
        if set(g) != set(w):
            problems.append(f"item {k}: keys {sorted(g)} vs {sorted(w)}")
        for key in w:
            if key == "score":
                if not isinstance(g.get(key), (int, float)) or abs(g[key] - w[key]) > atol:
                    problems.append(f"item {k}: score {g.get(key)} vs {w[key]}")
            elif g.get(key) != w[key]:
                problems.append(f"item {k}: {key} {g.get(key)!r} vs {w[key]!r}")
    return problems


def _short(items) -> str:
    return json.dumps(items, default=float)[:200]


def _same_item(g, w) -> bool:
    """Every key but the score equal (the same label / index / entity and span)."""
    if not (isinstance(g, dict) and isinstance(w, dict)):
        return g == w
    return {k: v for k, v in g.items() if k != "score"} == {k: v for k, v in w.items() if k != "score"}


def max_score_diff(got, want) -> float:
    """The largest score difference over the items that agree in everything else (position by position)."""
    if isinstance(want, dict):
        want = [want]
    if not isinstance(got, list):
        return 0.0
    diffs = [0.0]
    for g, w in zip(got, want):
        if isinstance(w, list):
            diffs.append(max_score_diff(g, w))
        elif _same_item(g, w) and isinstance(g.get("score"), (int, float)):
            diffs.append(abs(float(g["score"]) - float(w["score"])))
    return max(diffs)


def _identity(item: dict):
    return item.get("label", item.get("index"))


def untie(got, want, eps: float = TIE_EPS) -> tuple[Any, int]:
    """`got` with items reordered inside runs of the reference whose scores are within `eps` of each
    other (ranked lists: label / index answers), and how many runs it had to reorder."""
    if isinstance(want, dict) or not isinstance(got, list) or not want or len(got) != len(want):
        return got, 0
    if isinstance(want[0], list):
        pairs = [untie(g, w, eps) for g, w in zip(got, want)]
        return [p[0] for p in pairs], sum(p[1] for p in pairs)
    if not all(isinstance(g, dict) for g in got) or _identity(want[0]) is None or "entity" in want[0]:
        return got, 0
    out, ties, start = list(got), 0, 0
    while start < len(want):
        end = start + 1
        while end < len(want) and abs(float(want[end]["score"]) - float(want[start]["score"])) <= eps:
            end += 1
        run = {_identity(w): i for i, w in enumerate(want[start:end])}
        block = got[start:end]
        if end - start > 1 and [_identity(g) for g in block] != list(run) and \
                sorted(map(str, run)) == sorted(str(_identity(g)) for g in block):
            out[start:end] = sorted(block, key=lambda g: run[_identity(g)])
            ties += 1
        start = end
    return out, ties


def judge(case: Case, atol: float = ATOL) -> Case:
    status, answer = case.served
    if status != 200:
        case.problems = [f"HTTP {status}: {answer}"]
        return case
    untied, case.ties = untie(answer, case.want)
    case.problems = same_answers(untied, case.want, atol)
    case.max_diff = max_score_diff(untied, case.want)
    if case.problems:
        case.cause = cause_of(answer, case.want, case.problems, atol, case.ref.get("scores"))
    return case


def near_tie_order(answer, want, atol: float, scores: Optional[dict] = None) -> bool:
    """A ranked answer whose every item sits where the reference has an item scored within `atol` of it
    (by the item's own reference score: `scores` holds those of items the reference cut off by top_n /
    top_k), every score within atol of its reference: the order moved only among near ties."""
    if isinstance(want, dict) or not isinstance(answer, list) or len(answer) != len(want):
        return False
    if want and isinstance(want[0], list):
        return all(near_tie_order(g, w, atol) for g, w in zip(answer, want))
    if not want or not all(isinstance(x, dict) for x in answer) or _identity(want[0]) is None or "entity" in want[0]:
        return False
    ref = {**(scores or {}), **{_identity(w): float(w["score"]) for w in want}}
    for g, w in zip(answer, want):
        own = ref.get(_identity(g))
        if own is None or abs(own - float(w["score"])) > atol or abs(float(g["score"]) - own) > atol:
            return False
    return True


def cause_of(answer, want, problems: list[str], atol: float, scores: Optional[dict] = None) -> str:
    """What a mismatch is, in a few words: scores only, an order among near ties, or a decision."""
    if all(p.partition(": ")[2].startswith("score ") for p in problems):
        return f"score off by more than {atol}"
    if near_tie_order(answer, want, atol, scores):
        return f"order of items whose reference scores are within {atol}"
    flat = want[0] if isinstance(want, list) and want and isinstance(want[0], list) else want
    if isinstance(flat, list) and flat and isinstance(flat[0], dict) and {"entity", "entity_group"} & set(flat[0]):
        return "entities differ (label or span)"
    return "labels / order differ"
