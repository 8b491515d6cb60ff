"""The Ray Serve configuration of the served model, from the same derived settings as its TorchServe one.

Written by the archive stage into artifacts/ray-serve/ (paths.RAY_SERVE_DIR):
- `serve_config.yaml`: what `serve run` and `serve deploy` take as it is; the application is
  handlers/ray_app.py:build, serving the .mar's folder form (artifacts/model_store/<name>/);
- `rayservice.yaml`: a KubeRay RayService with the same Serve config inline and a head pod sized from
  the measurements (replicas x threads CPUs, replicas x the variant's peak RSS).

Each knob maps one TorchServe setting (model-config.yaml, explained in derivation.json):
  batchSize -> user_config.max_batch_size        maxBatchDelay -> user_config.batch_wait_timeout_s
  minWorkers -> num_replicas                     handler.threads -> ray_actor_options.num_cpus
  jobQueueSize -> max_queued_requests            responseTimeout -> http_options.request_timeout_s
  deviceType gpu -> ray_actor_options.num_gpus 1
max_ongoing_requests is what one replica holds at once: the batch it runs and the one forming (2 x batch
size), and at least its share of the expected concurrency, so the batches fill as they do in TorchServe.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import yaml

from pipeline.core.params import REPO_ROOT, Params

SERVE_CONFIG = "serve_config.yaml"
RAYSERVICE = "rayservice.yaml"
IMPORT_PATH = "handlers.ray_app:build"
DEPLOYMENT = "model"                    # handlers/ray_app.py's @serve.deployment name
RAY_IMAGE = "rayproject/ray:2.60.0-py311-cpu"
HTTP_PORT = 8000


def ray_settings(model_config: dict, expected_concurrency: int) -> dict[str, Any]:
    """The Ray Serve knobs from the TorchServe ones (model-config.yaml as the configure stage wrote it)."""
    handler = model_config.get("handler") or {}
    batch = max(1, int(model_config.get("batchSize") or 1))
    replicas = max(1, int(model_config.get("minWorkers") or 1))
    threads = int(handler.get("threads") or 1)
    gpu = model_config.get("deviceType") == "gpu" or handler.get("device") == "cuda"
    return {"num_replicas": replicas,
            "max_batch_size": batch,
            "batch_wait_timeout_s": round(float(model_config.get("maxBatchDelay") or 0) / 1000.0, 4),
            "max_ongoing_requests": max(2 * batch, math.ceil(expected_concurrency / replicas)),
            "max_queued_requests": int(model_config.get("jobQueueSize") or 100),
            "num_cpus": threads, "num_gpus": 1 if gpu else 0, "threads": threads,
            "request_timeout_s": int(model_config.get("responseTimeout") or 120)}


def model_dir_arg(folder: Path) -> str:
    """The model folder as the Serve config names it: relative to the repository root when inside it
    (handlers/ray_app.py resolves it there), so the config works in any checkout."""
    folder = Path(folder).resolve()
    try:
        return folder.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(folder)


def serve_config(model_name: str, folder: Path, settings: dict, *, host: str = "127.0.0.1",
                 port: int = HTTP_PORT) -> dict:
    actor: dict[str, Any] = {"num_cpus": settings["num_cpus"]}
    if settings["num_gpus"]:
        actor["num_gpus"] = settings["num_gpus"]
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": host, "port": int(port), "request_timeout_s": settings["request_timeout_s"]},
        # A log line per request costs the proxy and the replica more CPU than the handler's decode and
        # respond together; the replicas keep their INFO lines (load phases, batches formed).
        "logging_config": {"enable_access_log": False, "log_level": "WARNING"},
        "applications": [{
            "name": model_name, "route_prefix": "/", "import_path": IMPORT_PATH,
            "logging_config": {"enable_access_log": False, "log_level": "INFO"},
            "args": {"model_dir": model_dir_arg(folder), "model_name": model_name},
            # one intra-op pool per replica, as the handler's threads setting gives it
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(settings["threads"]),
                                         "TOKENIZERS_PARALLELISM": "false"}},
            "deployments": [{
                "name": DEPLOYMENT, "num_replicas": settings["num_replicas"],
                "max_ongoing_requests": settings["max_ongoing_requests"],
                "max_queued_requests": settings["max_queued_requests"],
                "ray_actor_options": actor,
                "user_config": {"max_batch_size": settings["max_batch_size"],
                                "batch_wait_timeout_s": settings["batch_wait_timeout_s"]},
            }],
        }],
    }


def rayservice(model_name: str, config: dict, settings: dict, peak_rss_mb: Optional[float]) -> dict:
    """A KubeRay RayService: one head pod that runs the replicas (a CPU model needs no worker group); its
    image must hold this checkout and the pulled outputs at /app (docs/ray-serve.md)."""
    inline = yaml.safe_load(yaml.safe_dump(config))
    inline["http_options"]["host"] = "0.0.0.0"     # reached through the Service, not loopback
    cpus = settings["num_replicas"] * settings["num_cpus"] + 1          # + the proxy and the controller
    memory_mb = math.ceil((settings["num_replicas"] * (peak_rss_mb or 1024.0)) * 1.5 + 1024)
    resources: dict[str, Any] = {"cpu": str(cpus), "memory": f"{memory_mb}Mi"}
    if settings["num_gpus"]:
        resources["nvidia.com/gpu"] = str(settings["num_replicas"])
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": {"name": model_name.lower().replace("_", "-")},
        "spec": {
            "serveConfigV2": yaml.safe_dump(inline, sort_keys=False),
            "rayClusterConfig": {
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": str(cpus - 1), "dashboard-host": "0.0.0.0"},
                    "template": {"spec": {"containers": [{
                        "name": "ray-head", "image": RAY_IMAGE, "workingDir": "/app",
                        "resources": {"requests": resources, "limits": resources},
                        "ports": [{"containerPort": HTTP_PORT, "name": "serve"},
                                  {"containerPort": 6379, "name": "gcs"},
                                  {"containerPort": 8265, "name": "dashboard"}]}]}}},
            },
        },
    }


HEADER = ("# Generated by stages/archive.py (pipeline/serve/server/ray_serve_config.py) from artifacts/serve/model-config.yaml:\n"
          "# the same batch, delay, workers and threads TorchServe serves the model with. {what}\n")


def peak_rss_mb(folder: Path, benchmarks_dir: Optional[Path]) -> Optional[float]:
    """The packed variant's peak RSS as its benchmark measured it (metrics/benchmark/<variant>.json), if any."""
    if benchmarks_dir is None:
        return None
    variant = json.loads((Path(folder) / "variant.json").read_text()).get("variant")
    path = Path(benchmarks_dir) / f"{variant}.json"
    return json.loads(path.read_text()).get("peak_rss_mb") if path.is_file() else None


def write_ray_serve(params: Params, folder: Path, out_dir: Path, *, benchmarks_dir: Optional[Path] = None) -> dict:
    """Write serve_config.yaml and rayservice.yaml for the model packed in `folder` (the .mar's folder form);
    returns the settings they carry."""
    model_config = yaml.safe_load((Path(folder) / "model-config.yaml").read_text()) or {}
    settings = ray_settings(model_config, params.serve.expected_concurrency)
    config = serve_config(params.model.name, folder, settings, host=params.serve.bind_address)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        shown = (out_dir.resolve() / SERVE_CONFIG).relative_to(REPO_ROOT).as_posix()
    except ValueError:
        shown = str(out_dir / SERVE_CONFIG)
    (out_dir / SERVE_CONFIG).write_text(
        HEADER.format(what=f"Start it from the repository root: serve run {shown}")
        + yaml.safe_dump(config, sort_keys=False))
    (out_dir / RAYSERVICE).write_text(
        HEADER.format(what="kubectl apply -f rayservice.yaml (KubeRay; docs/ray-serve.md)")
        + yaml.safe_dump(rayservice(params.model.name, config, settings, peak_rss_mb(folder, benchmarks_dir)), sort_keys=False))
    return settings
