"""The project's real dvc.yaml + params.yaml, run by real DVC with fast stand-in commands: which
stages does an experiment re-run?

Each stage's `cmd` is replaced by `fake_stage.py`, which writes the stage's declared outs with
content that is a deterministic function of its declared deps and params (as a real stage's
output is) and appends the stage's name to ran.log. deps / params / outs stay exactly as the
project declares them, so what re-runs here is what re-runs in the real pipeline.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.params import REPO_ROOT

BIN = Path(sys.executable).parent
ALWAYS = {"probe", "checkpoint"}                                           # always_changed stages
UPSTREAM = ("probe", "prepare", "convert", "benchmark")                   # must survive a serve.* change
# references: re-run here because the faked archive writes new bytes for any change of its params; the real
# one rewrites the references' recipes byte for byte (test_the_references_depend_on_...; docs/results).
SERVE_CHAIN = ("select", "configure", "tune", "archive", "references", "serve_check", "report", "kserve")

FAKE_STAGE = r'''
import hashlib, json, shutil, sys
from pathlib import Path
import yaml

stage, item = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
spec = yaml.safe_load(open("dvc.yaml"))["stages"][stage]
spec = spec.get("do", spec)
params = yaml.safe_load(open("params.yaml"))


def names(entries):
    for e in entries or []:
        if isinstance(e, dict):                       # `- path: {cache: false}` or `- file.yaml: [keys]`
            key, val = next(iter(e.items()))
            if isinstance(val, list):
                yield from (str(v) for v in val)
                continue
            e = key
        yield e.replace("${item}", item) if item else e


h = hashlib.sha256(stage.encode())
for dep in sorted(names(spec.get("deps"))):
    p = Path(dep)
    for f in (sorted(p.rglob("*")) if p.is_dir() else [p]):
        if f.is_file():
            h.update(str(f).encode())
            h.update(f.read_bytes())
for key in names(spec.get("params")):
    value = params
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    h.update(key.encode() + json.dumps(value, sort_keys=True).encode())
record = json.dumps({"stage": stage, "item": item, "digest": h.hexdigest()[:12], "value": int(h.hexdigest()[:6], 16)})
for out in names((spec.get("outs") or []) + (spec.get("metrics") or []) + (spec.get("plots") or [])):
    p = Path(out)
    if p.suffix:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(record)
    else:
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
        (p / "out.json").write_text(record)
with open("ran.log", "a") as f:
    f.write(stage + (f"@{item}" if item else "") + "\n")
'''


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DVC_") and k != "PIPELINE_PARAMS"}
    env.update(PIPELINE_HASH_CACHE=str(Path(os.environ.get("TMPDIR", "/tmp")) / f"graph-hashes-{os.getpid()}"),
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com", DVC_NO_ANALYTICS="1")
    return env


def sh(args: list[str], cwd: Path) -> str:
    r = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _entries(entries, item=None):
    for e in entries or []:
        e = next(iter(e)) if isinstance(e, dict) else e
        yield e.replace("${item}", item) if item else e


def _covered(path: str, outs: set[str]) -> bool:
    """A dep produced by some stage (equal to an out, inside one, or a folder holding outs)."""
    return any(path == o or path.startswith(o + "/") or o.startswith(path + "/") for o in outs)


@pytest.fixture(scope="module")
def graph_repo(tmp_path_factory):
    """A git+DVC repo with the project's dvc.yaml (commands faked) and params.yaml, fully reproduced."""
    repo = tmp_path_factory.mktemp("graph")
    dvc_yaml = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["variants"] = ["eager", "onnx"]          # two are enough to see foreach behave; faster
    params["model"]["checkpoint"] = str(make_checkpoint(checkpoint_of(repo)))

    outs: set[str] = set()
    deps: set[str] = set()
    for name, spec in dvc_yaml["stages"].items():
        body = spec.get("do", spec)
        items = params["variants"] if "foreach" in spec else [None]
        for item in items + (["torchscript"] if "foreach" in spec else []):
            for kind in ("outs", "metrics", "plots"):        # metrics/plots: outputs too (run-cached stages)
                outs.update(_entries(body.get(kind), item))
            deps.update(_entries(body.get("deps"), item))
        body["cmd"] = f"python fake_stage.py {name}" + (" ${item}" if "foreach" in spec else "")
    # The real first stage: it reads the checkpoint's files, which no faked command would
    dvc_yaml["stages"]["checkpoint"]["cmd"] = f"PYTHONPATH={REPO_ROOT} python {REPO_ROOT}/stages/inputs.py checkpoint --root . && echo checkpoint >> ran.log"
    for dep in sorted(deps):
        if _covered(dep, outs):
            continue
        p = repo / dep
        if Path(dep).suffix:                         # code files the stages declare: placeholders
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f"# placeholder for {dep}\n")
        else:
            p.mkdir(parents=True, exist_ok=True)
            (p / "placeholder.py").write_text(f"# placeholder for {dep}\n")

    (repo / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml, sort_keys=False))
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (repo / "fake_stage.py").write_text(FAKE_STAGE)
    (repo / ".gitignore").write_text("ran.log\n")
    sh(["git", "init", "-q"], repo)
    sh([str(BIN / "dvc"), "init", "-q"], repo)
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-q", "-m", "pipeline"], repo)
    sh([str(BIN / "dvc"), "repro"], repo)
    ran = ran_stages(repo)
    for stage in dvc_yaml["stages"]:
        assert any(r.split("@")[0] == stage for r in ran), f"{stage} never ran on the first repro: {ran}"
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-q", "-m", "reproduced"], repo)
    return repo, set(dvc_yaml["stages"])


