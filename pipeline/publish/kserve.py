"""The KServe layout: the same .mar, laid out as KServe's TorchServe runtime expects.

KServe's `kserve-torchserve` ServingRuntime downloads `storageUri` to `/mnt/models` and starts
`torchserve --start --model-store=/mnt/models/model-store --ts-config=/mnt/models/config/config.properties`
with a KServe wrapper in the same container that listens on 8080 and forwards to TorchServe on
8085. So the storage location must hold:

    config/config.properties      inference on 0.0.0.0:8085, metrics API for Prometheus on 8082,
                                  model_store=/mnt/models/model-store, and the model in `model_snapshot`
    model-store/<name>.mar

The wrapper reads config.properties with a naive `split("=", 1)` per line and `json.loads` of
`model_snapshot`, so the snapshot must be one line of JSON. The manifest's resources and probes come
from the measurements (pipeline/publish/kserve_resources.py), their derivation beside it in
resources.json and as its header comments. The serving values (batch size, delay,
workers, timeouts) are the ones the configure stage derived; the snapshot's version key must equal
the .mar manifest's modelVersion or TorchServe does not find the model.
"""
from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from pipeline.decide.store_form import form_of, link_or_copy, link_or_copy_tree, store_entry
from pipeline.publish import kserve_resources

KSERVE_MOUNT = "/mnt/models"
KSERVE_MODEL_STORE = f"{KSERVE_MOUNT}/model-store"
INFERENCE_PORT = 8085          # the KServe wrapper owns 8080 and forwards here
METRICS_PORT = 8082            # the runtime's prometheus.kserve.io/port annotation
GRPC_INFERENCE_PORT = 7070
GRPC_MANAGEMENT_PORT = 7071
STORAGE_URI_PLACEHOLDER = "s3://YOUR-BUCKET/models/{name}"


class KServeError(ValueError):
    """The inputs for the KServe layout are missing or inconsistent; the message names the fix."""


@dataclass(frozen=True)
class ServingValues:
    """What the snapshot and the defaults carry, taken from the configure stage's outputs."""
    batch_size: int
    max_batch_delay_ms: int
    min_workers: int
    max_workers: int
    response_timeout_s: int
    startup_timeout_s: int
    job_queue_size: Optional[int] = None
    max_request_size: Optional[int] = None
    max_response_size: Optional[int] = None


def _int(x: Any) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def serving_values(model_config: dict, derivation: Optional[dict] = None) -> ServingValues:
    """model-config.yaml is what TorchServe obeys for the model (it wins over config.properties),
    so its values go into the snapshot; the server-wide limits come from derivation.json."""
    need = ("batchSize", "maxBatchDelay", "minWorkers", "maxWorkers", "responseTimeout", "startupTimeout")
    missing = [k for k in need if _int(model_config.get(k)) is None]
    if missing:
        raise KServeError(f"artifacts/serve/model-config.yaml lacks integer {', '.join(missing)}; "
                          f"re-run `dvc repro configure`")
    d = {k: (v.get("value") if isinstance(v, dict) else v) for k, v in (derivation or {}).items()}
    return ServingValues(
        batch_size=model_config["batchSize"], max_batch_delay_ms=model_config["maxBatchDelay"],
        min_workers=model_config["minWorkers"], max_workers=model_config["maxWorkers"],
        response_timeout_s=model_config["responseTimeout"], startup_timeout_s=model_config["startupTimeout"],
        job_queue_size=_int(model_config.get("jobQueueSize")) or _int(d.get("job_queue_size")),
        max_request_size=_int(d.get("max_request_size")), max_response_size=_int(d.get("max_response_size")))


def model_snapshot(model_name: str, model_version: str, values: ServingValues,
                   mar_name: Optional[str] = None) -> dict:
    """mar_name: the model store entry, `<name>.mar` or the unpacked folder `<name>` (store_form)."""
    return {"name": "startup.cfg", "modelCount": 1, "models": {model_name: {model_version: {
        "defaultVersion": True, "marName": mar_name or f"{model_name}.mar",
        "minWorkers": values.min_workers, "maxWorkers": values.max_workers,
        "batchSize": values.batch_size, "maxBatchDelay": values.max_batch_delay_ms,
        "responseTimeout": values.response_timeout_s, "startupTimeout": values.startup_timeout_s}}}}


