"""The TorchServe handler logic shared by every runtime family (torch_handler.py, onnx_handler.py).

initialize (once per worker):
- every file is resolved inside `context.system_properties["model_dir"]` (the unpacked .mar);
  variant.json names them, nothing points outside;
- the serving knobs come from the packed model-config.yaml `handler:` section
  (`threads`, `device`, `warmup_batch_size`, `max_request_bytes`);
- the runtime is loaded by `handlers.runtimes.load_runtime` (the same code the pipeline verified and
  benchmarked) while the task adapter is built once (tokenizer, labels) in a second thread, and one
  warm-up call at the configured batch size runs so the first real request is not slow;
- a load-time breakdown is logged (`[load] ...` line) and kept in `self.load_breakdown_ms`.

handle (per batch): each request is decoded on its own into one or more model rows (the adapter's
`decode_request`: a rerank query with 20 texts is 20 rows); a bad one gets its own 4xx JSON error via
`context.set_response_status(code, phrase, idx)`. The valid requests' rows are fanned out over model
calls of at most `batch_rows` rows (handler setting; default TorchServe's batch size: batching
counts rows, not requests) and gathered back per request. Exactly one response per request, in
order, as JSON bytes built here (handlers/encode.py), so TorchServe does not re-encode them.
Half-precision variants still take and return float32 JSON: the runtime casts. Where a request's
time goes (decode, collate, model, respond) is summed per phase and logged now and then
(handlers/profile.py).

This module never imports torch: the ONNX handler must not pay for it.
"""
from __future__ import annotations

import http
import json
import logging
import os
import threading
import time
import weakref
from abc import ABC, abstractmethod
from typing import Any

from handlers.encode import json_bytes
from handlers.profile import RequestProfile
from handlers.runtimes import RuntimeLoadError, load_runtime
from handlers.runtimes import read_variant as runtime_read_variant
from handlers.tasks import JSON_TYPES, RequestError, _media_type, make_adapter

log = logging.getLogger(__name__)

VARIANT_FILE = "variant.json"
HANDLER_SETTINGS = ("threads", "device", "warmup_batch_size", "max_request_bytes", "batch_rows")


class HandlerSetupError(RuntimeError):
    """The packed model cannot be served as configured; the message says what to fix."""


