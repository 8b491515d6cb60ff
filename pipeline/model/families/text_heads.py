"""The text tasks with a classification head, from a Hugging Face folder: text-classification,
rerank (a cross-encoder: a sequence classifier with one logit, encoder or decoder backbone) and
token-classification.

The module returned takes input_ids, attention_mask and — only where the model's forward has them —
token_type_ids (BERT yes; RoBERTa/DistilBERT no), and returns the head's logits: [batch, labels]
for the sequence tasks, [batch, tokens, labels] for token-classification. Labels come from
config.json's `id2label`; the task mapping (variant.json "task") carries what the handler's adapter
needs (handlers/task_*.py): labels, problem_type, max_length, max_texts, the inputs' names.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from pipeline.core.params import Params
from pipeline.model.families.base import Family, hf_tokenizer, labels_of, register
from pipeline.model.loaded import InputSpec, LoadedModel
from pipeline.model.sentence_folder import tokenizer_settings
from pipeline.model.sources import load_module
from pipeline.model.weights import CheckpointError, KeyReport

SEQUENCE_TASKS = ("text-classification", "rerank")
TOKEN_TASKS = ("token-classification",)
TEXT_HEAD_TASKS = SEQUENCE_TASKS + TOKEN_TASKS


class LogitsModel(nn.Module):
    """A transformers model with a classification head as positional tensors -> logits."""

    def __init__(self, model: nn.Module, token_types: bool):
        super().__init__()
        self.model = model
        self.token_types = token_types
        # A decoder backbone (a Qwen3-style reranker) scores without a KV cache.
        self.no_cache = "use_cache" in inspect.signature(model.forward).parameters

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        kwargs = {"use_cache": False} if self.no_cache else {}
        if self.token_types:
            kwargs["token_type_ids"] = token_type_ids
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits


def takes_token_types(model: nn.Module) -> bool:
    """Whether the model's forward has token_type_ids AND its config gives them a table (type_vocab_size)."""
    if "token_type_ids" not in inspect.signature(model.forward).parameters:
        return False
    return int(getattr(model.config, "type_vocab_size", 0) or 0) > 0


@register
class TextHeads(Family):
    name = "text-heads"
    tasks = TEXT_HEAD_TASKS

    def hf_class(self, task: str) -> str:
        return "AutoModelForSequenceClassification" if task in SEQUENCE_TASKS else "AutoModelForTokenClassification"

    def load(self, params: Params, path: Path) -> tuple[LoadedModel, Optional[KeyReport]]:
        task = params.model.task
        tokenizer = hf_tokenizer(params, path, "config.json, weights and tokenizer.json")
        model, sources, report = load_module(params, path, self.hf_class(task))
        model = model.float().eval()
        config = model.config
        labels = labels_of(config, path)
        if task == "rerank" and len(labels) != 1:
            raise CheckpointError(f"{path}: a rerank model (cross-encoder) has ONE output logit; this one has "
                                  f"{len(labels)} labels ({', '.join(labels[:5])}); serve it as text-classification")
        token_types = takes_token_types(model)
        names = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_types else [])
        seq = {0: "batch", 1: "sequence"}
        max_length = min(params.model.text.max_length, int(getattr(config, "max_position_embeddings", 10 ** 9)))
        spec = {"kind": task, "max_length": max_length, "max_texts": params.model.text.max_texts,
                "tokenizer": "tokenizer.json", "labels": labels, "inputs": names,
                "problem_type": getattr(config, "problem_type", None), **tokenizer_settings(path)}
        loaded = LoadedModel(module=LogitsModel(model, token_types).eval(),
                             inputs=[InputSpec(n, "int64", dict(seq)) for n in names],
                             outputs=["logits"], task=spec, extra_files={"tokenizer.json": tokenizer},
                             source_files=sources + [tokenizer])
        return loaded, report
