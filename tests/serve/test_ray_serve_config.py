"""The Ray Serve configuration (pipeline/serve/server/ray_serve_config.py) from the derived TorchServe settings: each
knob mapped, the file accepted by Ray Serve's own schema (what `serve run` / `serve deploy` validate), the
model folder named relative to the repository so the config works in any checkout, and the RayService's
inline config the same application."""
from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.core.params import REPO_ROOT, parse_params
from pipeline.serve.server.ray_serve_config import RAYSERVICE, SERVE_CONFIG, model_dir_arg, ray_settings, write_ray_serve

MODEL_CONFIG = {"minWorkers": 2, "maxWorkers": 2, "batchSize": 8, "maxBatchDelay": 12, "responseTimeout": 5,
                "jobQueueSize": 32, "deviceType": "cpu", "handler": {"threads": 1, "device": "cpu"}}


def test_torchserve_settings_map_to_ray_serve_knobs():
    s = ray_settings(MODEL_CONFIG, expected_concurrency=16)
    assert s == {"num_replicas": 2, "max_batch_size": 8, "batch_wait_timeout_s": 0.012, "max_ongoing_requests": 16,
                 "max_queued_requests": 32, "num_cpus": 1, "num_gpus": 0, "threads": 1, "request_timeout_s": 5}
    gpu = ray_settings({**MODEL_CONFIG, "deviceType": "gpu", "minWorkers": 1}, expected_concurrency=64)
    assert gpu["num_gpus"] == 1 and gpu["max_ongoing_requests"] == 64


def test_written_config_passes_ray_serves_schema(tmp_path):
    from ray.serve.schema import ServeDeploySchema
    folder = REPO_ROOT / "artifacts" / "model_store" / "some-model"
    store = tmp_path / "store"
    store.mkdir()
    (store / "model-config.yaml").write_text(yaml.safe_dump(MODEL_CONFIG))
    (store / "variant.json").write_text('{"variant": "bf16"}')
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "bf16.json").write_text('{"peak_rss_mb": 300.0}')
    params = parse_params({"model": {"name": "m", "source": "hf", "checkpoint": "x", "task": "text-embedding"}})
    write_ray_serve(params, store, tmp_path / "out", benchmarks_dir=bench)
    config = yaml.safe_load((tmp_path / "out" / SERVE_CONFIG).read_text())
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    assert app.import_path == "handlers.ray_app:build" and app.args["model_name"] == "m"
    assert config["http_options"]["host"] == params.serve.bind_address
    deployment = config["applications"][0]["deployments"][0]
    assert deployment["num_replicas"] == 2 and deployment["user_config"]["max_batch_size"] == 8
    service = yaml.safe_load((tmp_path / "out" / RAYSERVICE).read_text())
    inline = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    assert inline.applications[0].import_path == app.import_path and inline.http_options.host == "0.0.0.0"
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["resources"]["requests"] == {"cpu": "3", "memory": f"{int(2 * 300 * 1.5 + 1024)}Mi"}
    assert model_dir_arg(folder) == "artifacts/model_store/some-model"
    assert model_dir_arg(Path("/elsewhere/m")) == "/elsewhere/m"


def test_ray_app_resolves_the_relative_model_folder_in_the_repository():
    import pytest
    from handlers.ray_app import model_folder
    from handlers.serving import HandlerSetupError
    with pytest.raises(HandlerSetupError, match=r"artifacts/model_store/no-such-model.*dvc repro"):
        model_folder("artifacts/model_store/no-such-model")


def test_replica_logs_are_read_once_through_ray_s_session_layout(tmp_path):
    """Ray links session_latest to the session's folder: the replicas' lines (READY, batches) count once."""
    from pipeline.serve.server.ray_server import RayServeLogs
    serve_dir = tmp_path / "ray" / "session_2026-12-07_11-00-00_000000_1" / "logs" / "serve"
    serve_dir.mkdir(parents=True)
    (tmp_path / "ray" / "session_latest").symlink_to(serve_dir.parents[1])
    a = "0f0e8a52-1111-4d3c-9c39-0a4f5e6b7c8d"
    b = "0f0e8a52-2222-4d3c-9c39-0a4f5e6b7c8d"
    (serve_dir / "replica_m_model_x.log").write_text(
        "INFO [replica] pid=101 ready\nINFO [batch] size=2 ids=%s,%s\nINFO [batch] size=1 ids=%s\n" % (a, b, a))
    (serve_dir / "replica_m_model_y.log").write_text("INFO [replica] pid=102 ready\nINFO [replica] pid=102 ready\n")
    logs = RayServeLogs(tmp_path, "m")
    assert len(logs.replica_logs()) == 2 and logs.replica_pids() == [101, 102]
    assert sorted(len(x) for x in logs.batches()) == [1, 2]
    assert logs.batch_sizes_for([a, b], wait_s=0) == {2: 1, 1: 1}
    # Lines appended later are read (only the new bytes); a log rewritten shorter is read afresh.
    with (serve_dir / "replica_m_model_x.log").open("a") as f:
        f.write("INFO [batch] size=1 ids=%s\n" % b)
    assert sorted(len(x) for x in logs.batches()) == [1, 1, 2]
    (serve_dir / "replica_m_model_x.log").write_text("INFO [replica] pid=103 ready\n")
    assert logs.replica_pids() == [103, 102] and logs.batches() == []
