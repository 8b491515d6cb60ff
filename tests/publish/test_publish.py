"""Publishing: a DVC remote round trip through a local S3-compatible server, and the KServe layout.

The S3 server is moto's (real HTTP on loopback, real boto3/botocore/dvc-s3 clients); the KServe
layout is loaded by a real TorchServe the way KServe's runtime would (model from model_snapshot).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from pipeline.publish.kserve import (KSERVE_MODEL_STORE, build_layout, kserve_config_properties, model_snapshot,
                             naive_properties, serving_values)
from pipeline.core.params import REPO_ROOT

BIN = Path(sys.executable).parent
MODEL_CONFIG = {"minWorkers": 1, "maxWorkers": 1, "batchSize": 4, "maxBatchDelay": 7, "responseTimeout": 11,
                "startupTimeout": 33, "handler": {"threads": 2}}
DERIVATION = {"job_queue_size": {"value": 64, "formula": "…", "inputs": {}, "overridden": False},
              "max_request_size": {"value": 131072, "formula": "…", "inputs": {}, "overridden": False}}


# --------------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sha256_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root (DVC's own .gitignore, a git file, left out)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".gitignore"}


def clean_env(**extra) -> dict:
    """No AWS settings leak in from the machine; loopback never goes through a proxy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and "proxy" not in k.lower()}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", NO_PROXY="127.0.0.1,localhost",
               AWS_EC2_METADATA_DISABLED="true", GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com", DVC_NO_ANALYTICS="1")
    env.update(extra)
    return env


def sh(args: list[str], cwd: Path, env: dict) -> str:
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture
def s3_server():
    """moto's S3 server on a free loopback port, with one bucket."""
    from moto.server import ThreadedMotoServer
    import boto3

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    s3.create_bucket(Bucket="models")
    try:
        yield endpoint, s3
    finally:
        server.stop()


MAKE_STORE = '''"""Stands in for the archive + configure stages: writes a tiny .mar and a config."""
import json, random, zipfile
from pathlib import Path
rng = random.Random(7)
store, serve = Path("artifacts/model_store"), Path("artifacts/serve")
store.mkdir(parents=True, exist_ok=True); serve.mkdir(parents=True, exist_ok=True)
with zipfile.ZipFile(store / "tiny.mar", "w", zipfile.ZIP_STORED) as z:
    z.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": "tiny", "modelVersion": "1.0"}}))
    z.writestr("model.onnx", bytes(rng.getrandbits(8) for _ in range(300_000)))
(serve / "config.properties").write_text("load_models=tiny=tiny.mar\\nmodel_store=/srv/models\\n")
(serve / "model-config.yaml").write_text("batchSize: 4\\nmaxBatchDelay: 5\\n")
'''

DVC_YAML = """stages:
  archive:
    cmd: python make_store.py
    deps:
      - make_store.py
    outs:
      - artifacts/model_store
      - artifacts/serve
"""


