"""Outputs stored once (issue 30): the references' .mar files exist only while the references stage
serves them, and the published layouts link the variant's bytes instead of copying them.

On the committed tensor example (examples/tensor): the archive stage's functions write the naive
baseline's and the hand-tuned reference's recipes (their model files named where they lie), the
references stage packs both into its scratch directory and removes it — after a pass, after a
failed serve, after an exception, after a recipe that no longer matches its files — and the folder
form and the KServe layout are hard links to the variant's and the .mar's files. The servers are
stand-ins here (what they are handed is checked); tests/serve/test_serve_check.py and
test_handtuned.py serve the packed references in a real TorchServe."""
from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

import pipeline.serve.reference.reference_archives as ra
from pipeline.decide.store_form import unpack_mar
from pipeline.serve.archive import build_archive
from pipeline.serve.reference.handtuned import build_handtuned
from pipeline.serve.server.torchserve_http import read_properties
from tests.serve.test_archive import build_stage_inputs
from tests.serve.test_handtuned import write_onnx_benchmark
from tests.serve.test_torchserve import DERIVED

NAME = "signalnet"
TENSOR_MODEL = {"name": NAME, "source": "state_dict", "checkpoint": "examples/tensor/weights.safetensors",
                "factory": "examples/tensor/model.py:build", "task": "tensor", "input_shape": [16, 32]}
SMALL = 16 << 10          # store files below 16 KiB with the recipe: the 140 KB weights are named, as a GB model's


@pytest.fixture
def archived(tmp_path, make_params, monkeypatch):
    """artifacts/ after the archive stage (the winner packed and unpacked, both recipes written) and
    the serve_check stage's module paths pointed at it."""
    monkeypatch.setattr(ra, "STORE_MAX_BYTES", SMALL)
    params = make_params(TENSOR_MODEL, variants=["eager", "torchscript", "onnx"],
                         serve_check={"requests": 8, "concurrency": 2, "rounds": 2})
    art = tmp_path / "artifacts"
    inputs = build_stage_inputs(art, params)
    # A stand-in for the converted onnx variant (its bytes, not its format, are what this test is about).
    onnx = inputs["variants_dir"] / "onnx"
    shutil.copytree(inputs["variants_dir"] / "torchscript", onnx)
    record = json.loads((onnx / "variant.json").read_text())
    (onnx / "variant.json").write_text(json.dumps({**record, "variant": "onnx"}))
    configured = tmp_path / "configured"            # the figures the hand-tuned reference keeps
    configured.mkdir()
    (configured / "derivation.json").write_text(json.dumps(DERIVED))
    store = art / "model_store"
    result = build_archive(params, export_dir=store, **inputs)
    unpack_mar(result.path, store / NAME, sources=result.sources)
    ra.write_baseline(params, variants_dir=inputs["variants_dir"], baseline_dir=art / "baseline")
    assert build_handtuned(params, out_dir=art / "handtuned", derivation_dir=configured,
                           benchmarks_dir=write_onnx_benchmark(tmp_path / "metrics" / "benchmark"),
                           **{k: inputs[k] for k in ("selection_path", "variants_dir", "env_path")}) is not None
    (art / "golden").mkdir()
    (art / "golden" / "http_cases.json").write_text(json.dumps(
        [{"id": "c0", "content_type": "application/json", "body": "[1]", "expected": [1]}]))
    (inputs["serve_dir"] / "config.properties").write_text("default_workers_per_model=1\n")
    import stages.references as refs_stage
    import stages.serve_check as stage
    params_file = tmp_path / "params.yaml"
    params_file.write_text(json.dumps({"model": TENSOR_MODEL, "variants": ["eager", "torchscript", "onnx"],
                                       "serve_check": {"requests": 8, "concurrency": 2, "rounds": 2}}))
    monkeypatch.setenv("PIPELINE_PARAMS", str(params_file))
    for attr, value in (("MODEL_STORE", store), ("SERVE_DIR", inputs["serve_dir"]), ("GOLDEN_DIR", art / "golden"),
                        ("REFERENCES_JSON", tmp_path / "references.json"),
                        ("SERVE_CHECK_JSON", tmp_path / "serve_check.json")):
        monkeypatch.setattr(stage, attr, value)
    for attr, value in (("GOLDEN_DIR", art / "golden"), ("BASELINE_DIR", art / "baseline"),
                        ("HANDTUNED_DIR", art / "handtuned"), ("REFERENCES_JSON", tmp_path / "references.json"),
                        ("SCRATCH_DIR", tmp_path / ".scratch")):
        monkeypatch.setattr(refs_stage, attr, value)
    return refs_stage, art, inputs, tmp_path / ".scratch"


