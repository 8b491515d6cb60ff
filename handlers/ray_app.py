"""Ray Serve application: the packed model served by the same handler TorchServe runs, behind the clients' routes.

    serve run artifacts/ray-serve/serve_config.yaml        # written by the archive stage

The model is the .mar's folder form (artifacts/model_store/<name>/, the archive stage unpacks it): its
variant.json, weights and model-config.yaml. Each replica builds the family's ServingHandler
(handlers/torch_handler.py, handlers/onnx_handler.py) and initialises it exactly as a TorchServe worker
does (runtime, task adapter, warm-up at the batch size); `@serve.batch` gathers concurrent requests into
one `handle()` call, the handler's decode/fan-out/respond and its per-request 4xx run unchanged, so a bad
request never fails its batch-mates. Batch size and delay come from model-config.yaml (batchSize,
maxBatchDelay) unless the Serve config's `user_config` names others.

Routes (handlers/client_api.py translates the clients' bodies):
- `POST /`, `/predict`, `/predictions/<name>`: the bodies the TorchServe model takes (Hugging Face's
  `{"inputs": ...}`, TEI's `/predict`, the task's own);
- `POST /v1/embeddings` (OpenAI), `POST /embed` (TEI): text-embedding models; `POST /rerank` (TEI): rerankers;
- `GET /health`, `/ping`, `/info`, `/v1/models`.
A route the model's task does not serve answers 404 naming the routes it does.

This module is not packed into the .mar; it imports ray and fastapi, which a TorchServe worker lacks.
"""

import asyncio
import importlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from handlers import client_api
from handlers.encode import json_bytes
from handlers.serving import HandlerSetupError, read_variant
from handlers.tasks import RequestError

log = logging.getLogger("ray.serve")

ROOT = Path(__file__).resolve().parents[1]      # relative model paths in the Serve config start here
ENTRY_MODULES = {"torch": ("handlers.torch_handler", "TorchHandler"), "onnx": ("handlers.onnx_handler", "OnnxHandler")}
JSON = "application/json"
ROUTES = {"text-embedding": ("/v1/embeddings", "/embed", "/predict", "/"),
          "rerank": ("/rerank", "/predict", "/"),
          "text-classification": ("/predict", "/"), "token-classification": ("/predict", "/"),
          "image-classification": ("/predict", "/"), "tensor": ("/predict", "/")}

api = FastAPI(title="model (Ray Serve)", docs_url=None, redoc_url=None)


class ServeContext:
    """The part of TorchServe's worker context the ServingHandler reads and writes: system properties and
    model-config.yaml at initialise; per batch, each request's content type in and its status out."""

    def __init__(self, system_properties: dict, model_yaml_config: dict, content_types: list | None = None):
        self.system_properties = system_properties
        self.model_yaml_config = model_yaml_config
        self.content_types = content_types or []
        self.statuses: dict[int, int] = {}

    def get_all_request_header(self, idx: int) -> dict:
        ctype = self.content_types[idx] if idx < len(self.content_types) else None
        return {"content-type": ctype} if ctype else {}

    def set_response_status(self, code: int, phrase: str = "", idx: int = 0) -> None:
        self.statuses[idx] = int(code)

    def set_response_content_type(self, idx: int, value: str) -> None:
        pass            # every answer of this handler is JSON


def model_folder(path: str) -> Path:
    folder = Path(path)
    folder = folder if folder.is_absolute() else ROOT / folder
    if not (folder / "variant.json").is_file():
        raise HandlerSetupError(f"{folder} is not a packed model folder (no variant.json): run the pipeline "
                                f"(`dvc repro`, or `dvc pull` the published outputs) so the archive stage writes it")
    return folder


def model_config(folder: Path) -> dict:
    path = folder / "model-config.yaml"
    if not path.is_file():
        raise HandlerSetupError(f"{path} is missing: the archive stage packs it beside variant.json")
    return yaml.safe_load(path.read_text()) or {}


