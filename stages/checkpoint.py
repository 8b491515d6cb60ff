"""checkpoint: every setting checked before any work, and the checkpoint's files as a DVC input.

    python -m stages.checkpoint [--root DIR]

Collects every problem of params.yaml at once (types, ranges, rules across fields, and the files it
points at: the checkpoint exists, is of the source's form and has the task's head; the factory and
the labels exist) and exits 2 naming each one. Then writes artifacts/checkpoint.json: the sha256
of every file the stages read from the checkpoint. Always run (dvc.yaml always_changed); its
content changes only when a byte of the checkpoint does, so a retrained model re-runs prepare
and everything after it, and an unchanged one re-runs nothing.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from pipeline.core.params import REPO_ROOT, ParamsError, params_and_problems, read_params_file
from pipeline.core.paths import CHECKPOINT_JSON

log = logging.getLogger("stages.checkpoint")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(REPO_ROOT),
                        help="the tree whose params.yaml is read and artifacts/checkpoint.json written (default: this repo)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    root = Path(args.root).resolve()
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
    text = json.dumps(record, indent=2) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists() or out.read_text() != text:        # mtime stable when unchanged
        out.write_text(text)
    files = sum(len(v) for v in record.values() if isinstance(v, list))
    log.info("%s: %d files, %.1f MB (%.1f MB hashed, the rest unchanged since hashed) in %.2f s; params valid",
             params.model.checkpoint, files, record["total_bytes"] / 1e6, cache.hashed_bytes / 1e6,
             time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/checkpoint.json: wall time + peak memory
    sys.exit(run_timed("checkpoint", main))
