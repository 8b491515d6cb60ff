"""Build a small decoder-backbone folder: `--task text-embedding` (default) a sentence-transformers
folder shaped like Qwen3-Embedding; `--task rerank` a Qwen3ForSequenceClassification cross-encoder
(one logit, scored at the last non-pad token: the form Qwen3-Reranker is converted to), the same
tokenizer. The embedder: a Qwen3 decoder backbone
(causal attention, RoPE, grouped-query attention: 4 query / 2 key-value heads), a byte-level BPE
tokenizer whose post-processor APPENDS <|endoftext|>, LEFT padding with pad = <|endoftext|> at the END
of the vocabulary, last-token pooling + Normalize, a query prompt (`prompts.query`), weights saved in
bf16 as Qwen3-Embedding publishes them. Random weights, a fixed seed; no network.
The tests and the worked example (examples/decoder-embedding/) use it.

    python scripts/make_decoder_embedder.py --out examples/decoder-embedding/model

`--layers/--hidden/--heads/--kv-heads/--head-dim/--vocab` give the real shape (Qwen3-Embedding-0.6B:
28 layers, hidden 1024, 16 / 8 heads of 128; its vocabulary is 151,669 tokens: --vocab sizes the
embedding table, the tokenizer stays small and its ids sit at the start of the table):

    python scripts/make_decoder_model.py --out /tmp/qwen3-0.6b --layers 28 --hidden 1024 --heads 16 \
        --kv-heads 8 --head-dim 128 --vocab 151669 --init-std 0.02
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from the repo root
from scripts.model_folders import write_sentence_transformers_modules  # noqa: E402

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
CORPUS = ("the a one every small large red quiet bright old new fast slow happy tired curious river city guitar "
          "music market morning evening window garden train engine forest ocean story teacher student doctor "
          "farmer child dog cat bird plays reads builds carries watches finds opens writes sings runs walks near "
          "under over behind across through during after before with without because while and but so "
          "yesterday today tomorrow slowly quickly carefully loudly softly again together alone what who where "
          "when how why is are was were instruct given web search query retrieve relevant passages that answer "
          "Ünïcödé naïve café 東京 😀").split()


def build_tokenizer(out: Path, vocab_size: int = 600, model_max_length: int = 32768):
    """Byte-level BPE trained on a small corpus, the special tokens appended at the vocabulary's end."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = [" ".join(CORPUS[i:i + 12]) for i in range(0, len(CORPUS), 3)]
    tok.train_from_iterator(text * 4, trainer=trainer)
    tok.add_special_tokens(list(SPECIALS))
    eos = tok.token_to_id(SPECIALS[0])
    tok.post_processor = processors.TemplateProcessing(single=f"$A {SPECIALS[0]}",
                                                       pair=f"$A {SPECIALS[0]} $B:1 {SPECIALS[0]}:1",
                                                       special_tokens=[(SPECIALS[0], eos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0],
                                   padding_side="left", model_max_length=model_max_length)
    fast.save_pretrained(str(out))
    return fast


def qwen3_config(fast, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int | None,
                 max_positions: int, head_dim: int | None = None, **extra):
    import transformers
    return transformers.Qwen3Config(
        vocab_size=max(vocab or 0, len(fast)), hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads, max_position_embeddings=max_positions, rope_theta=1000000.0,
        tie_word_embeddings=True, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        bos_token_id=None, use_cache=False, **extra)


def _spread(model, seed: int, std: float = 0.2):
    """Weights from `seed`, wider than the 0.02 init for the small shapes: distinct texts get clearly
    distinct answers (a deep, wide shape keeps 0.02, or its activations overflow half precision)."""
    import torch
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    return model.eval()


def build(out: Path, *, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
          vocab: int | None = None, max_seq_length: int = 8192, dtype: str = "bfloat16", head_dim: int | None = None,
          init_std: float = 0.2) -> Path:
    """The Qwen3-Embedding-shaped sentence-transformers folder."""
    import torch
    import transformers
    out.mkdir(parents=True, exist_ok=True)
    fast = build_tokenizer(out)
    config = qwen3_config(fast, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                          max_positions=max(max_seq_length, 512), head_dim=head_dim)
    model = _spread(transformers.Qwen3Model(config), seed, init_std)
    model.to(getattr(torch, dtype)).save_pretrained(str(out))
    write_sentence_transformers_modules(out, {
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True},
        max_seq_length)
    (out / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"}, indent=2))
    return out


def build_reranker(out: Path, *, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
                   kv_heads: int = 2, vocab: int | None = None, dtype: str = "bfloat16", head_dim: int | None = None,
                   init_std: float = 0.2) -> Path:
    """A Qwen3ForSequenceClassification cross-encoder: one logit `relevance`, left padding, pad = eos."""
    import torch
    import transformers
    out.mkdir(parents=True, exist_ok=True)
    fast = build_tokenizer(out, model_max_length=8192)
    config = qwen3_config(fast, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                          max_positions=8192, head_dim=head_dim, num_labels=1, id2label={0: "relevance"},
                          label2id={"relevance": 0})
    model = _spread(transformers.Qwen3ForSequenceClassification(config), seed, init_std)
    model.to(getattr(torch, dtype)).save_pretrained(str(out))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--task", default="text-embedding", choices=("text-embedding", "rerank"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=None, help="rows of the embedding table (default: the tokenizer's)")
    ap.add_argument("--head-dim", type=int, default=None, help="per attention head (default hidden / heads; "
                                                                   "Qwen3-Embedding-0.6B: 128)")
    ap.add_argument("--init-std", type=float, default=0.2, help="the weights' spread (0.02 for a deep, wide shape)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args(argv)
    shape = dict(seed=args.seed, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                 vocab=args.vocab, dtype=args.dtype, head_dim=args.head_dim, init_std=args.init_std)
    print(build(args.out, **shape) if args.task == "text-embedding" else build_reranker(args.out, **shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