class StandIns:
    """The references stage's servers replaced: what each would start is recorded, and checked to be
    a real, complete archive in the scratch directory at that moment."""

    def __init__(self, monkeypatch, stage, outcome="pass"):
        self.specs, self.outcome, self.scratch = {}, outcome, stage.SCRATCH_DIR
        monkeypatch.setattr(stage, "measure_references", self.measure)

    def measure(self, specs, cases, **kw):
        self.specs = {name: self._check(spec) for name, spec in specs.items()}
        if self.outcome == "raise":
            raise RuntimeError("the server died")
        ok = self.outcome == "pass"
        rounds = [{"round": 1, "ok": ok, "ready_s": 2.0, "throughput_rps": 100.0 if ok else None, "p99_ms": 10.0}]
        return {"measured_at": "2026-12-07T00:00:00+00:00", "seconds": 1.0,
                "setups": {n: {"rounds": rounds} for n in specs}, "rounds_served": {n: 1 for n in specs},
                "baseline_detail": {"ready": ok, "ready_s": 2.0, "load": {"requests_ok": 8}}}

    @staticmethod
    def _check(spec) -> dict:
        """`spec`: the ServerSpec the stage starts from a packed reference."""
        store = spec.model_store
        mar = store / f"{NAME}.mar"
        with zipfile.ZipFile(mar) as z:
            names = set(z.namelist())
        props = read_properties(spec.config)
        assert props["model_store"] == store.resolve().as_posix() and props["load_models"] == f"{NAME}={NAME}.mar"
        return {"store": store, "names": names, "bytes": mar.stat().st_size}


def reference_files(art: Path) -> list[Path]:
    return [p for d in ("baseline", "handtuned") for p in (art / d).rglob("*") if p.is_file()]


def test_the_recipes_name_the_model_files_and_hold_no_archive(archived):
    _, art, inputs, _ = archived
    for folder, model_file in (("baseline", "weights.safetensors"), ("handtuned", "model.pt")):
        recipe = json.loads((art / folder / ra.RECIPE).read_text())
        entry = recipe["files"][model_file]
        assert "path" in entry and "stored" not in entry
        src = ra._resolve(entry["path"])
        assert src.is_file() and entry["bytes"] == src.stat().st_size and len(entry["sha256"]) == 64
        # Small generated files and the serving code travel with the recipe.
        assert all("stored" in e for n, e in recipe["files"].items() if n.startswith("handlers/"))
    baseline = json.loads((art / "baseline" / ra.RECIPE).read_text())
    assert baseline["files"]["weights.safetensors"]["path"] == "examples/tensor/weights.safetensors"   # in the repo
    assert not list(art.glob("baseline/**/*.mar")) + list(art.glob("handtuned/**/*.mar"))
    big = [p for p in reference_files(art) if p.stat().st_size >= SMALL]
    assert all("handlers" in p.parts or p.name.endswith("_handler.py") for p in big), big    # only code
    assert "model_store" not in read_properties(art / "handtuned" / "config.properties")