@serve.deployment(name="model")
@serve.ingress(api)
class ModelDeployment:
    def __init__(self, model_dir: str, model_name: str):
        t0 = time.perf_counter()
        # The handler's [load] and [profile] lines go where the replica's own log goes (logs/serve/replica_*.log).
        handlers_log = logging.getLogger("handlers")
        handlers_log.handlers, handlers_log.propagate = list(log.handlers), False
        handlers_log.setLevel(logging.INFO)
        self.name = model_name
        self.folder = model_folder(model_dir)
        self.config = model_config(self.folder)
        self.variant = read_variant(str(self.folder))
        module, cls = ENTRY_MODULES[self.variant["family"]]
        self.handler = getattr(importlib.import_module(module), cls)()
        import ray
        gpu_id = 0 if ray.get_gpu_ids() else None     # Ray shows a replica only the GPU it was given
        batch_size = int(self.config.get("batchSize") or 1)
        self.handler.initialize(ServeContext({"model_dir": str(self.folder), "batch_size": batch_size,
                                              "gpu_id": gpu_id}, self.config))
        self.kind = self.variant["task"]["kind"]
        self.configure_batching(batch_size, float(self.config.get("maxBatchDelay") or 0) / 1000.0)
        self.load_s = time.perf_counter() - t0
        log.info("[load] %s on Ray Serve: variant %s, batch %d, delay %.3f s, loaded in %.2f s", model_name,
                 self.variant.get("variant"), self._batched._get_max_batch_size(),
                 self._batched._get_batch_wait_timeout_s(), self.load_s)
        log.info("[replica] pid=%d ready", os.getpid())     # pipeline/serve/server/ray_server.py counts these

    def configure_batching(self, max_batch_size: int, wait_s: float) -> None:
        self._batched.set_max_batch_size(max(1, int(max_batch_size)))
        self._batched.set_batch_wait_timeout_s(max(0.0, float(wait_s)))

    def reconfigure(self, user_config: dict) -> None:
        """The Serve config's `user_config`: `max_batch_size`, `batch_wait_timeout_s` (tuning without a rebuild)."""
        user_config = user_config or {}
        self.configure_batching(user_config.get("max_batch_size", self._batched._get_max_batch_size()),
                                user_config.get("batch_wait_timeout_s", self._batched._get_batch_wait_timeout_s()))

    # ------------------------------------------------------------------ the batch
    @serve.batch(max_batch_size=1, batch_wait_timeout_s=0.0)
    async def _batched(self, items: list) -> list:
        # Which requests shared this batch (read by the checks, as TorchServe's PredictionTime lines are).
        ids = [c.request_id for c in serve.context._get_serve_batch_request_context()]
        log.info("[batch] size=%d ids=%s", len(items), ",".join(ids))
        # The model runs in a thread: the event loop keeps accepting requests, which form the next batch.
        return await asyncio.get_running_loop().run_in_executor(None, self._handle, items)

    def _handle(self, items: list) -> list:
        context = ServeContext({}, self.config, [ctype for _, ctype in items])
        answers = self.handler.handle([{"body": body} for body, _ in items], context)
        return [(context.statuses.get(i, 200), answer) for i, answer in enumerate(answers)]

    async def answer(self, body: bytes, content_type: str | None) -> tuple[int, bytes]:
        return await self._batched((body, content_type))

    def refuse_route(self, route: str) -> Response | None:
        served = ROUTES.get(self.kind, ("/predict", "/"))
        if route in served:
            return None
        return JSONResponse({"error": f"this model's task is {self.kind}: {route} is not served here; "
                                      f"its routes are {', '.join(served)}", "status": 404}, status_code=404)

    # ------------------------------------------------------------------ the task's own bodies
    @api.post("/")
    async def root(self, request: Request) -> Response:
        return await self.predict(request)

    @api.post("/predict")
    async def predict(self, request: Request) -> Response:
        status, answer = await self.answer(await request.body(), request.headers.get("content-type"))
        return Response(answer, status_code=status, media_type=JSON)

    @api.post("/predictions/{name}")
    async def predictions(self, name: str, request: Request) -> Response:
        if name != self.name:
            return JSONResponse({"error": f"model {name!r} is not served here; this one is {self.name!r}",
                                 "status": 404}, status_code=404)
        return await self.predict(request)

    @api.post("/rerank")
    async def rerank(self, request: Request) -> Response:
        refused = self.refuse_route("/rerank")
        if refused is not None:
            return refused
        status, answer = await self.answer(await request.body(), JSON)
        if status != 200:
            return JSONResponse(client_api.tei_error(status, client_api.error_message(answer)), status_code=status)
        return Response(answer, media_type=JSON)

    # ------------------------------------------------------------------ embeddings
    async def embeddings(self, parsed: client_api.EmbeddingsRequest) -> tuple[int, Any]:
        status, answer = await self.answer(json_bytes(parsed.adapter_body), JSON)
        if status != 200:
            return status, client_api.error_message(answer)
        return 200, client_api.vectors(parsed, answer)

    async def client_embeddings(self, route: str, request: Request, parse: Callable, error: Callable,
                                answer: Callable) -> Response:
        """One client API's embeddings route: its body parsed by `parse`, its errors in `error`'s shape,
        its vectors in `answer`'s (handlers/client_api.py)."""
        refused = self.refuse_route(route)
        if refused is not None:
            return refused
        try:
            parsed = parse(await request.body())
            status, result = await self.embeddings(parsed)
        except RequestError as e:
            status, result = e.status, e.message
        if status != 200:
            return JSONResponse(error(status, result), status_code=status)
        return Response(json_bytes(answer(parsed, result)), media_type=JSON)

    @api.post("/v1/embeddings")
    async def openai_embeddings(self, request: Request) -> Response:
        def answer(parsed, rows):
            tokens = sum(len(e.ids) for e in self.handler.adapter.tokenizer.encode_batch(parsed.texts))
            return client_api.openai_answer(parsed, rows, self.name, tokens)
        return await self.client_embeddings("/v1/embeddings", request, client_api.openai_embeddings,
                                            client_api.openai_error, answer)

    @api.post("/embed")
    async def tei_embed(self, request: Request) -> Response:
        return await self.client_embeddings("/embed", request, client_api.tei_embed, client_api.tei_error,
                                            lambda parsed, rows: rows)

    # ------------------------------------------------------------------ health and metadata
    @api.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"status": "Healthy"})

    @api.get("/ping")
    async def ping(self) -> Response:
        return JSONResponse({"status": "Healthy"})

    @api.get("/info")
    async def info(self) -> Response:
        task = self.variant["task"]
        return JSONResponse({"model_id": self.name, "task": self.kind, "variant": self.variant.get("variant"),
                             "dtype": self.variant.get("dtype"), "max_input_length": task.get("max_length"),
                             "max_client_batch_size": getattr(self.handler.adapter, "max_texts", None),
                             "max_batch_size": self._batched._get_max_batch_size(),
                             "batch_wait_timeout_s": self._batched._get_batch_wait_timeout_s(),
                             "load_s": round(self.load_s, 3), "routes": list(ROUTES.get(self.kind, ()))})

    @api.get("/v1/models")
    async def models(self) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "local"}]})


def build(args: dict) -> Any:
    """The application `serve run` builds from the Serve config's `args`: `model_dir` (the .mar's folder form,
    relative to the repository root) and `model_name`."""
    missing = [k for k in ("model_dir", "model_name") if not args.get(k)]
    if missing:
        raise ValueError(f"the Serve config's args lack {', '.join(missing)}: rebuild it with the archive stage")
    return ModelDeployment.bind(str(args["model_dir"]), str(args["model_name"]))