# --------------------------------------------------------------------------- DVC remote on S3
def test_dvc_push_pull_round_trip_through_local_s3(tmp_path, s3_server):
    endpoint, s3 = s3_server
    repo = tmp_path / "build"
    repo.mkdir()
    env = clean_env()
    dvc = str(BIN / "dvc")
    sh(["git", "init", "-q"], repo, env)
    sh([dvc, "init", "-q"], repo, env)
    (repo / "make_store.py").write_text(MAKE_STORE)
    (repo / "dvc.yaml").write_text(DVC_YAML)
    # The README's commands: remote + endpoint in the committed config, credentials in config.local.
    sh([dvc, "remote", "add", "-d", "s3remote", "s3://models/store"], repo, env)
    sh([dvc, "remote", "modify", "s3remote", "endpointurl", endpoint], repo, env)
    sh([dvc, "remote", "modify", "s3remote", "region", "us-east-1"], repo, env)
    sh([dvc, "remote", "modify", "--local", "s3remote", "access_key_id", "testing"], repo, env)
    sh([dvc, "remote", "modify", "--local", "s3remote", "secret_access_key", "testing"], repo, env)
    assert "testing" not in (repo / ".dvc" / "config").read_text()          # secrets never committed
    assert "secret_access_key" in (repo / ".dvc" / "config.local").read_text()

    sh([dvc, "repro", "-q"], repo, env)
    sh(["git", "add", "-A"], repo, env)
    sh(["git", "commit", "-q", "-m", "build"], repo, env)
    built = {**sha256_tree(repo / "artifacts")}
    assert set(built) == {"model_store/tiny.mar", "serve/config.properties", "serve/model-config.yaml"}

    sh([dvc, "push", "-q"], repo, env)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="models", Prefix="store/").get("Contents", [])]
    # Content-addressed: the 3 files under their md5, the 2 directory manifests under dvc.lock's "<md5>.dir".
    manifests = {o["md5"] for o in yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["archive"]["outs"]}
    contents = {hashlib.md5((repo / "artifacts" / rel).read_bytes()).hexdigest() for rel in built}
    assert len(manifests) == 2 and all(m.endswith(".dir") for m in manifests) and len(contents) == 3
    assert sorted(keys) == sorted(f"store/files/md5/{h[:2]}/{h[2:]}" for h in contents | manifests)
    assert json.loads(sh([dvc, "status", "--cloud", "--json"], repo, env) or "{}") == {}

    # Wipe the outputs AND the cache: only the remote holds the bytes now.
    shutil.rmtree(repo / "artifacts" / "model_store")
    shutil.rmtree(repo / "artifacts" / "serve")
    shutil.rmtree(repo / ".dvc" / "cache")
    sh([dvc, "pull", "-q"], repo, env)
    assert sha256_tree(repo / "artifacts") == built

    # A deployment host: a fresh clone (no config.local), credentials from the environment.
    host = tmp_path / "host"
    sh(["git", "clone", "-q", str(repo), str(host)], tmp_path, env)
    assert not (host / "artifacts" / "model_store").exists()
    host_env = clean_env(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    sh([dvc, "pull", "-q", "artifacts/model_store"], host, host_env)
    assert sha256_tree(host / "artifacts") == {k: v for k, v in built.items() if k.startswith("model_store/")}


def test_dvc_push_with_wrong_credentials_fails_clearly(tmp_path, s3_server):
    endpoint, _ = s3_server
    repo = tmp_path / "r"
    repo.mkdir()
    env = clean_env()
    dvc = str(BIN / "dvc")
    sh(["git", "init", "-q"], repo, env)
    sh([dvc, "init", "-q"], repo, env)
    (repo / "make_store.py").write_text(MAKE_STORE)
    (repo / "dvc.yaml").write_text(DVC_YAML)
    sh([dvc, "remote", "add", "-d", "s3remote", "s3://no-such-bucket/store"], repo, env)
    sh([dvc, "remote", "modify", "s3remote", "endpointurl", endpoint], repo, env)
    sh([dvc, "repro", "-q"], repo, env)
    r = subprocess.run([dvc, "push"], cwd=repo, env=clean_env(AWS_ACCESS_KEY_ID="testing",
                                                              AWS_SECRET_ACCESS_KEY="testing"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "no-such-bucket" in (r.stdout + r.stderr) or "NoSuchBucket" in (r.stdout + r.stderr)


# --------------------------------------------------------------------------- KServe layout
def make_mar(path: Path, version: str = "1.0") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": path.stem, "modelVersion": version}}))
        z.writestr("model.onnx", b"\1" * 1000)
    return path


def test_kserve_stage_writes_the_runtime_layout(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "model": {"name": "tiny", "source": "torchscript", "checkpoint": "m.pt", "task": "tensor", "input_shape": [4]},
        "publish": {"kserve_storage_uri": "s3://acme-models/tiny/v3"}}))
    make_mar(tmp_path / "artifacts" / "model_store" / "tiny.mar", version="2.5")
    serve = tmp_path / "artifacts" / "serve"
    serve.mkdir(parents=True)
    (serve / "model-config.yaml").write_text(yaml.safe_dump(MODEL_CONFIG))
    (serve / "derivation.json").write_text(json.dumps(DERIVATION))
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "serve_check.json").write_text(json.dumps({"worker_peak_rss_mb": 410.0}))
    stale = tmp_path / "artifacts" / "kserve" / "model-store" / "old.mar"
    make_mar(stale)

    r = subprocess.run([sys.executable, "-m", "stages.kserve", "--root", str(tmp_path)], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    k = tmp_path / "artifacts" / "kserve"
    assert sorted(str(p.relative_to(k)) for p in k.rglob("*") if p.is_file()) == [
        "config/config.properties", "inferenceservice.yaml", "model-store/tiny.mar", "resources.json"]
    assert (k / "model-store" / "tiny.mar").read_bytes() == (tmp_path / "artifacts/model_store/tiny.mar").read_bytes()

    # Read the way KServe's wrapper reads it: naive split, json.loads of the snapshot.
    props = naive_properties((k / "config" / "config.properties").read_text())
    assert not any(key.startswith("#") for key in props)
    assert props["inference_address"] == "http://0.0.0.0:8085"
    assert props["model_store"] == KSERVE_MODEL_STORE == "/mnt/models/model-store"
    assert props["enable_metrics_api"] == "true" and props["metrics_address"].endswith(":8082")
    assert props["job_queue_size"] == "64" and props["max_request_size"] == "131072"
    snap = json.loads(props["model_snapshot"])
    entry = snap["models"]["tiny"]["2.5"]        # version key = the .mar manifest's modelVersion
    assert entry["marName"] == "tiny.mar" and entry["defaultVersion"] is True
    assert {k2: entry[k2] for k2 in ("batchSize", "maxBatchDelay", "minWorkers", "maxWorkers", "responseTimeout",
                                     "startupTimeout")} == {"batchSize": 4, "maxBatchDelay": 7, "minWorkers": 1,
                                                            "maxWorkers": 1, "responseTimeout": 11,
                                                            "startupTimeout": 33}

    isvc = yaml.safe_load((k / "inferenceservice.yaml").read_text())
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    model = isvc["spec"]["predictor"]["model"]
    assert model["modelFormat"]["name"] == "pytorch" and model["storageUri"] == "s3://acme-models/tiny/v3"
    # Resources from the measurements: the served peak per worker (serve_check) × 1 worker + the JVM, × 1.2.
    assert model["resources"]["requests"] == {"cpu": "2", "memory": f"{math.ceil((410.0 + 320) * 1.2)}Mi"}
    assert model["resources"]["limits"] == {"cpu": "2", "memory": f"{math.ceil(math.ceil((410.0 + 320) * 1.2) * 1.5)}Mi"}
    # The startup budget is the derived startupTimeout (33 s → 7 × 5 s); readiness asks for a READY worker.
    assert model["startupProbe"]["periodSeconds"] * model["startupProbe"]["failureThreshold"] == 35
    assert "/models/tiny" in model["readinessProbe"]["exec"]["command"][-1]
    assert "READY" in model["readinessProbe"]["exec"]["command"][-1]
    text = (k / "inferenceservice.yaml").read_text()
    assert "ceil((410 MiB × 1 + 320 MiB) × 1.2)" in text and "worker_peak_rss_mb" in text
    derived = json.loads((k / "resources.json").read_text())
    assert derived["memory_request"]["inputs"]["peak_rss_per_worker_mb"] == 410.0
    assert "stages.kserve" in r.stderr and str(k) in r.stderr
    assert "serve.overrides.batch_size: 1" in r.stderr     # batchSize 4 under the v1 envelope: warned


def test_manifest_resources_follow_the_measurements():
    """Two measured peaks give two memory requests; CPU is workers × threads; without the serve check the
    benchmark's peak (derivation.json) is used; with no measurement no memory is set and it says so."""
    from pipeline.publish.kserve import inferenceservice_manifest
    from pipeline.publish.kserve_resources import derive
    mc = {**MODEL_CONFIG, "minWorkers": 3, "maxWorkers": 3, "handler": {"threads": 2}, "startupTimeout": 62}
    small, big = (derive("tiny", mc, None, {"worker_peak_rss_mb": mb}) for mb in (200.0, 1800.0))
    assert small["memory_request"]["mib"] == math.ceil((200 * 3 + 320) * 1.2) == 1104
    assert big["memory_request"]["mib"] == math.ceil((1800 * 3 + 320) * 1.2) == 6864
    assert big["memory_limit"]["mib"] == math.ceil(6864 * 1.5)
    assert small["cpu"]["value"] == big["cpu"]["value"] == "6"
    assert small["startup_budget_s"]["value"] == 65 and small["startupProbe"]["failureThreshold"] == 13
    manifests = [yaml.safe_load(inferenceservice_manifest("tiny", "s3://b/t", serving_values(mc), derived=d))
                 for d in (small, big)]
    requests = [m["spec"]["predictor"]["model"]["resources"]["requests"]["memory"] for m in manifests]
    assert requests == ["1104Mi", "6864Mi"]
    bench = derive("tiny", mc, {"workers": {"value": 3, "inputs": {"peak_rss_mb": 500.0}}}, None)
    assert bench["memory_request"]["mib"] == math.ceil((500 * 3 + 320) * 1.2)
    assert "derivation.json" in bench["memory_request"]["inputs"]["peak_source"]
    none = derive("tiny", mc, None, None)
    assert none["memory_request"] is None
    m = inferenceservice_manifest("tiny", "s3://b/t", serving_values(mc), derived=none)
    assert "memory: NOT SET" in m and "memory" not in yaml.safe_load(m)["spec"]["predictor"]["model"]["resources"]["requests"]


SLOW_HANDLER = '''
import json, time
_loaded = False


def handle(data, context):
    global _loaded
    if not _loaded:             # a slow model load: the worker is not READY for 8 s
        time.sleep(8)
        _loaded = True
    if data is None:
        return None
    return [json.dumps({"ok": 1}) for _ in data]
'''


@pytest.mark.torchserve
def test_readiness_probe_waits_for_a_ready_worker_where_ping_does_not(tmp_path):
    """TorchServe's /ping says Healthy while the worker is still loading; the manifest's probe command
    fails until GET /models/<name> lists a READY worker, then passes."""
    import time
    import urllib.request
    from pipeline.publish.kserve_resources import ready_check
    from pipeline.serve.mar import package

    (tmp_path / "slow.py").write_text(SLOW_HANDLER)
    mar = package("slow", tmp_path / "slow.py", {}, tmp_path / "store")
    port, metrics, g1, g2 = (free_port() for _ in range(4))
    (tmp_path / "c.properties").write_text(
        f"inference_address=http://127.0.0.1:{port}\nmanagement_address=http://127.0.0.1:{port}\n"
        f"metrics_address=http://127.0.0.1:{metrics}\ngrpc_inference_port={g1}\ngrpc_management_port={g2}\n"
        "disable_token_authorization=true\nenable_model_api=false\ndefault_workers_per_model=1\n"
        f"load_models=slow={mar.name}\n")
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TEMP": str(tmp_path / "tmp"), "TMPDIR": str(tmp_path / "tmp"),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run([str(BIN / "torchserve"), "--start", "--ncs", "--ts-config", str(tmp_path / "c.properties"),
                    "--model-store", str(mar.parent)], cwd=tmp_path, env=env, check=True, timeout=60)
    seen = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            time.sleep(1.0)
            try:
                ping = urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2).status
            except OSError:
                continue                  # the frontend not listening yet
            rc = subprocess.run(ready_check("slow", port), capture_output=True, timeout=10).returncode
            seen.append((ping, rc))
            if rc == 0:
                break
    finally:
        subprocess.run([str(BIN / "torchserve"), "--stop"], cwd=tmp_path, env=env, timeout=60)
    assert seen and seen[-1] == (200, 0), seen
    assert (200, 1) in seen, seen          # Healthy, not READY: /ping would have let traffic in