def checkpoint_of(repo: Path) -> Path:
    return repo.parent / f"{repo.name}-checkpoint"


def make_checkpoint(folder: Path) -> Path:
    """A Hugging Face folder as the file checks see it (config, weights, tokenizer, a pooling module)."""
    (folder / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    (folder / "model.safetensors").write_bytes(b"trained-once" * 4096)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "1_Pooling" / "config.json").write_text("{}")
    return folder


def ran_stages(repo: Path) -> list[str]:
    log = repo / "ran.log"
    ran = log.read_text().split() if log.exists() else []
    log.write_text("")
    return ran


def exp_run(repo: Path, *sets: str) -> set[str]:
    args = [str(BIN / "dvc"), "exp", "run"]
    for s in sets:
        args += ["-S", s]
    ran_stages(repo)
    sh(args, repo)
    return set(ran_stages(repo))


PARAMS_FILES = ["params.yaml"] + sorted(str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.glob("examples/*/params.yaml"))


@pytest.mark.parametrize("params_file", PARAMS_FILES)
def test_every_declared_param_is_in_params_yaml(params_file):
    """DVC refuses to run a stage whose declared params key is absent from params.yaml (defaults in
    pipeline/core/params.py do not count), so every declared key must be written out — in the examples
    too, since the README has users copy one over params.yaml."""
    dvc_yaml = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    params = yaml.safe_load((REPO_ROOT / params_file).read_text())
    missing = []
    for name, spec in dvc_yaml["stages"].items():
        for key in _entries(spec.get("do", spec).get("params")):
            value, ok = params, True
            for part in key.split("."):
                ok = isinstance(value, dict) and part in value
                if not ok:
                    break
                value = value[part]
            if not ok:
                missing.append(f"{name}: {key}")
    assert not missing, f"declared in dvc.yaml but missing from {params_file} (add them with their default): {missing}"


# Modules every stage imports that hold no computation of its outputs: declaring them would re-run
# the whole pipeline for a docstring in params validation or a path constant.
INFRASTRUCTURE = {"pipeline/core/params.py", "pipeline/core/params_typed.py", "pipeline/core/params_checks.py",
                  "pipeline/core/params_schema.py",
                  "pipeline/core/fleet_params.py", "pipeline/core/paths.py", "pipeline/core/stage_record.py",
                  "pipeline/core/disk.py"}


