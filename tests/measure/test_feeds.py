"""What the benchmark feeds a variant (pipeline/measure/feeds.py): the task adapter's example inputs,
and for the text tasks the record of their shape (a rerank row is a query-passage pair)."""
from __future__ import annotations

import json
import shutil

from pipeline.measure.feeds import describe_feeds, example_feeds


def test_rerank_feeds_are_pairs_shaped_like_the_served_rows(tmp_path):
    from scripts.make_text_task_model import minilm_folder
    shutil.copyfile(minilm_folder() / "tokenizer.json", tmp_path / "tokenizer.json")
    task = {"kind": "rerank", "max_length": 128, "max_texts": 64, "tokenizer": "tokenizer.json",
            "inputs": ["input_ids", "attention_mask", "token_type_ids"]}
    (tmp_path / "variant.json").write_text(json.dumps({"variant": "eager", "task": task}))
    feeds = example_feeds(tmp_path, 16)
    assert feeds["input_ids"].shape[0] == 16 and set(feeds) == set(task["inputs"])
    assert feeds["token_type_ids"].max() == 1                     # the passage is the second segment
    d = describe_feeds(tmp_path, [1, 16])
    assert d["rows"] == "the task adapter's example rows" and d["seq_len"] is None
    assert d["padded_tokens_per_row"]["16"] == feeds["input_ids"].shape[1] > 40   # 30-80-word passages
    synthetic = describe_feeds(tmp_path, [4], seq_len=24)
    assert synthetic["padded_tokens_per_row"] == {"4": 24} and synthetic["rows"] == "synthetic token ids"
