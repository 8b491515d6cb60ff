"""Example inputs for a variant folder, built by the same task adapter that serving uses."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def read_variant(model_dir) -> dict:
    path = Path(model_dir) / "variant.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: the variant folder is incomplete; re-run its convert stage") from None


def make_feeds_factory(model_dir, seq_len: Optional[int] = None):
    """→ fn(batch_size) -> feeds, from handlers.tasks' adapter for this variant's task.
    `seq_len`: tokens per sample for text tasks (other tasks ignore it)."""
    from handlers.tasks import make_adapter
    adapter = make_adapter(str(model_dir), read_variant(model_dir).get("task", {}))

    def feeds_for(batch_size: int):
        return adapter.example_feeds(batch_size, seq_len=seq_len)
    return feeds_for


def example_feeds(model_dir, batch_size: int, seq_len: Optional[int] = None):
    """Feeds spec for the harness: `pipeline.measure.feeds:example_feeds` (model_dir, batch, seq_len)."""
    return make_feeds_factory(model_dir, seq_len)(batch_size)


def describe_feeds(model_dir, batch_sizes, seq_len: Optional[int] = None) -> Optional[dict]:
    """What a text variant was measured on: tokens per row (padded) at each batch size; None for
    tasks without input_ids. Rerank rows are (query, passage) pairs of the adapter's example
    requests, padded to the batch's longest as served (handlers/tasks/rerank.py)."""
    make = make_feeds_factory(model_dir, seq_len)
    padded = {}
    for b in batch_sizes:
        ids = make(int(b)).get("input_ids")
        if ids is None:
            return None
        padded[str(b)] = int(ids.shape[1])
    return {"unit": "rows (one model row per sample)", "seq_len": seq_len,
            "rows": "synthetic token ids" if seq_len else "the task adapter's example rows",
            "padded_tokens_per_row": padded}