# --------------------------------------------------------------------------- initialize helpers
def inside(model_dir: str, name: str) -> str:
    """`name` (from variant.json) as a path inside model_dir; refuse absolute or escaping paths."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise HandlerSetupError(f"{VARIANT_FILE} names file {name!r}: files must be relative to the model folder")
    root = os.path.realpath(model_dir)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, path]) != root:
        raise HandlerSetupError(f"{VARIANT_FILE} names file {name!r}, which lies outside the model folder {root}")
    return path


def read_variant(model_dir: str) -> dict:
    """variant.json of the packed variant (parsed by the runtime's reader), with every file it lists
    checked to lie inside the model folder and be present."""
    try:
        variant = runtime_read_variant(model_dir)
    except RuntimeLoadError as e:
        raise HandlerSetupError(f"{e} (the .mar must be built by the archive stage, which packs the "
                                f"variant folder)") from None
    if "task" not in variant:
        raise HandlerSetupError(f"{model_dir}/{VARIANT_FILE}: key 'task' is missing; rebuild the variant")
    names = list(variant.get("files") or []) + [variant["artifact"]]
    missing = [n for n in names if not os.path.exists(inside(model_dir, n))]
    if missing:
        raise HandlerSetupError(f"files listed in {VARIANT_FILE} are missing from {model_dir}: "
                                f"{', '.join(sorted(set(missing)))}; rebuild the archive with them")
    return variant


def handler_settings(model_yaml_config: Any) -> dict:
    """The `handler:` section of model-config.yaml, validated; absent keys become None."""
    section = (model_yaml_config or {}).get("handler") if isinstance(model_yaml_config, dict) else None
    section = section or {}
    if not isinstance(section, dict):
        raise HandlerSetupError(f"model-config.yaml `handler:` must be a mapping, got {section!r}")
    unknown = sorted(set(section) - set(HANDLER_SETTINGS))
    if unknown:
        log.warning("model-config.yaml handler: ignoring unknown keys %s (known: %s)",
                    unknown, ", ".join(HANDLER_SETTINGS))
    settings = {k: section.get(k) for k in HANDLER_SETTINGS}
    for key in ("threads", "warmup_batch_size", "max_request_bytes", "batch_rows"):
        value = settings[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise HandlerSetupError(f"model-config.yaml handler.{key} = {value!r}: needs a native YAML "
                                    f"integer >= 0 (unquoted)")
    if settings["threads"] == 0:
        settings["threads"] = None          # 0 = let the runtime decide
    if settings["device"] is not None and settings["device"] not in ("cpu", "cuda", "auto"):
        raise HandlerSetupError(f"model-config.yaml handler.device = {settings['device']!r}: "
                                f"allowed cpu, cuda, auto")
    return settings


def resolve_device(configured: str | None, variant_device: str | None, gpu_id: Any) -> tuple[str, int | None]:
    """('cpu', None) or ('cuda', gpu_id): the config says which kind, TorchServe says which GPU."""
    want = configured or (variant_device.split(":")[0] if variant_device else None) or "auto"
    if want == "auto":
        want = "cuda" if gpu_id is not None else "cpu"
    if want == "cpu":
        return "cpu", None
    if gpu_id is None:
        raise HandlerSetupError(
            "this archive is configured for a GPU (handler.device / variant device 'cuda') but TorchServe "
            "assigned no GPU to the worker (gpu_id is None): serve it on a GPU host with deviceType: gpu, "
            "or rebuild the pipeline with benchmark.device: cpu")
    return "cuda", int(gpu_id)


# --------------------------------------------------------------------------- handle helpers
def request_body(request: Any) -> Any:
    """The payload of one TorchServe request dict: `body`, `data`, or a single multipart field."""
    if not isinstance(request, dict):
        return request
    for key in ("body", "data"):
        if request.get(key) is not None:
            return request[key]
    values = [v for v in request.values() if v is not None]
    return values[0] if len(values) == 1 else None


def undo_json_decoding(body: Any, content_type: str | None) -> Any:
    """TorchServe's worker json.loads an `application/json` body before the handler sees it
    (ts/protocol/otf_message_handler.py). An object or a list the adapters take as decoded; a bare JSON
    string (or number) would be read as JSON text a second time: `"a text"` failed as invalid JSON,
    `"{\\"inputs\\": 1}"` became an object. Such a scalar goes back to its JSON text, read once."""
    if isinstance(body, (str, int, float, bool)) and _media_type(content_type) in JSON_TYPES:
        return json.dumps(body, ensure_ascii=False).encode("utf-8")
    return body


def request_content_type(context: Any, idx: int) -> str | None:
    """Content type of request `idx`: TorchServe keeps it per parameter and per request."""
    try:
        headers = context.get_all_request_header(idx) or {}
    except Exception:  # no request processor (not under TorchServe)
        return None
    for key in ("body", "data"):
        param = headers.get(key)
        if isinstance(param, dict) and param.get("content-type"):
            return param["content-type"]
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == "content-type" and isinstance(value, str):
            return value
    return None


def error_body(status: int, message: str) -> dict:
    return {"error": message, "status": status}


def phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _set_status(context: Any, idx: int, status: int) -> None:
    try:
        context.set_response_status(status, phrase(status), idx)
    except Exception:  # tolerate contexts without a request processor
        log.debug("could not set status %s for request %d", status, idx)


def _set_json(context: Any, idx: int) -> None:
    try:
        context.set_response_content_type(idx, "application/json")
    except Exception:
        pass


# --------------------------------------------------------------------------- the handler
class ServingHandler(ABC):
    """Base of the per-family TorchServe handlers. Subclasses set `family` ("torch" | "onnx")."""

    family: str = ""

    def __init__(self) -> None:
        self.initialized = False
        self.runtime = None
        self.adapter = None
        self.variant: dict = {}
        self.settings: dict = {}
        self.device = "cpu"
        self.load_breakdown_ms: dict = {}
        self.batch_rows = 1
        self._finalizer = None
        self.profile = RequestProfile()

    # ------------------------------------------------------------------ initialize
    def initialize(self, context: Any) -> None:
        t0 = time.perf_counter()
        props = context.system_properties
        model_dir = props.get("model_dir")
        if not model_dir or not os.path.isdir(model_dir):
            raise HandlerSetupError(f"system_properties['model_dir'] = {model_dir!r} is not a folder")
        self.variant = read_variant(model_dir)
        if self.family and self.variant["family"] != self.family:
            raise HandlerSetupError(
                f"{type(self).__name__} serves {self.family!r} variants but {VARIANT_FILE} says family "
                f"{self.variant['family']!r}: the archive packed the wrong handler; rebuild it with the archive stage")
        self.settings = handler_settings(getattr(context, "model_yaml_config", None))
        kind, gpu_id = resolve_device(self.settings["device"], self.variant.get("device"), props.get("gpu_id"))
        if gpu_id is not None:
            self.select_gpu(gpu_id)
        self.device = kind if gpu_id is None else f"cuda:{gpu_id}"

        task = dict(self.variant["task"])
        if self.settings["max_request_bytes"]:
            task["max_request_bytes"] = self.settings["max_request_bytes"]
        # The adapter (a 250k-piece tokenizer takes ~0.3 s to parse) is built while the runtime loads:
        # both release the GIL in their native code, so the worker waits for the longer one only.
        adapter_box: dict = {}
        adapter_thread = threading.Thread(target=_build_adapter, args=(model_dir, task, adapter_box),
                                          name="adapter-load", daemon=True)
        adapter_thread.start()
        self.runtime = load_runtime(model_dir, device=kind, threads=self.settings["threads"])
        # Release the session/model when the worker exits (or the handler is dropped).
        self._finalizer = weakref.finalize(self, _close_quietly, self.runtime)
        t_runtime = time.perf_counter()
        adapter_thread.join()
        if "error" in adapter_box:
            raise adapter_box["error"]
        self.adapter = adapter_box["adapter"]
        t_adapter = time.perf_counter()           # the wait for the adapter after the runtime

        self.batch_rows = int(self.settings.get("batch_rows") or props.get("batch_size") or 1)
        warmup_bs = self.settings["warmup_batch_size"]
        if warmup_bs is None:
            warmup_bs = int(props.get("batch_size") or 1)
        if warmup_bs > 0:
            feeds = self.adapter.example_feeds(warmup_bs)
            for _ in range(getattr(self.runtime, "warmup_calls", 1)):
                self.runtime.run(feeds)
        t_warm = time.perf_counter()

        phases = {f"{k}": round(v * 1000.0, 2) for k, v in (getattr(self.runtime, "load_phases", None) or {}).items()}
        phases.update({
            "runtime_total": round((t_runtime - t0) * 1000.0, 2),
            "adapter": round((t_adapter - t_runtime) * 1000.0, 2),
            f"warmup_bs{warmup_bs}": round((t_warm - t_adapter) * 1000.0, 2),
            "total": round((t_warm - t0) * 1000.0, 2),
        })
        self.load_breakdown_ms = phases
        # Weights pre-packed at build time are used only on a host that packs alike (runtimes/onnx_family.py).
        packed = ("" if not self.variant.get("prepacked") else
                  " prepacked=" + ("yes" if getattr(self.runtime, "prepacked", False) else "no"))
        log.info("[load] variant=%s family=%s format=%s dtype=%s device=%s threads=%s%s: %s",
                 self.variant.get("variant"), self.variant["family"], self.variant.get("format"),
                 self.variant.get("dtype"), self.device, self.settings["threads"] or "runtime default", packed,
                 " ".join(f"{k}={v}ms" for k, v in phases.items()))
        if getattr(self.runtime, "prepack_note", None):
            log.warning("[load] %s", self.runtime.prepack_note)
        self.initialized = True

    @abstractmethod
    def select_gpu(self, gpu_id: int) -> None:
        """Make `gpu_id` the device that 'cuda' means for this worker's runtime (per family)."""

    # ------------------------------------------------------------------ handle
    def handle(self, data: list | None, context: Any) -> list | None:
        if data is None:
            return None
        t_start = time.perf_counter()
        responses: list = [None] * len(data)
        pending: list = []                 # (request index, Decoded)
        for idx, request in enumerate(data):
            _set_json(context, idx)
            try:
                pending.append((idx, self.decode_one(request, context, idx)))
            except RequestError as e:
                responses[idx] = self._fail(context, idx, e.status, e.message)
            except (ValueError, TypeError, UnicodeError) as e:
                responses[idx] = self._fail(context, idx, 400, f"could not decode the request: {e}")
            except Exception as e:  # an adapter bug must not take the batch-mates down
                log.exception("decoding request %d failed", idx)
                responses[idx] = self._fail(context, idx, 500, f"internal error decoding the request: {type(e).__name__}")
        self.profile.add(decode=time.perf_counter() - t_start)
        # Fan out: every valid request's rows in one list, run in model calls of batch_rows rows.
        owners = [k for k, (_, decoded) in enumerate(pending) for _ in decoded.rows]
        rows = [row for _, decoded in pending for row in decoded.rows]
        outputs: list = []
        for start in range(0, len(rows), self.batch_rows):
            outputs.extend(self._infer(rows[start:start + self.batch_rows]))
        # Gather back: each request's row outputs, in its own order.
        gathered: list = [[] for _ in pending]
        for k, out in zip(owners, outputs):
            gathered[k].append(out)
        t_respond = time.perf_counter()
        for (idx, decoded), outs in zip(pending, gathered):
            failure = next((o for o in outs if isinstance(o, _Failure)), None)
            if failure is not None:
                responses[idx] = self._fail(context, idx, failure.status, failure.message)
                continue
            try:
                responses[idx] = self.adapter.respond_request_bytes(outs, decoded)
            except RequestError as e:
                responses[idx] = self._fail(context, idx, e.status, e.message)
            except Exception as e:
                log.exception("answering request %d failed", idx)
                responses[idx] = self._fail(context, idx, 500, f"internal error answering the request: {type(e).__name__}")
        self.profile.add(respond=time.perf_counter() - t_respond)
        self.profile.batch(len(data), time.perf_counter() - t_start)
        return responses

    def decode_one(self, request: Any, context: Any, idx: int):
        # Empty bodies, the size limit and content checks are the adapter's (handlers/tasks/__init__.py).
        content_type = request_content_type(context, idx)
        return self.adapter.decode_request(undo_json_decoding(request_body(request), content_type), content_type)

    def _infer(self, samples: list) -> list:
        """Run the valid samples as one batch; if the batch fails, run them one by one so only the
        sample that breaks the model gets an error."""
        try:
            return self._run(samples)
        except MemoryError:
            log.exception("out of memory at batch %d", len(samples))
            if len(samples) == 1:
                return [_Failure(507, "out of memory running the model")]
        except Exception as e:
            log.exception("inference failed at batch %d", len(samples))
            if len(samples) == 1:
                return [_Failure(500, f"the model failed on this input: {type(e).__name__}: {e}")]
        return [self._infer([s])[0] for s in samples]

    def _run(self, samples: list) -> list:
        """Each row's outputs (a list, one array per model output, batch dimension removed)."""
        t0 = time.perf_counter()
        feeds = self.adapter.collate(samples)
        t1 = time.perf_counter()
        outputs = self.runtime.run(feeds)
        self.profile.add(collate=t1 - t0, model=time.perf_counter() - t1)
        return [[o[j] for o in outputs] for j in range(len(samples))]

    @staticmethod
    def _fail(context: Any, idx: int, status: int, message: str) -> bytes:
        _set_status(context, idx, status)
        return json_bytes(error_body(status, message))

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.runtime = None
        self.initialized = False


class _Failure:
    __slots__ = ("status", "message")

    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message


def _build_adapter(model_dir: str, task: dict, box: dict) -> None:
    try:
        box["adapter"] = make_adapter(model_dir, task)
    except BaseException as e:      # re-raised by initialize in the worker's own thread
        box["error"] = e


def _close_quietly(runtime: Any) -> None:
    try:
        runtime.close()
    except Exception:
        pass


__all__ = ["ServingHandler", "HandlerSetupError", "read_variant", "handler_settings", "resolve_device",
           "request_body", "request_content_type", "error_body", "inside"]
