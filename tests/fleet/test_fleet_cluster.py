"""`make fleet` on a real multi-node Ray cluster on this machine (ray.cluster_utils.Cluster, loopback
only) with a local-directory DVC remote, building the committed examples/tensor model.

One fleet run, five targets, each showing one behaviour:
  a  node A, by its label target=a            -> ok
  b  node B, by its resource target:b         -> ok, its conversions restored from a's run-cache (or a's from b's)
  c  no node offers it                        -> unschedulable, with what is missing
  d  node A, by resource target:d, needs a GPU of 10 TB -> refused before measuring anything
  e  node E, whose Java cannot start          -> fails mid-run (serve_check, the first stage that serves), with its log; the others go on
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

# Read by Ray at import: every node and driver on 127.0.0.1 only, never the interface address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from pipeline.core.params import REPO_ROOT, parse_params  # noqa: E402
from pipeline.fleet.driver import run_fleet  # noqa: E402
from pipeline.fleet.fleet_report import table, write_report  # noqa: E402
from pipeline.fleet.gather import write_fleet  # noqa: E402

BIN = Path(sys.executable).parent
LOOPBACK = "127.0.0.1"
CONVERSIONS = ("prepare", "convert@eager", "convert@onnx")


def small_params(targets: list[dict], workdir: Path, timeout_s: float) -> dict:
    """The tensor example with the shortest settings that still run every stage for real."""
    p = yaml.safe_load((REPO_ROOT / "examples/tensor/params.yaml").read_text())
    p["variants"] = ["eager", "onnx"]
    p["benchmark"].update(batch_sizes=[1, 2, 4], cold_runs=1, budget_s=5, rounds_agree_within=0.5, from_disk=False)
    p["tune"]["enabled"] = False          # serve_check is the stage that serves (tune has its own tests)
    p["serve_check"].update(requests=32, concurrency=4, handtuned=False, baseline=False, rounds=1, decided_band=0.0,
                            warmup_s=1.0)
    p["fleet"] = {"targets": targets, "schedule_timeout_s": timeout_s, "workdir": str(workdir)}
    return p


def git(repo: Path, *args: str) -> None:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com")
    subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)


def make_repo(root: Path, params: dict) -> Path:
    """This project's files (as git sees them, uncommitted ones too) in a fresh git repo, params as given, a local-directory DVC remote."""
    repo = root / "repo"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                           capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (REPO_ROOT / rel).is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / rel, repo / rel)
    (repo / "dvc.lock").unlink(missing_ok=True)          # the project's minilm run, not this one
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    git(repo, "init", "-q")
    subprocess.run([str(BIN / "dvc"), "remote", "add", "-d", "store", str(root / "remote")], cwd=repo, check=True,
                   capture_output=True)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "fleet test")
    return repo


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": LOOPBACK, "include_dashboard": False})
    try:
        nodes = {
            "A": c.add_node(num_cpus=1, labels={"target": "a"}, resources={"target:d": 1},
                            node_ip_address=LOOPBACK, object_store_memory=75 * 2**20),
            "B": c.add_node(num_cpus=1, resources={"target:b": 1}, node_ip_address=LOOPBACK,
                            object_store_memory=75 * 2**20),
            # a node whose Java cannot start: TorchServe fails at the first stage that serves
            "E": c.add_node(num_cpus=1, resources={"target:e": 1}, node_ip_address=LOOPBACK,
                            object_store_memory=75 * 2**20, env_vars={"JAVA_TOOL_OPTIONS": "-Xmx1k"}),
        }
        c.wait_for_nodes()
        yield c, {k: n.node_id for k, n in nodes.items()}
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def fleet(cluster):
    c, node_ids = cluster
    # its own folder, not pytest's numbered ones: another session's start may prune those mid-run
    root = Path(tempfile.mkdtemp(prefix="fleet-test-"))
    targets = [{"name": "a"}, {"name": "b"}, {"name": "c"},
               {"name": "d", "requires": {"gpu": "H100", "gpu_memory_mb": 10_000_000}}, {"name": "e"}]
    repo = make_repo(root, small_params(targets, root / "nodes", timeout_s=60))
    lines = []
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = c.address
    try:
        results = run_fleet(parse_params(yaml.safe_load((repo / "params.yaml").read_text())), repo, say=lines.append)
    finally:
        ray.shutdown()
        os.environ.pop("RAY_ADDRESS") if old is None else os.environ.__setitem__("RAY_ADDRESS", old)
    doc = write_fleet(repo, results)
    write_report(repo, doc)
    print("\n".join(lines) + "\n" + table(doc))            # shown with -s: the run as the console had it
    yield repo, doc, node_ids, lines
    shutil.rmtree(root, ignore_errors=True)