def test_the_references_stage_packs_them_in_scratch_and_leaves_no_reference_bytes(archived, monkeypatch):
    stage, art, inputs, scratch = archived
    before = sorted((p, p.stat().st_size) for p in reference_files(art))
    stand_ins = StandIns(monkeypatch, stage)
    assert stage.main([]) == 0
    base, hand = stand_ins.specs["baseline"], stand_ins.specs["handtuned"]
    # Each was a complete archive in its own store under the scratch directory while it was served ...
    assert {"baseline_handler.py", "baseline.json", "weights.safetensors", "model.py", "handlers/tasks/__init__.py"} <= base["names"]
    assert {"torch_handler.py", "model.pt", "model-config.yaml", "provenance.json", "MAR-INF/MANIFEST.json"} <= hand["names"]
    assert scratch in base["store"].parents and scratch in hand["store"].parents
    # ... and nothing of them is left: not the scratch dir, not a byte more in artifacts/.
    assert not scratch.exists()
    assert sorted((p, p.stat().st_size) for p in reference_files(art)) == before
    assert [p.relative_to(art) for p in art.rglob("*.mar")] == [Path("model_store", f"{NAME}.mar")]
    record = json.loads(stage.REFERENCES_JSON.read_text())
    assert record["reference_archives"]["removed"] is True
    assert record["reference_archives"]["baseline"]["mar_bytes"] == base["bytes"]
    assert record["reference_archives"]["handtuned"]["mar_bytes"] == hand["bytes"]
    # What serve_check needs to judge whether the record is still the one for its run.
    assert record["model"] == NAME and record["concurrency"] == 2 and record["handtuned_setup"]["available"]


@pytest.mark.parametrize("outcome", ["fail", "raise"])
def test_the_scratch_dir_is_removed_when_serving_fails(archived, monkeypatch, outcome):
    stage, art, _, scratch = archived
    stand_ins = StandIns(monkeypatch, stage, outcome)
    if outcome == "raise":
        with pytest.raises(RuntimeError, match="the server died"):
            stage.main([])
    else:
        assert stage.main([]) == 0                      # a reference that failed is recorded, not fatal
        rounds = json.loads(stage.REFERENCES_JSON.read_text())["setups"]["baseline"]["rounds"]
        assert rounds[0]["ok"] is False
    assert stand_ins.specs["baseline"]["bytes"] > 0        # it was built, then served
    assert not scratch.exists() and not list(art.glob("baseline/**/*.mar"))


def test_a_recipe_whose_files_changed_is_refused_and_its_scratch_removed(archived, monkeypatch, tmp_path):
    stage, art, inputs, scratch = archived
    recipe = json.loads((art / "handtuned" / ra.RECIPE).read_text())
    model = ra._resolve(recipe["files"]["model.pt"]["path"])
    model.write_bytes(model.read_bytes() + b"\0")           # not what the archive stage named
    StandIns(monkeypatch, stage)
    assert stage.main([]) == 2
    assert not scratch.exists()


def test_a_scratch_dir_left_by_a_killed_run_is_removed_by_the_next(tmp_path):
    parent = tmp_path / ".scratch"
    dead = parent / f"{ra.SCRATCH_PREFIX}{2 ** 22 + 12345}-x"      # above the default pid_max: no such process
    dead.mkdir(parents=True)
    (dead / "old.mar").write_bytes(b"x" * 100)
    mine = parent / f"{ra.SCRATCH_PREFIX}{os.getpid()}-other"     # a live process's is left alone
    mine.mkdir()
    with ra.scratch_dir(parent) as path:
        assert path.is_dir() and not dead.exists() and mine.exists()
    assert not path.exists() and mine.exists()


def test_the_folder_form_links_the_variant_and_never_the_repo_code(archived):
    """(c) A hard-linked file is its source's inode (st_nlink > 1); the serving code packed from the
    repo's handlers/ is a copy (DVC makes cached files read-only: a link would make the repo's own
    source read-only too)."""
    _, art, inputs, _ = archived
    folder = art / "model_store" / NAME
    for name in ("model.pt", "variant.json"):
        linked, src = (folder / name).stat(), (inputs["variants_dir"] / "torchscript" / name).stat()
        assert linked.st_ino == src.st_ino and linked.st_dev == src.st_dev and linked.st_nlink > 1
    from pipeline.serve.archive import HANDLERS_DIR
    code = folder / "handlers" / "runtimes" / "__init__.py"
    assert code.stat().st_nlink == 1 and code.stat().st_ino != (HANDLERS_DIR / "runtimes" / "__init__.py").stat().st_ino
    # The folder is still the .mar unpacked, byte for byte.
    with zipfile.ZipFile(art / "model_store" / f"{NAME}.mar") as z:
        for info in z.infolist():
            if not info.is_dir():
                assert (folder / info.filename).read_bytes() == z.read(info), info.filename


