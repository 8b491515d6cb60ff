"""Every target into this checkout: `fleet/<target>/` (its .mar, config.properties, summary,
report, log) and `metrics/fleet.json`, the interface:

    {"targets": {"<name>": {"status": "ok" | "failed" | "unschedulable", "reason", "node", "winner",
                            "mar": "<path in the repo>", "throughput_rps", "p99_ms", "ready_s",
                            "stages_run": [...], "stages_restored": [...]}}}
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

# a target's files as gathered (pipeline/fleet/remote.py GATHERED) -> where they go in fleet/<target>/
PLACES = {"artifacts/serve/config.properties": "config.properties", "metrics/summary.json": "summary.json",
          "metrics/serve_check.json": "serve_check.json", "artifacts/env.json": "env.json",
          "reports/report.html": "report.html"}


def _place(rel: str) -> str | None:
    if rel in PLACES:
        return PLACES[rel]
    if rel.startswith("artifacts/model_store/"):
        return rel[len("artifacts/model_store/"):]
    if rel.startswith("reports/img/"):
        return "img/" + rel[len("reports/img/"):]          # report.html's images, beside it as in reports/
    return None


def write_target(root: Path, name: str, result: dict) -> dict:
    """fleet/<name>/ from one target's result; returns its metrics/fleet.json entry."""
    folder = root / "fleet" / name
    shutil.rmtree(folder, ignore_errors=True)      # a target's folder is only ever this run's
    folder.mkdir(parents=True)
    mar = None
    for rel, data in sorted(result.get("files", {}).items()):
        place = _place(rel)
        if place is None:
            continue
        dest = folder / place
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        if place.endswith(".mar") and "/" not in place:
            mar = str(dest.relative_to(root))
    (folder / "log.txt").write_text("\n".join(result.get("log", [])) + "\n")
    summary = _json(folder / "summary.json")
    # The served figures are summary.json's top level (the serve check's, at its load); a summary
    # written before that layout has them under `serve_check`.
    served = summary if "throughput_rps" in summary else (summary.get("serve_check") or {})
    return {"status": result["status"], "reason": result.get("reason"), "node": result.get("node"),
            "winner": summary.get("winner"), "mar": mar, "throughput_rps": served.get("throughput_rps"),
            "p99_ms": served.get("p99_ms"), "ready_s": served.get("ready_s"),
            "stages_run": list(result.get("stages_run", [])),
            "stages_restored": list(result.get("stages_restored", []))}


def write_fleet(root: Path, results: dict[str, dict]) -> dict:
    doc = {"targets": {name: write_target(root, name, r) for name, r in results.items()}}
    out = root / "metrics" / "fleet.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
