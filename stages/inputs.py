"""The two stages DVC always runs: fingerprints of what every later stage depends on. Each rewrites
its file only when its content changes, so an unchanged input re-runs nothing downstream.

    python -m stages.inputs checkpoint [--root DIR]
        Every setting checked before any work: all problems of params.yaml at once (types, ranges,
        rules across fields, and the files it points at: the checkpoint exists, is of the source's
        form and has the task's head; the factory and the labels exist), exit 2 naming each one.
        Then artifacts/checkpoint.json: the sha256 of every file the stages read from the
        checkpoint, so a retrained model re-runs prepare and everything after it.
    python -m stages.inputs probe
        artifacts/env.json, the hardware + library fingerprint the benchmarks depend on, and
        artifacts/target.json, the fleet target the run is for.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from pipeline.core.params import REPO_ROOT, ParamsError, load_params, params_and_problems, read_params_file
from pipeline.core.paths import CHECKPOINT_JSON, ENV_JSON, TARGET_JSON

log = logging.getLogger("stages.inputs")


def _write_if_changed(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:        # mtime stable when unchanged
        path.write_text(text)


def checkpoint(root: Path) -> int:
    root = root.resolve()
    out = CHECKPOINT_JSON if root == REPO_ROOT else root / CHECKPOINT_JSON.relative_to(REPO_ROOT)
    try:
        data, source = read_params_file(None if os.environ.get("PIPELINE_PARAMS") or root == REPO_ROOT
                                        else root / "params.yaml")
    except ParamsError as e:
        print(f"checkpoint: error: {e}", file=sys.stderr)
        return 2
    params, problems, degraded = params_and_problems(data)
    from pipeline.model.checkpoint_files import HashCache, check_checkpoint, fingerprint
    if params is not None and not any(k.startswith("model.") for k in degraded):
        problems += check_checkpoint(params)
    if problems:
        print(f"checkpoint: error: {ParamsError.of(problems, source)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    cache = HashCache.default()
    record = fingerprint(params, cache)
    _write_if_changed(out, json.dumps(record, indent=2) + "\n")
    files = sum(len(v) for v in record.values() if isinstance(v, list))
    log.info("%s: %d files, %.1f MB (%.1f MB hashed, the rest unchanged since hashed) in %.2f s; params valid",
             params.model.checkpoint, files, record["total_bytes"] / 1e6, cache.hashed_bytes / 1e6,
             time.perf_counter() - t0)
    return 0


def probe(root: Path) -> int:
    from pipeline.host.device import DeviceError
    from pipeline.host.probe import fingerprint
    try:
        params = load_params()
        env = fingerprint(params.benchmark.device)
    except (ParamsError, DeviceError) as e:
        log.error("%s", e)
        return 2
    _write_if_changed(ENV_JSON, json.dumps(env, indent=2, sort_keys=True) + "\n")
    # The fleet target (pipeline/fleet sets PIPELINE_TARGET): the benchmarks depend on it, so their
    # run-cache entries are per target. Only the name: a volatile value would defeat every cache hit.
    _write_if_changed(TARGET_JSON, json.dumps({"target": os.environ.get("PIPELINE_TARGET") or "local"}, indent=2) + "\n")
    cpu, gpu = env["cpu"], env["gpu"]
    log.info("device %s (benchmark.device %s); CPU %s, %s physical / %s usable cores; GPU %s; wrote %s",
             env["device"], params.benchmark.device, cpu["model"], cpu["physical_cores"], cpu["usable_cpus"],
             gpu["name"] if gpu else "none", ENV_JSON)
    return 0


STAGES = {"checkpoint": checkpoint, "probe": probe}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--root", default=str(REPO_ROOT),
                        help="the tree whose params.yaml is read and artifacts/checkpoint.json written "
                             "(checkpoint; default: this repo)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return STAGES[args.stage](Path(args.root))


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/<stage>.json: wall time + peak memory
    sys.exit(run_timed(next((a for a in sys.argv[1:] if a in STAGES), "inputs"), main))
