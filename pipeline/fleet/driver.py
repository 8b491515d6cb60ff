"""`make fleet`: one Ray task per target of params.yaml `fleet.targets`, on a node of that target,
then every target gathered into this checkout (pipeline/fleet/gather.py).

Ray: $RAY_ADDRESS when set; else a local Ray is started for the run, offering the targets this
machine meets (its probe against their `requires`), so the others are reported unschedulable.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from pipeline.core.fleet_params import Target
from pipeline.core.params import Params
from pipeline.fleet import placement, remote
from pipeline.fleet.node_checks import unmet

CANCEL_GRACE_S = 15.0          # after Ctrl-C: time for the nodes to stop their stages before a hard kill


class FleetError(RuntimeError):
    """The fleet cannot start; the message names the problem and the fix."""


def _git(repo: Path, *args: str) -> str:
    r = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if r.returncode != 0:
        raise FleetError(f"git {' '.join(args)} failed in {repo}: {r.stderr.strip()}")
    return r.stdout.strip()


def job_for(params: Params, repo: Path) -> dict:
    """What every node needs: the revision (committed: the nodes see only commits), where to
    clone it from, and a DVC remote to share inputs, outputs and the run-cache through."""
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    if dirty:
        raise FleetError(f"uncommitted changes ({dirty.splitlines()[0].strip()} ...): the nodes build the "
                         "committed revision only; commit (and push) first")
    url = params.fleet.repo
    if not url:
        r = subprocess.run(["git", "remote", "get-url", "origin"], cwd=repo, capture_output=True, text=True)
        url = r.stdout.strip() if r.returncode == 0 else str(repo)
    r = subprocess.run([str(Path(sys.executable).parent / "dvc"), "remote", "default"], cwd=repo,
                       capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise FleetError("no default DVC remote: the targets share conversions and results through it; "
                         "`dvc remote add -d store s3://BUCKET/path` and commit .dvc/config (docs/fleet.md)")
    return {"rev": _git(repo, "rev-parse", "HEAD"), "repo": url, "workdir": params.fleet.workdir}


def start_ray(targets: list[Target], say: Callable[[str], None]) -> tuple[bool, int, dict[str, str]]:
    """Connect to $RAY_ADDRESS, or start a local Ray offering the targets this machine meets.
    Returns (started here, CPUs each task takes: all of them locally, so targets never measure
    side by side on one machine, {target this local Ray can never offer: why})."""
    if not os.environ.get("RAY_ADDRESS"):
        # a Ray for this run only: on loopback (Ray reads this at import), reachable from nowhere else
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(remote)     # nodes need not have this checkout on their path
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return False, 1, {}
    from pipeline.host.probe import fingerprint
    env = fingerprint("auto")
    met = [t for t in targets if not unmet(t.requires, env)]
    cpus = os.cpu_count() or 1
    ray.init(num_cpus=cpus, resources={f"target:{t.name}": 1.0 for t in met}, log_to_driver=False,
             include_dashboard=False, _node_ip_address="127.0.0.1")
    say(f"local Ray: this machine offers {', '.join(t.name for t in met) or 'no target'}")
    # no autoscaler here: waiting schedule_timeout_s for these would change nothing
    never = {t.name: "no RAY_ADDRESS, and this machine (the local Ray's only node) lacks "
             + "; ".join(unmet(t.requires, env)) for t in targets if t not in met}
    return True, cpus, never


def run_fleet(params: Params, repo: Path, say: Callable[[str], None] = print) -> dict[str, dict]:
    """Every target's record (see pipeline/fleet/gather.py), whatever happened to each."""
    import ray
    targets = list(params.fleet.targets)
    if not targets:
        raise FleetError("params.yaml has no fleet.targets: list the targets to build for (README, docs/fleet.md)")
    job = job_for(params, repo)
    started_here, cpus, never = start_ray(targets, say)
    try:
        results = {name: _record("unschedulable", reason) | {"log": []} for name, reason in never.items()}
        for name, reason in never.items():
            say(f"[{name}] unschedulable: {reason}")
        runnable = [t for t in targets if t.name not in never]
        results.update(_run(ray, job, runnable, params.fleet.schedule_timeout_s, cpus, say) if runnable else {})
        return {t.name: results[t.name] for t in targets}        # in params.yaml's order
    finally:
        if started_here:
            ray.shutdown()


def _run(ray, job: dict, targets: list[Target], timeout_s: float, cpus: int, say) -> dict[str, dict]:
    coordinator = ray.remote(remote.Coordinator).options(num_cpus=0).remote()
    task = ray.remote(remote.run_target)
    nodes = ray.nodes()
    pending, submitted, results = {}, time.monotonic(), {}
    for t in targets:
        opts = placement.task_options(t, nodes)
        say(f"[{t.name}] submitted, placed by {opts}")
        ref = task.options(num_cpus=cpus, max_retries=0, **opts).remote(job, dataclasses.asdict(t), coordinator)
        pending[ref] = t
    logs: dict[str, list[str]] = {t.name: [] for t in targets}
    offset = 0
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            offset = _relay(ray, coordinator, offset, logs, say)
            for ref in done:
                t = pending.pop(ref)
                results[t.name] = _outcome(ray, ref, t)
                coordinator.release.remote(t.name)       # a node lost holding the conversion lock frees it
                say(f"[{t.name}] {results[t.name]['status']}" + (f": {results[t.name]['reason']}"
                                                                 if results[t.name]["reason"] else ""))
            if time.monotonic() - submitted > timeout_s:
                started = ray.get(coordinator.started_targets.remote())
                for ref, t in list(pending.items()):
                    if t.name not in started:
                        ray.cancel(ref, force=True)
                        del pending[ref]
                        results[t.name] = _record("unschedulable",
                                                  placement.missing_reason(t, ray.nodes(), timeout_s))
                        say(f"[{t.name}] unschedulable: {results[t.name]['reason']}")
        _relay(ray, coordinator, offset, logs, say)
    except KeyboardInterrupt:
        say(f"interrupted: cancelling {', '.join(t.name for t in pending.values()) or 'nothing'} on the nodes")
        _cancel(ray, list(pending))
        raise
    for name, lines in logs.items():
        results[name]["log"] = lines
    return results


def _relay(ray, coordinator, offset: int, logs: dict, say) -> int:
    """The nodes' lines: all into each target's log, the telling ones to the console, prefixed."""
    lines = ray.get(coordinator.read.remote(offset))
    for name, line in lines:
        logs.setdefault(name, []).append(line)
        if remote.SHOWN.search(line):
            say(f"[{name}] {line.strip()}")
    return offset + len(lines)


def _outcome(ray, ref, t: Target) -> dict:
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as e:
        # the worker or its node died, or the task raised: this target failed, the others go on
        first = str(e).strip().splitlines()
        return _record("failed", f"{type(e).__name__}: {first[0] if first else ''}"[:500])


def _record(status: str, reason: Optional[str]) -> dict:
    return {"status": status, "reason": reason, "node": None, "host": None, "stages_run": [],
            "stages_restored": [], "files": {}}


def _cancel(ray, refs: list) -> None:
    """Ray's cancel raises KeyboardInterrupt in the task, which stops its stages (their process
    group); tasks still there after the grace period are killed."""
    for ref in refs:
        ray.cancel(ref)
    ray.wait(refs, num_returns=len(refs), timeout=CANCEL_GRACE_S)
    for ref in refs:
        ray.cancel(ref, force=True)