def _imported_files(start: Path) -> set[Path]:
    """The project files a module imports, transitively (function-level imports included)."""
    import ast

    def file_of(module: str):
        for candidate in (REPO_ROOT / (module.replace(".", "/") + ".py"),
                          REPO_ROOT / module.replace(".", "/") / "__init__.py"):
            if candidate.exists():
                return candidate
        return None

    seen, todo = set(), [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if name.split(".")[0] in ("pipeline", "handlers", "stages") and (found := file_of(name)):
                    todo.append(found)
    return seen


def test_every_stage_declares_the_code_it_runs():
    """A change to any module a stage's script imports must re-run that stage: an int8 gate edit that
    left the conversions cached would keep shipping the old verdict."""
    dvc_yaml = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    undeclared = {}
    for name, spec in dvc_yaml["stages"].items():
        body = spec.get("do", spec)
        module = body["cmd"].split("-m ", 1)[1].split()[0]
        deps = [d.rstrip("/") for d in _entries(body.get("deps"))]
        files = _imported_files(REPO_ROOT / (module.replace(".", "/") + ".py"))
        missing = sorted(rel for f in files if (rel := f.relative_to(REPO_ROOT).as_posix()) not in INFRASTRUCTURE
                         and f.name != "__init__.py" and not any(rel == d or rel.startswith(d + "/") for d in deps))
        if missing:
            undeclared[name] = missing
    assert not undeclared, f"stages import code they do not declare as deps in dvc.yaml: {undeclared}"


def test_serve_change_reruns_only_the_serving_chain(graph_repo):
    repo, stages = graph_repo
    ran = exp_run(repo, "serve.latency_slo_ms=50")
    bases = {r.split("@")[0] for r in ran}
    # probe and checkpoint are always_changed by design (their outputs change only with the machine or
    # the checkpoint's bytes); nothing they feed re-ran.
    assert not (bases - ALWAYS) & set(UPSTREAM), f"a serve.* change re-ran upstream stages: {sorted(ran)}"
    expected = set(SERVE_CHAIN) & stages
    assert bases - ALWAYS == expected, f"ran {sorted(ran)}, expected {sorted(expected)}"

    # The experiment is visible in `dvc exp show` with the params and the summary metrics.
    shown = json.loads(sh([str(BIN / "dvc"), "exp", "show", "--json"], repo))
    flat = json.dumps(shown)
    assert '"latency_slo_ms": 50' in flat
    if "report" in stages:
        assert "metrics/summary.json" in flat and '"stage": "report"' in flat


def test_the_references_depend_on_the_host_model_load_and_recipes_only():
    """Issue 41: the hand-tuned setup and the baseline are measured by a stage whose inputs are what
    they depend on: never the winner's outputs or the SLO, so a serve.* experiment reuses them while
    their recipes' bytes hold (the archive stage rewrites the same bytes)."""
    spec = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]["references"]
    deps = set(_entries(spec["deps"]))
    assert {"artifacts/baseline", "artifacts/handtuned", "artifacts/golden", "artifacts/env.json"} <= deps
    assert not deps & {"artifacts/serve", "artifacts/selection.json", "artifacts/model_store", "metrics/tuning.json",
                       "artifacts/configured"}, deps
    assert not [k for k in spec["params"] if k == "serve" or k.startswith("serve.") and k != "serve.expected_concurrency"]
    serve_check = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]["serve_check"]
    assert "metrics/references.json" in set(_entries(serve_check["deps"]))


def test_benchmark_setting_reruns_benchmarks_not_conversions(graph_repo):
    repo, stages = graph_repo
    # a key params.yaml does not write out (its default in the schema) is added with `+`, as DVC asks
    ran = exp_run(repo, "+benchmark.cold_runs=2")
    assert {"benchmark@eager", "benchmark@onnx"} <= ran, sorted(ran)
    assert not {r for r in ran if r.split("@")[0] in ("prepare", "convert")}, sorted(ran)


def test_adding_a_variant_converts_only_that_variant(graph_repo):
    repo, stages = graph_repo
    ran = exp_run(repo, "variants=[eager,onnx,torchscript]")
    assert {"convert@torchscript", "benchmark@torchscript"} <= ran, sorted(ran)
    assert not ran & {"convert@eager", "convert@onnx", "benchmark@eager", "benchmark@onnx", "prepare"}, sorted(ran)
    assert "select" in ran


def repro(repo: Path) -> set[str]:
    ran_stages(repo)
    sh([str(BIN / "dvc"), "repro"], repo)
    return {r.split("@")[0] for r in ran_stages(repo)}


def test_a_retrained_checkpoint_rebuilds_everything_an_unchanged_one_nothing(graph_repo):
    """The checkpoint's files are an input: weights overwritten in place re-run prepare and all after
    it (the new .mar holds the new model); untouched or only touched, nothing runs past the first stages."""
    repo, stages = graph_repo
    always = ALWAYS                                           # always_changed; their outputs did not change
    assert repro(repo) <= always
    weights = checkpoint_of(repo) / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))   # touched: same bytes
    assert repro(repo) <= always
    weights.write_bytes(b"trained-twice" * 4096)              # retrained into the same folder
    ran = repro(repo)
    assert ran >= {"prepare", "convert", "benchmark", "select", "configure", "archive", "serve_check", "report"} & stages, ran
    assert repro(repo) <= always
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-q", "-m", "retrained"], repo)
