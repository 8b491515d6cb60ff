"""Files the make_*_model.py scripts write alike: a sentence-transformers folder's module files."""
from __future__ import annotations

import json
from pathlib import Path


def write_sentence_transformers_modules(out: Path, pooling: dict, max_seq_length: int) -> None:
    """modules.json (Transformer, Pooling, Normalize), 1_Pooling/config.json holding `pooling`,
    2_Normalize/ and sentence_bert_config.json, as sentence-transformers saves them."""
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}], indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                               "do_lower_case": False}, indent=2))
