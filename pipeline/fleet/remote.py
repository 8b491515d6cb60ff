"""What runs on a target's node: the Ray task body and the driver's coordinator actor.

Shipped to the nodes by value (the driver registers this module with cloudpickle), so it imports
only the standard library at module level: a node needs Ray and the project's locked environment,
not this checkout on its path. Everything the pipeline computes runs as subprocesses inside the
node's own clone at the driver's revision, so the code that runs is the revision's code.
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

RAN = re.compile(r"Running stage '([^']+)'")
RESTORED = re.compile(r"Stage '([^']+)' (?:is cached - skipping run|didn't change, skipping)")
# Lines worth showing on the driver's console (everything goes to the target's log).
SHOWN = re.compile(r"Running stage|is cached - skipping|didn't change|ERROR|Error|error:|^fleet:")
# What the driver gathers from a finished target (relative to the clone).
GATHERED = ("artifacts/model_store", "artifacts/serve/config.properties", "metrics/summary.json",
            "metrics/serve_check.json", "artifacts/env.json", "reports/report.html", "reports/img")
REFUSED_EXIT = 3                                # pipeline/fleet/node_checks.py: the node is not fit


class Coordinator:
    """One per fleet run (an actor): the targets' log lines for the driver, which targets have
    started (the rest may be unschedulable), and the conversion lock, so conversions run on one
    target at a time and the next one restores them from the run-cache instead of converting too."""

    def __init__(self):
        self.lines: list[tuple[str, str]] = []
        self.started: dict[str, dict] = {}
        self.holder = None

    def log(self, target: str, line: str) -> None:
        self.lines.append((target, line))

    def read(self, offset: int) -> list:
        return self.lines[offset:]

    def start(self, target: str, node: dict) -> None:
        self.started[target] = node

    def started_targets(self) -> dict:
        return dict(self.started)

    def acquire(self, target: str) -> bool:
        if self.holder in (None, target):
            self.holder = target
            return True
        return False

    def release(self, target: str) -> None:
        if self.holder == target:
            self.holder = None


class Refused(Exception):
    """The node is not fit for the target (code, environment or hardware): nothing was measured."""


class StepFailed(Exception):
    pass


class TargetRun:
    """One target on this node: its clone, its subprocesses, its log and what ran or was restored."""

    def __init__(self, job: dict, target: dict, coordinator):
        self.job, self.target, self.coordinator = job, target, coordinator
        self.name = target["name"]
        self.root = Path(os.path.expanduser(job["workdir"])) / self.name
        self.stages_run: list[str] = []
        self.stages_restored: list[str] = []
        bin_dir = os.path.dirname(sys.executable)
        env = {k: v for k, v in os.environ.items()
               if k not in ("PIPELINE_STAGE_METRICS", "PIPELINE_PARAMS") and not k.startswith("DVC_")}
        # PATH: the node's environment (dvc, torchserve); PIPELINE_TARGET: the benchmark's key (stages/inputs.py)
        env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), PIPELINE_TARGET=self.name,
                   DVC_NO_ANALYTICS="1", PYTHONUNBUFFERED="1")
        self.env = env

    def say(self, line: str) -> None:
        self.coordinator.log.remote(self.name, line)

    def sh(self, *args: str, step: str, cwd=None, refuse_on: int | None = None, check: bool = True) -> str:
        """Run a command, streaming its lines to the driver; on Ctrl-C (Ray's cancel raises
        KeyboardInterrupt here) its whole process group (stages, TorchServe) is stopped."""
        proc = subprocess.Popen(args, cwd=cwd or self.root, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        out, tail = [], b""
        try:
            while True:
                # poll, not a blocking read: the interrupt only lands between Python bytecodes
                ready, _, _ = select.select([proc.stdout], [], [], 0.5)
                if ready:
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    if not chunk:
                        break
                    *lines, tail = (tail + chunk).split(b"\n")
                    for raw in lines:
                        self._line(raw.decode(errors="replace"), out)
            if tail:
                self._line(tail.decode(errors="replace"), out)
            rc = proc.wait()
        except BaseException:
            _stop_group(proc)
            raise
        if refuse_on is not None and rc == refuse_on:
            raise Refused(_last(out) or f"{step} refused the node")
        if check and rc != 0:
            raise StepFailed(f"{step} failed (exit {rc}): {_last(out)}")
        return "\n".join(out)

    def _line(self, line: str, out: list) -> None:
        out.append(line)
        if (m := RAN.search(line)) and m.group(1) not in self.stages_run:
            self.stages_run.append(m.group(1))
        elif (m := RESTORED.search(line)) and m.group(1) not in self.stages_restored + self.stages_run:
            self.stages_restored.append(m.group(1))
        self.coordinator.log.remote(self.name, line)

    def checkout(self) -> None:
        """The driver's revision in this target's own clone; a node that cannot get it is refused."""
        url, rev = self.job["repo"], self.job["rev"]
        if not (self.root / ".git").exists():
            self.root.parent.mkdir(parents=True, exist_ok=True)
            self.sh("git", "clone", "-q", "--no-checkout", url, str(self.root), step="git clone", cwd=self.root.parent)
        else:
            self.sh("git", "fetch", "-q", url, step="git fetch", check=False)
        try:
            self.sh("git", "checkout", "-q", "--force", rev, step="git checkout")
        except StepFailed:
            raise Refused(f"code differs: revision {rev[:12]} is not in {url} (push it first)") from None
        head = self.sh("git", "rev-parse", "HEAD", step="git rev-parse").strip().splitlines()[-1]
        if head != rev:
            raise Refused(f"code differs: the clone is at {head[:12]}, the driver at {rev[:12]}")

    def push(self, *args: str) -> None:
        """Outputs and run-cache to the DVC remote, with the run-cached stages' records DVC's push
        leaves out (pipeline/fleet/dvc_push.py)."""
        self.sh(sys.executable, "-m", "pipeline.fleet.dvc_push", *args, step="dvc push")

    def run(self) -> dict:
        py = sys.executable
        self.say(f"fleet: {self.name}: clone at {self.job['rev'][:12]} in {self.root}")
        self.checkout()
        self.sh(py, "-m", "pipeline.fleet.node_checks", "environment", step="environment check", refuse_on=REFUSED_EXIT)
        # the probe alone (DVC's `repro probe` would be a second one): `requires` is checked before any work
        self.sh(py, "-m", "stages.inputs", "probe", step="probe")
        self.stages_run.append("probe")
        self.sh(py, "-m", "pipeline.fleet.node_checks", "requires", json.dumps(self.target.get("requires") or {}),
                step="hardware check", refuse_on=REFUSED_EXIT)
        # the checkpoint stage alone too: settings and files checked, and artifacts/checkpoint.json (which
        # prepare depends on) written before the single-item repro below, so its run-cache key is this checkpoint's
        self.sh(py, "-m", "stages.inputs", "checkpoint", step="checkpoint")
        self.stages_run.append("checkpoint")
        self.say("fleet: waiting for the conversion lock")
        while not _get(self.coordinator.acquire.remote(self.name)):
            time.sleep(1.0)
        try:
            # --pull: restore from the run-cache another target pushed; --allow-missing, or DVC re-runs (dvc#10412)
            # --single-item: not the probe and checkpoint again (upstream of convert, always changed); they just ran
            self.sh("dvc", "repro", "--single-item", "--pull", "--allow-missing", "prepare", "convert",
                    step="conversions")
            self.push("prepare", "convert", "--records", "prepare", "convert")
        finally:
            self.coordinator.release.remote(self.name)
        self.sh("dvc", "repro", "--pull", "--allow-missing", "report", step="pipeline")
        self.push("report", "--with-deps", "--records", "benchmark")
        self.say("fleet: done")
        return _gathered(self.root)


def run_target(job: dict, target: dict, coordinator) -> dict:
    """The Ray task: one target, start to finish. Returns its record (and files) whatever happens,
    except a cancel, which stops its subprocesses and propagates."""
    import ray
    node = {"node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname()}
    _get(coordinator.start.remote(target["name"], node))
    run = TargetRun(job, target, coordinator)
    status, reason, files = "ok", None, {}
    try:
        files = run.run()
    except Refused as e:
        status, reason = "failed", f"refused: {e}"
    except StepFailed as e:
        status, reason = "failed", str(e)
    except OSError as e:
        status, reason = "failed", f"{type(e).__name__}: {e}"
    if reason:
        run.say(f"fleet: {reason}")
    return {"status": status, "reason": reason, "node": node["node"], "host": node["host"],
            "stages_run": run.stages_run, "stages_restored": run.stages_restored, "files": files}


def _gathered(root: Path) -> dict:
    files = {}
    for rel in GATHERED:
        p = root / rel
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file() and not f.is_symlink() or f.is_symlink() and f.exists():
                files[str(f.relative_to(root))] = f.read_bytes()
    return files


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _last(lines: list[str]) -> str:
    meaningful = [ln.strip() for ln in lines if ln.strip()]
    errors = [ln for ln in meaningful if "ERROR" in ln or "Error" in ln]
    return (errors or meaningful or [""])[-1][:500]


def _get(ref):
    import ray
    return ray.get(ref)
