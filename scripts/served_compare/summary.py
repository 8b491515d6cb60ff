"""The check's report: counts per request kind, mismatches with their causes, task figures
(entity F1, first-answer agreement) and the printed table."""
from __future__ import annotations

import json

from scripts.served_compare.cases import Case
from scripts.served_compare.judging import untie


def summarize(cases: list[Case]) -> dict:
    kinds: dict[str, dict] = {}
    for c in cases:
        row = kinds.setdefault(c.kind, {"requests": 0, "matched": 0, "ties": 0, "max_score_diff": 0.0})
        row["requests"] += 1
        row["matched"] += not c.problems
        row["ties"] += c.ties
        row["max_score_diff"] = max(row["max_score_diff"], c.max_diff)
    mismatches = [{"kind": c.kind, "body": c.body[:300].decode("utf-8", "replace") if c.content_type != "image/png"
                   and c.content_type != "image/jpeg" else f"<{c.content_type} {len(c.body)} bytes>",
                   "cause": c.cause, "problems": [p[:400] for p in c.problems[:5]]} for c in cases if c.problems]
    causes: dict[str, int] = {}
    for c in cases:
        if c.problems:
            causes[c.cause] = causes.get(c.cause, 0) + 1
    examples = {}
    for c in cases:
        if c.kind not in examples and c.served and c.served[0] == 200:
            examples[c.kind] = c.served[1][:3] if isinstance(c.served[1], list) else c.served[1]
    return {"requests": len(cases), "matched": sum(not c.problems for c in cases), "ties": sum(c.ties for c in cases),
            "max_score_diff": max((c.max_diff for c in cases), default=0.0),
            "distinct_first_answers": len({json.dumps(_first(c.want), sort_keys=True, default=str) for c in cases}),
            **agreement(cases), "causes": causes, "by_kind": kinds, "mismatches": mismatches, "examples": examples}


def _flat(answer) -> list:
    if isinstance(answer, dict):
        return [answer]
    if isinstance(answer, list) and answer and isinstance(answer[0], list):
        return [x for a in answer for x in _flat(a)]
    return answer if isinstance(answer, list) else []


def agreement(cases: list[Case]) -> dict:
    """Task figures beside exactness: entity-level F1 (exact type and span) for token-classification,
    first-answer agreement for ranked answers (a list input: its first text's)."""
    judged = [c for c in cases if c.served and c.served[0] == 200]
    items = [x for c in judged for x in _flat(c.want)]
    if items and ("entity" in items[0] or "entity_group" in items[0]):
        def spans(answer, key):
            texts = answer if isinstance(answer, list) and answer and isinstance(answer[0], list) else [answer]
            return {(key, t, x.get("entity_group", x.get("entity")), x["start"], x["end"])
                    for t, entities in enumerate(texts) for x in _flat(entities)}
        served = set().union(*(spans(c.served[1], k) for k, c in enumerate(judged)))
        wanted = set().union(*(spans(c.want, k) for k, c in enumerate(judged)))
        hit = len(served & wanted)
        f1 = 2 * hit / (len(served) + len(wanted)) if served or wanted else 1.0
        return {"entity_f1": round(f1, 4)}
    same = [json.dumps(_first(untie(c.served[1], c.want)[0]), sort_keys=True, default=str) ==
            json.dumps(_first(c.want), sort_keys=True, default=str) for c in judged]
    return {"first_answer_agreement": round(sum(same) / len(same), 4) if same else None}


def _first(answer):
    """The top item's identity (label / index / entity and span): how varied the answers are."""
    while isinstance(answer, list) and answer:
        answer = answer[0]
    if not isinstance(answer, dict):
        return None
    return {k: v for k, v in answer.items() if k in ("label", "index", "entity", "entity_group", "start", "end")}


def table(summary: dict) -> str:
    w = max([12, *map(len, summary["by_kind"])])
    lines = [f"| {'request kind':<{w}} | requests | matched | ties | max abs(score diff) |",
             f"|{'-' * (w + 2)}|---------:|--------:|-----:|--------------------:|"]
    for kind, r in summary["by_kind"].items():
        lines.append(f"| {kind:<{w}} | {r['requests']:>8} | {r['matched']:>7} | {r['ties']:>4} | "
                     f"{r['max_score_diff']:>19.2e} |")
    lines.append(f"| {'all':<{w}} | {summary['requests']:>8} | {summary['matched']:>7} | {summary['ties']:>4} | "
                 f"{summary['max_score_diff']:>19.2e} |")
    lines += [f"mismatches: {n} x {cause}" for cause, n in summary["causes"].items()]
    return "\n".join(lines)