def kserve_config_properties(model_name: str, model_version: str, values: ServingValues,
                             model_store: str = KSERVE_MODEL_STORE, mar_name: Optional[str] = None) -> str:
    """config.properties for KServe's TorchServe runtime (one `key=value` per line, no escapes needed)."""
    if "\\" in model_store:
        raise KServeError(f"model store {model_store!r}: use forward slashes (java.util.Properties eats backslashes)")
    lines = [
        "# For KServe's kserve-torchserve runtime: mounted at /mnt/models/config/config.properties.",
        "# Generated by `python -m stages.kserve` from artifacts/serve/ (see reports/report.md).",
        f"inference_address=http://0.0.0.0:{INFERENCE_PORT}",
        # Same port as inference, as KServe's docs do: the wrapper in the pod uses it to check the model.
        f"management_address=http://0.0.0.0:{INFERENCE_PORT}",
        f"metrics_address=http://0.0.0.0:{METRICS_PORT}",
        f"grpc_inference_port={GRPC_INFERENCE_PORT}",
        f"grpc_management_port={GRPC_MANAGEMENT_PORT}",
        "enable_metrics_api=true",
        "metrics_mode=prometheus",
        "enable_envvars_config=true",
        # The .mar brings everything it needs; never pip-install at registration time in a pod.
        "install_py_dep_per_model=false",
        # The KServe wrapper in the same container calls TorchServe without a token (TorchServe 0.12
        # would answer 400); access control is the cluster's (ingress / auth policy), not the pod's.
        "disable_token_authorization=true",
        # The model is loaded from model_snapshot at start; no registration over HTTP.
        "enable_model_api=false",
        f"default_workers_per_model={values.max_workers}",
        f"default_response_timeout={values.response_timeout_s}",
        f"default_startup_timeout={values.startup_timeout_s}",
    ]
    if values.job_queue_size:
        lines.append(f"job_queue_size={values.job_queue_size}")
    if values.max_request_size:
        lines.append(f"max_request_size={values.max_request_size}")
    if values.max_response_size:
        lines.append(f"max_response_size={values.max_response_size}")
    lines.append(f"model_store={model_store}")
    # One line of JSON: the wrapper json.loads everything after the first '='.
    lines.append("model_snapshot=" + json.dumps(model_snapshot(model_name, model_version, values, mar_name),
                                                separators=(",", ":")))
    return "\n".join(lines) + "\n"


def inferenceservice_manifest(model_name: str, storage_uri: str, values: ServingValues,
                              service_account: str = "s3-access", derived: Optional[dict] = None) -> str:
    """A sample InferenceService using the kserve-torchserve runtime (v1 protocol); resources and probes
    from `derived` (kserve_resources.derive: the measurements), their derivation as header comments."""
    derived = derived or kserve_resources.derive(model_name, {"maxWorkers": values.max_workers,
                                                              "startupTimeout": values.startup_timeout_s}, None, None)
    requests: dict[str, str] = {"cpu": derived["cpu"]["value"]}
    limits: dict[str, str] = {"cpu": derived["cpu"]["value"]}
    if derived.get("memory_request"):
        requests["memory"] = derived["memory_request"]["value"]
        limits["memory"] = derived["memory_limit"]["value"]
    doc = {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": model_name.lower().replace("_", "-").replace(".", "-"),
                     "annotations": {"serving.kserve.io/deploymentMode": "RawDeployment"}},
        "spec": {"predictor": {
            # Holds the S3 credentials secret (see KServe's S3 storage docs); drop it for public buckets.
            "serviceAccountName": service_account,
            "minReplicas": 1,
            "model": {
                "modelFormat": {"name": "pytorch"},
                "protocolVersion": "v1",
                # Points at the folder holding config/ and model-store/ (artifacts/kserve/ uploaded).
                "storageUri": storage_uri,
                "resources": {"requests": requests, "limits": limits},
                "startupProbe": derived["startupProbe"],
                "readinessProbe": derived["readinessProbe"],
            }}},
    }
    header = (f"# Sample InferenceService for {model_name}: upload artifacts/kserve/ (config/ + model-store/)\n"
              f"# to the storageUri below, then `kubectl apply -f artifacts/kserve/inferenceservice.yaml`.\n"
              f"# Requests: POST /v1/models/{model_name}:predict with {{\"instances\": [...]}} (KServe v1 protocol).\n"
              + "".join(f"# {line}\n" for line in kserve_resources.comment_lines(derived)))
    return header + yaml.safe_dump(doc, sort_keys=False, width=120)


