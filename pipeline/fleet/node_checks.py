"""Is this node fit for a target? Run on the node, inside its clone at the driver's revision
(pipeline/fleet/remote.py), so the checks are the revision's own.

    python -m pipeline.fleet.node_checks environment       # the locked environment is installed here
    python -m pipeline.fleet.node_checks requires '<json>'  # artifacts/env.json meets the target's needs

Exit 3 with the reason on stdout when the node is not fit (a benchmark of the wrong hardware, or
of other library versions, is worse than none); 0 when it is.
"""
from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from pathlib import Path

from pipeline.core.fleet_params import Requires
from pipeline.core.params import REPO_ROOT
from pipeline.core.params_typed import build
from pipeline.host.probe import ISA_FLAGS

NOT_FIT = 3
LOCK_FILES = ("requirements.txt", "requirements-nodeps.txt")
PIN = re.compile(r"^\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([^\s;#]+)")


def environment_differences(root: Path = REPO_ROOT) -> list[str]:
    """Each `name==version` of the lock files whose installed version differs (or is missing)."""
    wrong = []
    for lock in LOCK_FILES:
        path = root / lock
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if not (m := PIN.match(line)):
                continue
            name, want = m.groups()
            try:
                have = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                have = None
            # PEP 440: a pin without a local label (+cpu) accepts any local build of that version
            if have is None or (have if "+" in want else have.split("+")[0]) != want:
                wrong.append(f"{name}=={want} (installed: {have or 'none'})")
    return wrong


def unmet(requires: Requires, env: dict) -> list[str]:
    """What the node (its probe, env.json) lacks of `requires`, in words; empty when it is fit."""
    missing = []
    isa = (env.get("cpu") or {}).get("isa") or {}
    for flag in requires.cpu_flags:
        if flag not in ISA_FLAGS:
            missing.append(f"CPU flag {flag} (unknown to the probe; known: {', '.join(ISA_FLAGS)})")
        elif not isa.get(flag):
            missing.append(f"CPU flag {flag} (node: {(env.get('cpu') or {}).get('model')})")
    gpu = env.get("gpu") or None
    if requires.gpu:
        if gpu is None:
            missing.append(f"GPU {requires.gpu} (node: no GPU)")
        elif requires.gpu.lower() not in str(gpu.get("name", "")).lower():
            missing.append(f"GPU {requires.gpu} (node: {gpu.get('name')})")
    if requires.gpu_memory_mb and (gpu is None or (gpu.get("memory_mb") or 0) < requires.gpu_memory_mb):
        missing.append(f"{requires.gpu_memory_mb} MB of GPU memory (node: {gpu.get('memory_mb') if gpu else 0} MB)")
    if requires.memory_mb and (env.get("memory_mb") or 0) < requires.memory_mb:
        missing.append(f"{requires.memory_mb} MB of memory (node: {env.get('memory_mb')} MB)")
    cpus = (env.get("cpu") or {}).get("usable_cpus") or 0
    if requires.cpus and cpus < requires.cpus:
        missing.append(f"{requires.cpus} CPUs (node: {cpus})")
    return missing


def main(argv: list[str]) -> int:
    if argv[:1] == ["environment"]:
        wrong = environment_differences()
        if wrong:
            print("environment differs from the locked requirements: " + "; ".join(wrong)
                  + " (install them: make setup, or the node image of docs/fleet.md)")
            return NOT_FIT
        print("fleet: environment matches the locked requirements")
        return 0
    if argv[:1] == ["requires"] and len(argv) == 2:
        requires = build(Requires, json.loads(argv[1]), "fleet.targets[].requires")
        env = json.loads((REPO_ROOT / "artifacts" / "env.json").read_text())
        missing = unmet(requires, env)
        if missing:
            print("wrong hardware: this node lacks " + "; ".join(missing))
            return NOT_FIT
        print("fleet: hardware meets the target's requires")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
