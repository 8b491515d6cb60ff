"""What each pipeline stage cost: wall time and peak memory, one record per stage run.

Every stage script ends in `sys.exit(run_timed("<stage>", main))`, which writes
`metrics/stages/<stage>.json` (`metrics/stages/<stage>/<item>.json` for a foreach stage) — a
non-cached DVC output of that stage — when the stage finishes, whatever its exit code:

    {"stage", "item", "wall_s", "exit_code", "peak_rss_mb": {"stage", "children"}, "started_at",
     "outputs": {"files", "bytes", "on_disk_bytes", "linked_files"}}

`outputs` is what the stage wrote into its declared outputs (dvc.yaml's `outs`), as the filesystem
counts it (pipeline/core/disk.py): `bytes` every name counted, `on_disk_bytes` each inode once.

`peak_rss_mb.stage` is the stage process's own peak resident memory, `children` the largest peak
of the processes it started and waited for (conversion workers, fresh benchmark processes; not
the TorchServe daemons, which the stage stops but does not wait on as children). Against the
model's size it says how many copies of the model a stage holds at once. DVC records no stage
timings itself, so this is the pipeline's own account of where a run's minutes go.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from pipeline.core.disk import footprint
from pipeline.core.params import REPO_ROOT
from pipeline.core.paths import METRICS

STAGE_METRICS = METRICS / "stages"


def record_path(stage: str, item: Optional[str] = None, root: Path = STAGE_METRICS) -> Path:
    return root / stage / f"{item}.json" if item else root / f"{stage}.json"


def _peak_rss_mb(who: int) -> float:
    kb = resource.getrusage(who).ru_maxrss           # KiB on Linux (bytes on macOS)
    return round(kb / (2**20 if sys.platform == "darwin" else 1024), 1)


def _root_from_argv(argv: list[str]) -> Path:
    """Stages run on another tree (`--root DIR`: report, kserve) record under DIR/metrics/stages;
    $PIPELINE_STAGE_METRICS redirects the rest (the tests run stage scripts outside the pipeline)."""
    for i, arg in enumerate(argv):
        if arg == "--root" and i + 1 < len(argv):
            return Path(argv[i + 1]) / "metrics" / "stages"
        if arg.startswith("--root="):
            return Path(arg.split("=", 1)[1]) / "metrics" / "stages"
    return Path(os.environ.get("PIPELINE_STAGE_METRICS") or STAGE_METRICS)


def declared_outputs(stage: str, item: Optional[str] = None, repo: Path = REPO_ROOT) -> list[Path]:
    """The stage's `outs` in dvc.yaml (`${item}` filled in), its own metrics record left out."""
    import yaml
    try:
        spec = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"][stage]
    except (OSError, KeyError, TypeError, ValueError):
        return []
    outs = []
    for entry in spec.get("do", spec).get("outs") or []:
        path = next(iter(entry)) if isinstance(entry, dict) else entry
        path = str(path).replace("${item}", item or "")
        if not path.startswith("metrics/stages"):
            outs.append(repo / path)
    return outs


def run_timed(stage: str, main: Callable[[], Optional[int]], item: Optional[str] = None,
              root: Optional[Path] = None) -> int:
    """Run a stage's `main()` and write its record; returns main's exit code (an exception is
    recorded as exit code 1 and re-raised). root: default metrics/stages (of `--root` when given)."""
    root = root if root is not None else _root_from_argv(sys.argv[1:])
    started = datetime.now(timezone.utc)
    t0 = time.monotonic()
    code = 1
    try:
        code = int(main() or 0)
        return code
    finally:
        rec = {"stage": stage, "item": item, "wall_s": round(time.monotonic() - t0, 2), "exit_code": code,
               "peak_rss_mb": {"stage": _peak_rss_mb(resource.RUSAGE_SELF),
                               "children": _peak_rss_mb(resource.RUSAGE_CHILDREN)},
               "started_at": started.isoformat(timespec="seconds")}
        if root == STAGE_METRICS:            # the pipeline's own run (not a test's or another tree's)
            rec["outputs"] = footprint(declared_outputs(stage, item)).as_dict()
        path = record_path(stage, item, root)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec, indent=2) + "\n")


def read_records(root: Path = STAGE_METRICS) -> list[dict]:
    """Every stage record under `root`, in file order (stage, then item); unreadable ones skipped."""
    out = []
    for path in sorted(root.rglob("*.json")) if root.is_dir() else []:
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and "wall_s" in rec:
            out.append(rec)
    return out
