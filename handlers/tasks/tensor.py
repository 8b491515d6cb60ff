"""tensor: a raw array in, the model's outputs out (JSON nested lists or .npy)."""
from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from handlers.encode import json_bytes
from handlers.tasks import JSON_TYPES, RequestError, TaskAdapter, _parse_json


class TensorAdapter(TaskAdapter):
    kind = "tensor"

    def __init__(self, model_dir, task):
        super().__init__(model_dir, task)
        self.input_shape = tuple(int(d) for d in self.task["input_shape"])

    def usage(self) -> str:
        dims = "×".join(map(str, self.input_shape))
        return (f"send JSON (Content-Type application/json): a nested list of numbers of shape {dims}, "
                f'or {{"input": <that list>}}; or a .npy float32 array (application/x-npy)')

    def _decode(self, body, media):
        if media in ("application/x-npy", "application/npy"):
            try:
                arr = np.load(io.BytesIO(bytes(body)), allow_pickle=False)
            except Exception as e:
                raise RequestError(400, f"request body is not a .npy array ({type(e).__name__}); {self.usage()}") from None
        elif media in JSON_TYPES or isinstance(body, (dict, list)) or (media == "" and isinstance(body, str)):
            doc = _parse_json(body)
            if isinstance(doc, dict):
                if "input" not in doc and "inputs" not in doc:
                    raise RequestError(400, f"JSON object has no `input` key; {self.usage()}")
                doc = doc.get("input", doc.get("inputs"))
            arr = self._array_of(doc)
        else:
            raise RequestError(415, f"Content-Type {media!r} is not supported for tensors; {self.usage()}")
        if arr.dtype.kind not in "fiu" or arr.dtype == np.bool_:
            raise RequestError(400, f"input has dtype {arr.dtype}; numbers are needed. {self.usage()}")
        if tuple(arr.shape) != self.input_shape:
            raise RequestError(400, f"input has shape {list(arr.shape)}, expected {list(self.input_shape)} "
                                    f"(one sample, no batch dimension); {self.usage()}")
        arr = arr.astype(np.float32)
        if not np.isfinite(arr).all():
            raise RequestError(400, "input contains NaN or infinity; send finite numbers")
        return {"input": arr}

    def _array_of(self, doc: Any) -> np.ndarray:
        try:
            arr = np.asarray(doc)
        except ValueError:    # ragged nesting
            raise RequestError(400, f"input is a ragged nested list; {self.usage()}") from None
        if arr.dtype == object:
            raise RequestError(400, f"input is ragged or holds non-numbers; {self.usage()}")
        return arr

    def respond(self, outputs, i):
        if len(outputs) == 1:
            return np.asarray(outputs[0][i], dtype=np.float32).tolist()
        return {"outputs": [np.asarray(o[i], dtype=np.float32).tolist() for o in outputs]}

    def respond_bytes(self, outputs, i, sample=None):
        rows = [np.ascontiguousarray(o[i], dtype=np.float32) for o in outputs]
        return json_bytes(rows[0] if len(rows) == 1 else {"outputs": rows})

    def example_feeds(self, batch_size, seq_len=None):
        rng = np.random.default_rng(2024 + batch_size)
        return {"input": rng.standard_normal((batch_size, *self.input_shape), dtype=np.float32)}

    def example_requests(self, n, seed=0):
        rng = np.random.default_rng(seed)
        requests = []
        for _ in range(n):
            # 6 digits keep bodies short; decode turns them into the same float32 every time.
            sample = np.round(rng.standard_normal(self.input_shape), 6)
            requests.append((json.dumps(sample.tolist()).encode("utf-8"), "application/json"))
        return requests