def envelope_warnings(values: ServingValues) -> list[str]:
    """What to tell the user about the KServe v1 envelope (TS_SERVICE_ENVELOPE=kserve).

    TorchServe 0.12's KServeEnvelope reads only the FIRST request of a server-side batch (its
    `instances` become the handler's batch) and returns one response: with batchSize > 1,
    concurrent KServe requests batched together get a response-count mismatch (503). Under KServe,
    batch on the client side (several `instances` per request) and serve with batchSize 1."""
    if values.batch_size > 1:
        return [f"batchSize is {values.batch_size}: under KServe's v1 envelope TorchServe 0.12 answers only the "
                f"first request of a server-side batch. For KServe, build with `serve.overrides.batch_size: 1` "
                f"(send several `instances` per request instead); the .mar's model-config.yaml batchSize wins "
                f"over model_snapshot, so this cannot be fixed in config.properties alone."]
    return []


@dataclass(frozen=True)
class KServeLayout:
    root: Path
    config_properties: Path
    mar: Path
    manifest: Path
    resources: Optional[Path] = None
    warnings: tuple[str, ...] = ()


def build_layout(model_name: str, mar: Path, model_config: dict, derivation: Optional[dict], out_dir: Path,
                 storage_uri: Optional[str] = None, serve_check: Optional[dict] = None) -> KServeLayout:
    """Write `out_dir/{config/config.properties, model-store/<name>.mar, inferenceservice.yaml,
    resources.json}` (resources.json: the manifest's resources and probes with their formulas and the
    measurements they come from, kserve_resources.derive: serve_check is metrics/serve_check.json); when
    derivation.json chose the folder store form, `model-store/<name>/` (the .mar unpacked, beside it
    in the model store) instead of the .mar: a pod starts from it without copying the weights. The
    model files are hard links to artifacts/model_store's (copies only across filesystems)."""
    form = form_of(derivation)
    folder = mar.parent / store_entry(model_name, "folder")
    if form == "folder" and not (folder / "MAR-INF" / "MANIFEST.json").is_file():
        raise KServeError(f"{folder} (the unpacked .mar, store form 'folder') not found; run `dvc repro archive`")
    if not mar.is_file():
        raise KServeError(f"{mar} not found; run `dvc repro archive` first")
    version = mar_model_version(mar)
    if not version:
        raise KServeError(f"{mar}: no MAR-INF/MANIFEST.json with a modelVersion; is it a torch-model-archiver .mar?")
    values = serving_values(model_config, derivation)
    if out_dir.exists():
        shutil.rmtree(out_dir)            # the stage owns the folder: nothing stale survives
    (out_dir / "config").mkdir(parents=True)
    (out_dir / "model-store").mkdir()
    props = out_dir / "config" / "config.properties"
    props.write_text(kserve_config_properties(model_name, version, values,
                                              mar_name=store_entry(model_name, form)))
    target = out_dir / "model-store" / store_entry(model_name, form)
    # Links, not copies: the layout's model files are the model store's bytes (a copy only across filesystems).
    if form == "folder":
        link_or_copy_tree(folder, target)
    else:
        link_or_copy(mar, target)
    derived = kserve_resources.derive(model_name, model_config, derivation, serve_check)
    resources = out_dir / "resources.json"
    resources.write_text(json.dumps(derived, indent=2) + "\n")
    manifest = out_dir / "inferenceservice.yaml"
    manifest.write_text(inferenceservice_manifest(model_name, storage_uri or STORAGE_URI_PLACEHOLDER.format(name=model_name),
                                                  values, derived=derived))
    warnings = envelope_warnings(values)
    if not derived.get("memory_request"):
        warnings.append("no peak RSS per worker measured (metrics/serve_check.json worker_peak_rss_mb, or "
                        "derivation.json workers.inputs.peak_rss_mb): inferenceservice.yaml sets no memory "
                        "request or limit; run `dvc repro serve_check` first")
    return KServeLayout(root=out_dir, config_properties=props, mar=target, manifest=manifest, resources=resources,
                        warnings=tuple(warnings))


def mar_model_version(mar: Path) -> Optional[str]:
    """modelVersion from the archive's MAR-INF/MANIFEST.json (None if it is not a readable .mar)."""
    try:
        with zipfile.ZipFile(mar) as z:
            manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))
        version = manifest.get("model", {}).get("modelVersion")
        return str(version) if version else None
    except (zipfile.BadZipFile, KeyError, json.JSONDecodeError, OSError):
        return None


def naive_properties(text: str) -> dict[str, str]:
    """config.properties read exactly the way KServe's wrapper reads it: every line holding '='
    (comments included) split on the first '='."""
    keys = {}
    for line in text.splitlines():
        if "=" in line:
            name, value = line.split("=", 1)
            keys[name.strip()] = value.strip()
    return keys
