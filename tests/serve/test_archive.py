"""The archive stage: reproducible .mar with provenance, loadable by TorchServe's own model loader
(and by a real TorchServe), plus the naive baseline archive (its recipe, packed as serve_check packs it).

Stage inputs are built here from the committed tensor example (examples/tensor) and the tiny text
model of conftest: a TorchScript winner, an eager variant record, selection/config/env records."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.serve.archive import TASK_FILES, ArchiveError, build_archive
from pipeline.serve.mar import archive_contents, archive_digests, sha256_file
from pipeline.serve.reference.reference_archives import build_reference, write_baseline
from pipeline.model.checkpoint import load_model
from pipeline.core.params import checkpoint_path

MODEL_CONFIG = textwrap.dedent("""\
    minWorkers: 1
    maxWorkers: 1
    batchSize: 4
    maxBatchDelay: 5
    responseTimeout: 30
    startupTimeout: 60
    handler:
      threads: 1
      device: cpu
      warmup_batch_size: 4
      max_request_bytes: 200000
""")


def build_stage_inputs(root: Path, params, winner_format: str = "torchscript") -> dict:
    """artifacts/ as the earlier stages leave it, for `params` (tiny models only)."""
    loaded = load_model(params)
    variants = root / "variants"
    task = loaded.task
    example = tuple(torch.zeros(2, *s) for s in [params.model.input_shape]) if task["kind"] == "tensor" else \
        (torch.ones(2, 5, dtype=torch.int64), torch.ones(2, 5, dtype=torch.int64))
    for name in ("eager", "torchscript"):
        folder = variants / name
        folder.mkdir(parents=True)
        files = ["variant.json"]
        for dst, src in loaded.extra_files.items():
            (folder / dst).write_bytes(Path(src).read_bytes())
            files.append(dst)
        artifact = "model.pt"
        with torch.no_grad():
            torch.jit.save(torch.jit.trace(loaded.module, example, check_trace=False), str(folder / artifact))
        files.append(artifact)
        variant = {"variant": name, "family": "torch", "format": "torchscript", "artifact": artifact,
                   "dtype": "float32", "device": "cpu", "task": task, "files": files,
                   "inputs": [{"name": i.name, "dtype": i.dtype} for i in loaded.inputs],
                   "outputs": [{"name": o} for o in loaded.outputs]}
        (folder / "variant.json").write_text(json.dumps(variant, indent=2))
        (folder / "conversion.json").write_text(json.dumps({
            "variant": name, "status": "converted", "reason": None, "conversion_s": 0.1,
            "artifact_bytes": (folder / artifact).stat().st_size, "dtype": "float32",
            "tolerance": {"atol": 1e-4, "rtol": 1e-3, "min_cosine": 0.99999},
            "verification": {"batch_sizes": [1, 4], "outputs": [{"name": loaded.outputs[0], "max_abs": 1e-7}]}}))
    serve = root / "serve"
    serve.mkdir()
    (serve / "model-config.yaml").write_text(MODEL_CONFIG)
    (serve / "derivation.json").write_text(json.dumps({"batchSize": {"value": 4, "formula": "test", "inputs": {},
                                                                     "overridden": False}}))
    (root / "selection.json").write_text(json.dumps({"winner": "torchscript", "objective": "throughput",
                                                     "slo_met": True, "message": "test", "variants": {}}))
    (root / "env.json").write_text(json.dumps({"device": "cpu", "cpu": {"model": "test"}}))
    return dict(selection_path=root / "selection.json", variants_dir=variants, serve_dir=serve,
                env_path=root / "env.json")


def unpack(mar: Path, dest: Path) -> Path:
    with zipfile.ZipFile(mar) as z:
        z.extractall(dest)
    return dest


LOAD_AND_PREDICT = textwrap.dedent("""
    # Runs in the unpacked model dir, repo NOT on sys.path: TorchServe's own loader + one batch.
    import json, os, sys
    sys.path.insert(0, os.getcwd())
    from ts.model_loader import TsModelLoader
    from ts.service import Service
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
    import ts
    manifest = json.load(open("MAR-INF/MANIFEST.json"))
    metrics = MetricsCacheYamlImpl(os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml"))
    metrics.initialize_cache()
    service = TsModelLoader().load(manifest["model"]["modelName"], os.getcwd(), manifest["model"]["handler"],
                                   None, 4, metrics_cache=metrics)
    requests = json.loads(sys.argv[1])
    def wire(b, ct):   # as ts/protocol/otf_message_handler.py: JSON decoded, else the raw bytes
        if ct == "application/json":
            try:
                return json.loads(b)
            except ValueError:
                return b.encode()
        return b if ct.startswith("text") else b.encode()
    batch = [{"requestId": f"r{i}".encode(), "headers": [],
              "parameters": [{"name": "body", "contentType": ct,
                              "value": wire(b, ct)}]}
             for i, (b, ct) in enumerate(requests)]
    headers, inputs, ids = Service.retrieve_data_for_inference(batch)
    service.context.request_processor, service.context.request_ids = headers, ids
    metrics.request_ids = ids
    out = service._entry_point(inputs, service.context)
    out = [json.loads(o) if isinstance(o, (bytes, bytearray)) else o for o in out]   # as the client reads them
    status = [service.context.get_response_status(i)[0] for i in range(len(out))]
    print("RESULT" + json.dumps({"status": status, "out": out,
                                 "pipeline_imported": any(m == "pipeline" or m.startswith("pipeline.") for m in sys.modules)}))
""")


def load_and_predict(model_dir: Path, requests: list[tuple[str, str]]) -> dict:
    res = subprocess.run([sys.executable, "-c", LOAD_AND_PREDICT, json.dumps(requests)], cwd=model_dir,
                         capture_output=True, text=True, timeout=180, env={"PATH": "/usr/bin:/bin",
                                                                          "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = [l for l in res.stdout.splitlines() if l.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def tensor_request(params, seed: int = 0) -> tuple[str, np.ndarray]:
    x = np.round(np.random.default_rng(seed).standard_normal(params.model.input_shape), 4).astype(np.float32)
    return json.dumps(x.tolist()), x


@pytest.fixture
def tensor_build(tmp_path, tensor_params):
    inputs = build_stage_inputs(tmp_path / "artifacts", tensor_params)
    return tensor_params, inputs


def test_archive_reproducible_and_provenance(tmp_path, tensor_build):
    params, inputs = tensor_build
    first = build_archive(params, export_dir=tmp_path / "store1", **inputs)
    second = build_archive(params, export_dir=tmp_path / "store2", **inputs)
    assert first.path.name == "signalnet.mar" and second.path.name == "signalnet.mar"
    # Same contents apart from MANIFEST createdOn (archive_digests blanks only that field).
    assert archive_digests(first.path) == archive_digests(second.path)
    manifests = [json.loads(archive_contents(p)["MAR-INF/MANIFEST.json"]) for p in (first.path, second.path)]
    assert manifests[0]["model"] == manifests[1]["model"]
    assert manifests[0]["model"]["handler"] == "torch_handler.py"
    assert manifests[0]["model"]["serializedFile"] == "model.pt"
    assert manifests[0]["model"]["configFile"] == "model-config.yaml"
    # zip-store: nothing compressed, so big weights unpack fast.
    with zipfile.ZipFile(first.path) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}

    contents = archive_contents(first.path)
    expected_names = {"variant.json", "model.pt", "torch_handler.py", "model-config.yaml", "provenance.json",
                      "handlers/__init__.py", "handlers/serving.py", "handlers/tasks/__init__.py", "handlers/encode.py",
                      "handlers/profile.py", "handlers/runtimes/__init__.py", "handlers/runtimes/torch_family.py",
                      "handlers/runtimes/onnx_family.py", "MAR-INF/MANIFEST.json"} | \
        {f"handlers/{f}" for f in TASK_FILES}       # handlers.tasks loads them on first use
    assert set(contents) == expected_names
    prov = json.loads(contents["provenance.json"])
    # sha256 of every other file in the archive, checked against the bytes actually packed.
    assert set(prov["files"]) == expected_names - {"provenance.json", "MAR-INF/MANIFEST.json"}
    for name, digest in prov["files"].items():
        assert hashlib.sha256(contents[name]).hexdigest() == digest, name
    assert prov["source"]["sha256"] == sha256_file(checkpoint_path(params))
    assert prov["variant"] == "torchscript" and prov["family"] == "torch"
    assert prov["verification"]["status"] == "converted" and prov["verification"]["tolerance"]["atol"] == 1e-4
    assert prov["selection"]["winner"] == "torchscript"
    assert prov["environment"]["device"] == "cpu"
    assert prov["derivation"]["batchSize"]["value"] == 4
    assert len(prov["git"]["revision"]) == 40 and isinstance(prov["git"]["dirty"], bool)


def test_archive_loads_in_torchserve_loader_and_matches_baseline(tmp_path, tensor_build):
    """The .mar is self-contained (no pipeline/, no repo on sys.path): TorchServe's own model loader
    initialises the packed handler with the packed model-config.yaml; a mixed batch is answered;
    the baseline .mar (factory + state_dict, BaseHandler) gives the same numbers."""
    params, inputs = tensor_build
    mar = build_archive(params, export_dir=tmp_path / "store", **inputs).path
    body, x = tensor_request(params)
    requests = [(body, "application/json"), ("[[1, 2]]", "application/json"), ("{oops", "application/json")]
    got = load_and_predict(unpack(mar, tmp_path / "opt"), requests)
    assert got["status"] == [200, 400, 400] and not got["pipeline_imported"]
    loaded = load_model(params)
    with torch.no_grad():
        want = loaded.module(torch.from_numpy(x)[None])[0].numpy()
    np.testing.assert_allclose(got["out"][0], want, atol=1e-5)

    write_baseline(params, variants_dir=inputs["variants_dir"], baseline_dir=tmp_path / "baseline")
    assert not list((tmp_path / "baseline").rglob("*.mar"))
    base = build_reference(tmp_path / "baseline", tmp_path / "scratch", "signalnet")
    assert base.mar == tmp_path / "scratch" / "signalnet.mar"
    props = base.config.read_text()
    assert "load_models=signalnet=signalnet.mar" in props and f"model_store={(tmp_path / 'scratch').as_posix()}" in props
    names = set(archive_contents(base.mar))
    assert {"baseline_handler.py", "baseline.json", "weights.safetensors", "model.py", "handlers/tasks/__init__.py",
            "handlers/encode.py", "handlers/tasks/tensor.py"} <= names
    assert "model-config.yaml" not in names
    got_base = load_and_predict(unpack(base.mar, tmp_path / "base"), requests)
    assert got_base["status"] == [200, 400, 400]
    np.testing.assert_allclose(got_base["out"][0], got["out"][0], atol=1e-5)


def test_an_aoti_archive_carries_its_weights_file_and_maps_it_where_unpacked(tmp_path, tensor_build):
    """A CPU aoti variant's weights live beside its library: the .mar packs both, and the packed
    handler, self-contained, maps them from the unpacked model folder (TorchServe's own loader)."""
    from tests.build.test_variants import convert, tensor_case
    params, inputs = tensor_build
    loaded, golden = tensor_case(load_model(params).module, tuple(params.model.input_shape))
    record = convert("aoti", params, loaded, golden, inputs["variants_dir"] / "aoti")
    assert record["status"] == "converted", record["reason"]
    mar = build_archive(params, export_dir=tmp_path / "store", variant_name="aoti", **inputs).path
    assert {"aoti.so", "aoti.so.weights", "aoti.so.weights.json"} <= set(archive_contents(mar))
    body, x = tensor_request(params)
    got = load_and_predict(unpack(mar, tmp_path / "opt"), [(body, "application/json"), ("{oops", "application/json")])
    assert got["status"] == [200, 400] and not got["pipeline_imported"]
    with torch.no_grad():
        want = loaded.module(torch.from_numpy(x)[None])[0].numpy()
    np.testing.assert_allclose(got["out"][0], want, atol=1e-5)


def test_text_baseline_from_hf_folder(tmp_path, text_params):
    """hf source: AutoModel.from_pretrained on the packed folder + the pooling modules.json defines,
    answered in the optimised handler's format."""
    inputs = build_stage_inputs(tmp_path / "artifacts", text_params)
    write_baseline(text_params, variants_dir=inputs["variants_dir"], baseline_dir=tmp_path / "baseline")
    base = build_reference(tmp_path / "baseline", tmp_path / "scratch")
    names = set(archive_contents(base.mar))
    assert {"config.json", "model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json"} <= names
    mar = build_archive(text_params, export_dir=tmp_path / "store", **inputs).path
    requests = [("the river and the city", "text/plain"), ('{"text": ""}', "application/json")]
    got = load_and_predict(unpack(mar, tmp_path / "opt"), requests)
    got_base = load_and_predict(unpack(base.mar, tmp_path / "base"), requests)
    assert got["status"] == got_base["status"] == [200, 400]
    np.testing.assert_allclose(got_base["out"][0]["embedding"], got["out"][0]["embedding"], atol=1e-5)


def test_archive_refuses_missing_or_unverified_inputs(tmp_path, tensor_build):
    params, inputs = tensor_build
    conv = inputs["variants_dir"] / "torchscript" / "conversion.json"
    record = json.loads(conv.read_text())
    conv.write_text(json.dumps({**record, "status": "rejected"}))
    with pytest.raises(ArchiveError, match="only a converted, verified variant"):
        build_archive(params, export_dir=tmp_path / "s", **inputs)
    conv.write_text(json.dumps(record))
    (inputs["variants_dir"] / "torchscript" / "model.pt").unlink()
    with pytest.raises(ArchiveError, match="model.pt"):
        build_archive(params, export_dir=tmp_path / "s", **inputs)
    (inputs["serve_dir"] / "model-config.yaml").unlink()
    with pytest.raises(ArchiveError, match="model-config.yaml|model.pt"):
        build_archive(params, export_dir=tmp_path / "s", **inputs)


@pytest.mark.torchserve
def test_real_torchserve_serves_the_tensor_archive(tmp_path, tensor_build):
    from pipeline.serve.server.torchserve import TorchServe
    params, inputs = tensor_build
    store = tmp_path / "store"
    build_archive(params, export_dir=store, **inputs)
    body, x = tensor_request(params, seed=3)
    loaded = load_model(params)
    with torch.no_grad():
        want = loaded.module(torch.from_numpy(x)[None])[0].numpy()
    t0 = time.monotonic()
    with TorchServe(None, store, "signalnet", models="signalnet=signalnet.mar",
                    workdir=tmp_path / "ts") as server:
        start_wall_s = time.monotonic() - t0
        ready = server.readiness
        # After the worker loaded (WorkerLoadTime), within the start as timed from outside.
        assert ready.worker_load_ms is not None
        assert 0 < ready.worker_load_ms / 1000 <= ready.ready_s <= ready.all_ready_s <= start_wall_s
        ok = server.api.predict(body.encode(), "application/json")
        assert ok.status == 200, ok.body[:500]
        np.testing.assert_allclose(ok.json(), want, atol=1e-5)
        bad = server.api.predict(b"[[1, 2]]", "application/json")
        assert bad.status == 400 and "shape" in bad.json()["error"]
        again = server.api.predict(body.encode(), "application/json")     # the worker survived
        assert again.status == 200


def test_linking_copy_overwrites_like_a_copy_and_keeps_a_link_to_the_same_bytes(tmp_path):
    """A folder store packed again into the same place: the staged file already links to the source
    (same bytes: kept), or holds other bytes (replaced, as shutil.copy would)."""
    import os

    from pipeline.serve.mar import _link_or_copy2
    src, out = tmp_path / "tokenizer.json", tmp_path / "store"
    src.write_text("new")
    out.mkdir()
    assert _link_or_copy2(str(src), str(out)) == str(out / "tokenizer.json")
    assert _link_or_copy2(str(src), str(out)) == str(out / "tokenizer.json")      # again: no SameFileError
    assert os.path.samefile(src, out / "tokenizer.json")
    other = tmp_path / "other.json"
    other.write_text("old")
    (out / "tokenizer.json").unlink()
    os.link(other, out / "tokenizer.json")
    _link_or_copy2(str(src), str(out))
    assert (out / "tokenizer.json").read_text() == "new" and other.read_text() == "old"