def test_unpack_copies_what_differs_from_its_source(tmp_path, archived):
    _, art, inputs, _ = archived
    other = tmp_path / "other.pt"
    other.write_bytes(b"not the packed bytes")
    folder = unpack_mar(art / "model_store" / f"{NAME}.mar", tmp_path / "f", sources={"model.pt": other})
    assert (folder / "model.pt").stat().st_nlink == 1
    assert (folder / "model.pt").read_bytes() == (inputs["variants_dir"] / "torchscript" / "model.pt").read_bytes()


@pytest.mark.parametrize("form", ["mar", "folder"])
def test_the_kserve_layout_links_the_model_store(archived, tmp_path, form):
    from pipeline.publish.kserve import build_layout
    _, art, inputs, _ = archived
    store = art / "model_store"
    config = {"batchSize": 1, "maxBatchDelay": 5, "minWorkers": 1, "maxWorkers": 1, "responseTimeout": 30,
              "startupTimeout": 60}
    layout = build_layout(NAME, store / f"{NAME}.mar", config, {"store_form": {"value": form}}, tmp_path / "kserve")
    pairs = ([(layout.mar, store / f"{NAME}.mar")] if form == "mar" else
             [(layout.mar / "model.pt", inputs["variants_dir"] / "torchscript" / "model.pt"),
              (layout.mar / "provenance.json", store / NAME / "provenance.json")])
    for linked, src in pairs:
        assert linked.stat().st_ino == src.stat().st_ino and linked.stat().st_nlink > 1


def test_the_floor_is_the_empty_ceiling_s_start_when_it_was_served(archived, monkeypatch):
    """Issue 30: the empty-answer ceiling served beside the winner is a do-nothing model served as the
    model is, after the run's earlier starts: its READY is the server floor, and no do-nothing server
    is started twice more for it. Without it, the floor is measured as before."""
    refs_stage, *_ = archived
    StandIns(monkeypatch, refs_stage)
    assert refs_stage.main([]) == 0                  # metrics/references.json, as serve_check reads it
    import stages.serve_check as stage
    flat = {"ready": True, "ready_s": 2.0, "parity_ok": True, "requests_ok": 8, "requests_sent": 8, "p99_ms": 10.0,
            "throughput_rps": 100.0}
    monkeypatch.setattr(stage, "serve_check", lambda *a, **k: {**flat, "winner": flat, "ok": True, "failures": []})
    started = []
    monkeypatch.setattr(stage, "measure_server_floor", lambda **kw: started.append(kw) or {"ready": True, "ready_s": 9.0})
    rounds = [{"round": 1, "ok": True, "ready_s": 1.8, "worker_load_ms": 1200.0},
              {"round": 2, "ok": True, "ready_s": 1.6, "worker_load_ms": 1100.0}]
    monkeypatch.setattr(stage, "references", lambda *a, **k: {"setups": {stage.CEILING_EMPTY: {"rounds": rounds}}})
    assert stage.main([]) == 0
    record = json.loads(stage.SERVE_CHECK_JSON.read_text())
    assert not started
    assert record["server_floor"] == {"ready": True, "ready_s": 1.6, "worker_load_ms": 1100.0, "workers": 1,
                                      "primed": True, "measured_by": "ceiling_empty"}
    assert record["reference_archives"]["removed"] is True        # the references stage's, carried over
    monkeypatch.setattr(stage, "references", lambda *a, **k: {"setups": {}})
    assert stage.main([]) == 0
    assert len(started) == 1 and json.loads(stage.SERVE_CHECK_JSON.read_text())["server_floor"]["ready_s"] == 9.0


def test_serve_check_refuses_a_references_record_of_another_run(archived, monkeypatch):
    """A record of another model or load is not compared against: serve_check names the stage to run."""
    refs_stage, *_ = archived
    StandIns(monkeypatch, refs_stage)
    assert refs_stage.main([]) == 0
    import stages.serve_check as stage
    path = stage.REFERENCES_JSON
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "concurrency": 64}))
    from pipeline.core.params import load_params
    message = stage.read_references(load_params())
    assert isinstance(message, str) and "'concurrency': 64" in message and "dvc repro references" in message
    path.unlink()
    assert "run the references stage" in stage.read_references(load_params())
