"""Tiny models for the text tasks (MiniLM's real tokenizer, random weights) and a reference answer
from transformers' own pipelines; shared by the adapter tests and the served tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from scripts.make_text_task_model import build

# Words MiniLM's WordPiece splits into several pieces (first/average/max aggregation has work to do),
# capitals and punctuation (offsets must point into the original text), an accent, a long word.
NER_TEXTS = ["Johannesburg and Strumming unbelievably near Antananarivo, said Zbigniew.",
             "The tiny café on Rue Saint-Honoré opens tomorrow morning.",
             "a man is playing a guitar",
             "Hyperparameterisation of Kazakhstan's electrification programme."]
CLASSIFY_TEXTS = ["A man is playing a guitar.", "The stock market fell sharply today!",
                  "Someone is strumming a guitar near the river.", "Unbelievably quiet morning in Johannesburg."]
QUERY = "who is playing music"
DOCUMENTS = ["A man is playing a guitar.", "The stock market fell sharply today.", "Someone strums a guitar.",
             "Children play in the garden.", "An orchestra performs a symphony tonight.",
             "The train leaves the city at noon.", "Musicians rehearse in an old church.",
             "Quiet evening by the ocean.", "A student reads about music history.", "Dogs bark at the moon."]


def make_models(root: Path, seed: int = 0) -> dict[str, Path]:
    """task -> HF folder: BERT (token_type_ids) for classification and NER, DistilBERT (none) for rerank."""
    return {"text-classification": build(root / "cls", "text-classification", arch="bert", seed=seed),
            "rerank": build(root / "rerank", "rerank", arch="distilbert", seed=seed),
            "token-classification": build(root / "ner", "token-classification", arch="bert", seed=seed)}


def pipeline_of(task: str, folder: Path):
    import transformers
    transformers.utils.logging.set_verbosity_error()
    name = "text-classification" if task == "rerank" else task
    return transformers.pipeline(name, model=str(folder), tokenizer=str(folder), device="cpu")


def eager_rerank(folder: Path, query: str, texts: list[str]) -> list[dict]:
    """Sigmoid of the eager cross-encoder's logits, highest first (ties: request order)."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        batch = tok([query] * len(texts), texts, return_tensors="pt", padding=True, truncation="only_second")
        logits = model(**batch).logits[:, 0].numpy()
    scores = 1.0 / (1.0 + np.exp(-logits))
    return [{"index": int(i), "score": float(scores[i])} for i in np.argsort(-scores, kind="stable")]


def same_answers(got, want, atol: float = 0.01) -> list[str]:
    """Differences between two answers: every key exact except `score` (within atol)."""
    problems = []
    if isinstance(want, dict):
        want = [want]
    if len(got) != len(want):
        return [f"{len(got)} items served vs {len(want)} expected: {got} vs {want}"]
    for k, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, list):
            problems += same_answers(g, w, atol)
            continue
        w = {key: (float(v) if key == "score" else v) for key, v in w.items()}
        if set(g) != set(w):
            problems.append(f"item {k}: keys {sorted(g)} vs {sorted(w)}")
        for key in w:
            if key == "score":
                if abs(g.get(key, np.inf) - w[key]) > atol:
                    problems.append(f"item {k}: score {g.get(key)} vs {w[key]}")
            elif g.get(key) != w[key]:
                problems.append(f"item {k}: {key} {g.get(key)!r} vs {w[key]!r}")
    return problems


def max_score_diff(got, want) -> float:
    if isinstance(want, dict):
        want = [want]
    diffs = [0.0]
    for g, w in zip(got, want):
        if isinstance(w, list):
            diffs.append(max_score_diff(g, w))
        else:
            diffs.append(abs(float(g["score"]) - float(w["score"])))
    return max(diffs)
