"""Responses serialised once, in the handler, to JSON bytes.

TorchServe's worker passes bytes through as they are and otherwise runs `json.dumps` on every
response: for an embedding that means one Python float per element and their text, the largest
per-request cost after the model itself. orjson writes numpy arrays directly (float32 values in
their shortest float32 form); without it, the standard library does, after turning arrays into
lists.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

try:
    import orjson
except ImportError:            # the serving image may lack it: still correct, only slower
    orjson = None

_ORJSON_OPTIONS = (orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS) if orjson is not None else 0


def _plain(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def json_bytes(obj: Any) -> bytes:
    if orjson is not None:
        try:
            return orjson.dumps(obj, option=_ORJSON_OPTIONS)
        except TypeError:       # e.g. a non-contiguous array or an unusual dtype: the slow path handles it
            pass
    return json.dumps(obj, default=_plain).encode("utf-8")
