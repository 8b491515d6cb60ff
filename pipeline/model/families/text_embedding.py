"""text-embedding: an HF encoder (BERT, XLM-R, ModernBERT, ...) or decoder backbone (Qwen3-Embedding)
folder, pooled as its sentence-transformers modules say (pipeline/model/sentence_folder.py: one of
handlers/pooling.py's modes, last-token for a decoder; Normalize), or mean + L2 for a bare encoder folder.

The module takes input_ids and attention_mask (and pooling_mask, for a folder pooled with
include_prompt false) and returns the pooled embedding [batch, dim], as sentence-transformers
computes it (handlers/pooling.py).
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from handlers.pooling import POOLINGS, pool
from pipeline.core.params import Params
from pipeline.model.families.base import Family, hf_tokenizer, register
from pipeline.model.loaded import InputSpec, LoadedModel
from pipeline.model.sentence_folder import read_sentence_folder, tokenizer_settings
from pipeline.model.sources import load_module
from pipeline.model.weights import CheckpointError, KeyReport


class TextEmbeddingModel(nn.Module):
    """HF encoder (or decoder backbone) + the folder's pooling over attention_mask (+ L2
    normalisation), as sentence-transformers computes them (handlers/pooling.py)."""

    def __init__(self, encoder: nn.Module, pooling: str = "mean", normalize: bool = True):
        super().__init__()
        if pooling not in POOLINGS:
            raise CheckpointError(f"text-embedding pooling {pooling!r} is not supported ({', '.join(POOLINGS)})")
        self.encoder = encoder
        self.pooling = pooling
        self.normalize = normalize
        # Decided once here, not per call: e.g. DistilBERT takes no token_type_ids; a decoder
        # backbone takes use_cache, which an embedding never needs (no KV cache in the graph).
        accepted = inspect.signature(encoder.forward).parameters
        self.pass_token_types = "token_type_ids" in accepted
        self.no_cache = "use_cache" in accepted

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kwargs = {"use_cache": False} if self.no_cache else {}
        # token_type_ids explicit: the encoder's own default slices a buffer by a shape-derived int.
        if self.pass_token_types:
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return pool(self.hidden(input_ids, attention_mask), attention_mask, self.pooling, self.normalize)


class PromptExcludedEmbeddingModel(TextEmbeddingModel):
    """A folder pooled with include_prompt false (INSTRUCTOR-style): every token is attended to, the
    prompt's are left out of the pooling. `pooling_mask` is the attention mask with the prompt's
    positions zeroed (the serving adapter makes it, as sentence-transformers' Pooling does)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                pooling_mask: torch.Tensor) -> torch.Tensor:
        return pool(self.hidden(input_ids, attention_mask), attention_mask, self.pooling, self.normalize,
                    pooling_mask=pooling_mask)


@register
class TextEmbedding(Family):
    name = "text-embedding"
    tasks = ("text-embedding",)

    def load(self, params: Params, path: Path) -> tuple[LoadedModel, Optional[KeyReport]]:
        tokenizer = hf_tokenizer(params, path, "tokenizer.json")
        folder = read_sentence_folder(path)          # before the weights: a refused folder costs no load
        encoder, sources, report = load_module(params, path, self.hf_class(params.model.task))
        model_class = TextEmbeddingModel if folder.include_prompt else PromptExcludedEmbeddingModel
        module = model_class(encoder.float().eval(), folder.pooling, folder.normalize).eval()
        config = getattr(encoder, "config", None)
        hidden = getattr(config, "hidden_size", None)
        limits = {"model.text.max_length": params.model.text.max_length,
                  "the folder's max_seq_length": folder.max_seq_length,
                  "config.json max_position_embeddings": getattr(config, "max_position_embeddings", None)}
        limit_from, max_length = min(((k, int(v)) for k, v in limits.items() if v), key=lambda kv: kv[1])
        task = {"kind": "text-embedding", "max_length": max_length, "max_length_from": limit_from,
                "dim": hidden, "tokenizer": "tokenizer.json", "max_texts": params.model.text.max_texts,
                **folder.as_task(), **tokenizer_settings(path)}
        seq = {0: "batch", 1: "sequence"}
        names = ["input_ids", "attention_mask"] + ([] if folder.include_prompt else ["pooling_mask"])
        loaded = LoadedModel(module=module, inputs=[InputSpec(name, "int64", dict(seq)) for name in names],
                             outputs=["embedding"], task=task, extra_files={"tokenizer.json": tokenizer},
                             source_files=sources + [tokenizer])
        return loaded, report
