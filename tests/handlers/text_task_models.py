"""Tiny models for the text tasks (MiniLM's real tokenizer, random weights) and a reference answer
from transformers' own pipelines; shared by the adapter tests and the served tests. The references
and the comparison are the served-vs-transformers check's (scripts/served_compare/, the check run on
models the tests never build)."""
from __future__ import annotations

from pathlib import Path

from scripts.make_text_task_model import build
from scripts.served_compare.judging import max_score_diff, same_answers  # noqa: F401
from scripts.served_compare.references import eager_rerank, pipeline_of  # noqa: F401

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