def test_no_envelope_warning_at_batch_size_one():
    from pipeline.publish.kserve import envelope_warnings
    assert envelope_warnings(serving_values({**MODEL_CONFIG, "batchSize": 1}, None)) == []


def test_kserve_stage_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "model": {"name": "tiny", "source": "torchscript", "checkpoint": "m.pt", "task": "tensor", "input_shape": [4]}}))
    make_mar(tmp_path / "artifacts" / "model_store" / "tiny.mar")
    r = subprocess.run([sys.executable, "-m", "stages.kserve", "--root", str(tmp_path)], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "model-config.yaml" in r.stderr and "dvc repro configure" in r.stderr


def test_serving_values_name_missing_keys():
    from pipeline.publish.kserve import KServeError
    with pytest.raises(KServeError, match="batchSize.*startupTimeout"):
        serving_values({"maxBatchDelay": 5, "minWorkers": 1, "maxWorkers": 1, "responseTimeout": 3,
                        "startupTimeout": "300"})   # quoted: TorchServe would ignore it


TINY_HANDLER = '''
import json


def handle(data, context):
    if data is None:            # TorchServe's load-time call of a function handler
        return None
    return [json.dumps({"batch": len(data)}) for _ in data]
'''


@pytest.mark.torchserve
def test_torchserve_loads_the_model_from_the_kserve_snapshot(tmp_path):
    """No --models / load_models: the model comes up only because of model_snapshot, with its values."""
    from pipeline.serve.mar import package
    from pipeline.serve.server.torchserve import TorchServe

    handler = tmp_path / "tiny_handler.py"
    handler.write_text(TINY_HANDLER)
    # No model-config.yaml in this .mar, so every value described below comes from the snapshot.
    mar = package("tiny", handler, {}, tmp_path / "store")
    layout = build_layout("tiny", mar, MODEL_CONFIG, DERIVATION, tmp_path / "kserve")
    with TorchServe(layout.config_properties, layout.mar.parent, "tiny", workdir=tmp_path / "ts",
                    ready_timeout_s=120) as ts:
        d = ts.api.describe_model()
        assert (d["batchSize"], d["maxBatchDelay"], d["minWorkers"], d["maxWorkers"]) == (4, 7, 1, 1)
        assert d["responseTimeout"] == 11
        r = ts.api.predict(b'{"x": 1}', "application/json")
        assert r.status == 200 and r.json() == {"batch": 1}


def test_properties_text_is_one_line_per_key_and_windows_safe():
    values = serving_values(MODEL_CONFIG, DERIVATION)
    text = kserve_config_properties("m", "1.0", values)
    assert "\\" not in text
    assert json.loads(naive_properties(text)["model_snapshot"]) == model_snapshot("m", "1.0", values)
    from pipeline.publish.kserve import KServeError
    with pytest.raises(KServeError, match="forward slashes"):
        kserve_config_properties("m", "1.0", values, model_store="C:\\models")
