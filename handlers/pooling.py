"""Sentence-transformers' pooling modes over a batch of token states, one function per mode.

Every mode reads the masks only, never a Python int taken from a shape, so tracing and export keep
batch and sequence dynamic, and either padding side gives each row the answer it gets alone
(`lasttoken` finds each row's last real token; a left-padded decoder batch ends every row on it;
`weightedmean` counts positions from each row's first real token). The formulas are
sentence_transformers.models.Pooling's, mode by mode. The pooling mask is the attention mask, or, for
a folder pooled with include_prompt false, the attention mask with the prompt's tokens zeroed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _mask(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return attention_mask.unsqueeze(-1).to(hidden.dtype)


def _gather(hidden, index):
    return hidden.gather(1, index.view(-1, 1, 1).expand(-1, 1, hidden.size(-1))).squeeze(1)


def cls_token(hidden, attention_mask):
    # Each row's first real token: position 0 under right padding, past the pads under left.
    # argmax over int32: ONNX Runtime's ArgMax takes no int64 (onnxruntime issue 10068).
    return _gather(hidden, attention_mask.to(torch.int32).argmax(dim=1))


def mean_tokens(hidden, attention_mask):
    mask = _mask(hidden, attention_mask)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


def mean_sqrt_len_tokens(hidden, attention_mask):
    mask = _mask(hidden, attention_mask)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9).sqrt()


def max_tokens(hidden, attention_mask):
    mask = _mask(hidden, attention_mask)
    return hidden.masked_fill(mask == 0, float("-inf")).amax(dim=1)


def weighted_mean_tokens(hidden, pooling_mask, attention_mask=None):
    # Weights 1..sequence by position, as sentence-transformers counts them in a row alone: from the
    # row's first real token, so left pads (a decoder's batch) never shift a row's weights.
    attention_mask = pooling_mask if attention_mask is None else attention_mask
    first = attention_mask.to(torch.int32).argmax(dim=1, keepdim=True)
    positions = torch.ones_like(attention_mask).cumsum(dim=1) - first
    weights = (pooling_mask * positions).unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def last_token(hidden, attention_mask):
    # The first position where the running count of real tokens reaches its total: each row's last
    # real token, whichever side the padding is on.
    seen = attention_mask.cumsum(dim=1)
    return _gather(hidden, (seen == seen.amax(dim=1, keepdim=True)).to(torch.int32).argmax(dim=1))


# modules.json's 1_Pooling/config.json key -> (mode name, function)
MODES = {"pooling_mode_cls_token": ("cls", cls_token),
         "pooling_mode_mean_tokens": ("mean", mean_tokens),
         "pooling_mode_max_tokens": ("max", max_tokens),
         "pooling_mode_mean_sqrt_len_tokens": ("mean_sqrt_len", mean_sqrt_len_tokens),
         "pooling_mode_weightedmean_tokens": ("weightedmean", weighted_mean_tokens),
         "pooling_mode_lasttoken": ("lasttoken", last_token)}
POOLINGS = {name: fn for name, fn in MODES.values()}


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str, normalize: bool,
         pooling_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The pooled vector per row in fp32 (a half-precision mean and its norm drift by ~1e-3, and
    clients take these vectors as unit vectors), L2-normalised when the folder ends with Normalize.
    `pooling_mask`: the tokens pooled, when not all attended ones are (include_prompt false)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r} is not supported; supported: {', '.join(POOLINGS)}")
    mask = attention_mask if pooling_mask is None else pooling_mask
    if pooling == "weightedmean":
        pooled = weighted_mean_tokens(hidden.float(), mask, attention_mask)
    else:
        pooled = POOLINGS[pooling](hidden.float(), mask)
    return F.normalize(pooled, p=2.0, dim=1) if normalize else pooled
