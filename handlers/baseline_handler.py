"""The naive baseline: the hand-written TorchServe setup most deployments start from.

A BaseHandler subclass that, in initialize, builds the eager fp32 model the common way —
`transformers.AutoModel.from_pretrained` on the packed Hugging Face folder (+ the pooling the
model's modules.json defines; the task's `AutoModelFor...` class, baseline.json's `hf_class`, for a
model with a head), or the packed factory + `torch.load` of the state_dict, or
`torch.jit.load` — with no warm-up, TorchServe's default threads and no model-config.yaml. It exists
only so serve_check can measure what the optimised archive gains; it is not meant to be fast.

Requests are decoded and answered by the same task adapter as the optimised handler
(handlers/tasks/__init__.py), so responses have the identical format and parity can be compared. A request
may make many model rows (a rerank query with its texts, `{"inputs": [...]}` to embed, classify or
tag): naive in speed, not in answers — all rows of a batch go into one model call, uncapped, and
each request is answered whole from its own rows.
Everything it reads is named in `baseline.json`, packed next to it by the archive stage.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import os
import sys
import time

import numpy as np
import torch
from ts.torch_handler.base_handler import BaseHandler

from handlers.pooling import pool
from handlers.tasks import RequestError, make_adapter

log = logging.getLogger(__name__)

BASELINE_FILE = "baseline.json"


class BaselineHandler(BaseHandler):
    def initialize(self, context):
        t0 = time.perf_counter()
        self.context, self.manifest = context, context.manifest
        model_dir = context.system_properties["model_dir"]
        with open(os.path.join(model_dir, BASELINE_FILE), encoding="utf-8") as f:
            self.spec = json.load(f)
        gpu_id = context.system_properties.get("gpu_id")
        self.device = torch.device(f"cuda:{gpu_id}" if gpu_id is not None and torch.cuda.is_available() else "cpu")
        source = self.spec["source"]
        task = self.spec["task"]
        if source == "hf":
            import transformers
            auto = getattr(transformers, self.spec.get("hf_class") or "AutoModel")
            self.model = auto.from_pretrained(model_dir, local_files_only=True, torch_dtype=torch.float32)
        elif source == "state_dict":
            self.model = self._factory()(**(self.spec["factory"].get("kwargs") or {}))
            weights = os.path.join(model_dir, self.spec["weights"])
            if weights.endswith(".safetensors"):
                from safetensors.torch import load_file
                state = load_file(weights, device="cpu")
            else:
                state = torch.load(weights, map_location="cpu")
            self.model.load_state_dict(state)
        elif source == "torchscript":
            self.model = torch.jit.load(os.path.join(model_dir, self.spec["weights"]), map_location="cpu")
        else:
            raise ValueError(f"{BASELINE_FILE}: unknown source {source!r}")
        self.model = self.model.to(self.device).eval()
        self.adapter = make_adapter(model_dir, task)
        self.output_names = list(self.spec.get("outputs") or [])
        self.initialized = True
        log.info("[load] baseline source=%s task=%s device=%s total=%.1fms", source, task.get("kind"),
                 self.device, (time.perf_counter() - t0) * 1000.0)

    def _factory(self):
        factory = self.spec["factory"]
        if factory.get("file"):
            path = os.path.join(self.spec_dir, factory["file"])
            name = "_baseline_factory_" + os.path.splitext(os.path.basename(path))[0]
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(factory["module"])
        return getattr(module, factory["function"])

    @property
    def spec_dir(self) -> str:
        return self.context.system_properties["model_dir"] if self.context else "."

    # BaseHandler.handle calls preprocess -> inference -> postprocess.
    # One request may make many model rows (a rerank query and its texts, a list of texts to embed,
    # classify or tag): every row of the batch goes into ONE model call — naive, no cap on the rows
    # per call — and each request is answered from its own rows, in the task's format.
    def preprocess(self, data):
        self._errors = {}
        rows, self._requests = [], []          # (request index, Decoded, first row, row count)
        for idx, request in enumerate(data):
            body = request.get("body") if request.get("body") is not None else request.get("data")
            try:
                ctype = None
                try:
                    headers = self.context.get_all_request_header(idx) or {}
                    param = headers.get("body") or headers.get("data") or {}
                    ctype = param.get("content-type") if isinstance(param, dict) else None
                except Exception:
                    pass
                decoded = self.adapter.decode_request(body, ctype)
                self._requests.append((idx, decoded, len(rows), len(decoded.rows)))
                rows += decoded.rows
            except RequestError as e:
                self._errors[idx] = e
        self._count = len(data)
        return self.adapter.collate(rows) if rows else None

    def inference(self, feeds, *args, **kwargs):
        if feeds is None:
            return None
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device) for k, v in feeds.items()}
        with torch.no_grad():
            if self.spec["task"]["kind"] == "text-embedding":
                # As sentence-transformers calls it: token types where the model takes them.
                extra = ({"token_type_ids": torch.zeros_like(tensors["input_ids"])}
                         if "token_type_ids" in inspect.signature(self.model.forward).parameters else {})
                hidden = self.model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                                    **extra).last_hidden_state
                task = self.spec["task"]
                out = pool(hidden, tensors["attention_mask"], task.get("pooling", "mean"),
                            bool(task.get("normalize", True)))
            elif self.spec["source"] == "hf" and self.spec["task"]["kind"] == "image-classification":
                out = self.model(pixel_values=tensors["pixels"])   # the adapter's `pixels`, by transformers' name
            elif self.spec["source"] == "hf":
                out = self.model(**tensors)      # by name: input_ids, attention_mask, token_type_ids where taken
            else:
                out = self.model(*tensors.values())
        return self._as_list(out)

    def _as_list(self, out):
        if hasattr(out, "logits") and not isinstance(out, torch.Tensor):
            out = out.logits
        if isinstance(out, torch.Tensor):
            outs = [out]
        elif isinstance(out, dict):
            outs = [out[k] for k in self.output_names] if self.output_names else list(out.values())
        else:
            outs = list(out)
        return [o.detach().float().cpu().numpy() for o in outs]

    def postprocess(self, outputs):
        responses = [None] * self._count
        for idx, decoded, first, count in self._requests:
            # this request's rows, each row's outputs without the batch dimension
            row_outputs = [[o[r] for o in outputs] for r in range(first, first + count)]
            try:
                responses[idx] = self.adapter.respond_request(row_outputs, decoded.meta)
            except RequestError as e:
                self._errors[idx] = e
        for idx, err in self._errors.items():
            self.context.set_response_status(err.status, "Bad Request" if err.status == 400 else "Error", idx)
            responses[idx] = err.as_response()
        return responses