def test_each_target_runs_on_the_node_offering_it(fleet):
    repo, doc, node_ids, _ = fleet
    t = doc["targets"]
    assert t["a"]["status"] == "ok", t["a"]
    assert t["b"]["status"] == "ok", t["b"]
    assert t["a"]["node"] == node_ids["A"]           # by label target=a
    assert t["b"]["node"] == node_ids["B"]           # by resource target:b
    for name in ("a", "b"):
        mar = repo / t[name]["mar"]
        assert mar.name == "signalnet.mar" and mar.stat().st_size > 0
        assert (repo / "fleet" / name / "config.properties").read_text().count("=") > 3
        summary = json.loads((repo / "fleet" / name / "summary.json").read_text())
        assert summary["winner"] == t[name]["winner"] in ("eager", "onnx")
        assert t[name]["throughput_rps"] > 0 and t[name]["p99_ms"] > 0 and t[name]["ready_s"] > 0
        assert "serve_check" in t[name]["stages_run"]
        env = json.loads((repo / "fleet" / name / "env.json").read_text())
        assert env["cpu"]["isa"]                      # the node's own probe came back with it
    page = (repo / "reports" / "fleet.html").read_text()
    assert 'href="../fleet/a/report.html"' in page and (repo / "fleet" / "a" / "report.html").exists()
    assert set(json.loads((repo / "metrics" / "fleet.json").read_text())["targets"]) == set("abcde")


def test_conversions_run_once_across_targets_and_benchmarks_on_each(fleet):
    _, doc, _, _ = fleet
    t = doc["targets"]
    converted = [name for name in "abe" if set(CONVERSIONS) & set(t[name]["stages_run"])]
    assert len(converted) == 1, {n: t[n]["stages_run"] for n in "abe"}
    for name in set("abe") - set(converted):
        assert set(CONVERSIONS) <= set(t[name]["stages_restored"]), t[name]
    for name in "ab":
        # the benchmark's key holds the target: never restored from another target's timings
        assert {"benchmark@eager", "benchmark@onnx"} <= set(t[name]["stages_run"]), t[name]


def test_unschedulable_target_is_reported_with_what_is_missing(fleet):
    _, doc, _, lines = fleet
    c = doc["targets"]["c"]
    assert c["status"] == "unschedulable" and c["node"] is None
    assert "target=c" in c["reason"] and "target:c" in c["reason"] and "schedule_timeout_s" in c["reason"]
    assert any(line.startswith("[c] unschedulable") for line in lines)


def test_wrong_hardware_is_refused_before_measuring(fleet):
    _, doc, node_ids, _ = fleet
    d = doc["targets"]["d"]
    assert d["status"] == "failed" and d["node"] == node_ids["A"]
    assert d["reason"].startswith("refused: wrong hardware") and "H100" in d["reason"], d["reason"]
    assert d["stages_run"] == ["probe"] and d["stages_restored"] == [] and d["mar"] is None


def test_a_target_failing_mid_run_keeps_its_log_and_stops_no_other(fleet):
    repo, doc, _, lines = fleet
    e = doc["targets"]["e"]
    assert e["status"] == "failed" and "pipeline failed" in e["reason"], e
    assert "benchmark@eager" in e["stages_run"] and e["mar"] is None       # it failed past the benchmarks
    log = (repo / "fleet" / "e" / "log.txt").read_text()
    assert "Running stage 'benchmark@eager'" in log and "failed to reproduce" in log, log[-2000:]
    assert doc["targets"]["a"]["status"] == doc["targets"]["b"]["status"] == "ok"
    assert all(line.startswith("[") for line in lines)          # every console line names its target
