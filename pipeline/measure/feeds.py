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
