"""reports/fleet.html: one table, a row per target, each linking to its own report."""
from __future__ import annotations

import html
import json
from pathlib import Path


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _memory_mb(root: Path, name: str):
    try:
        return json.loads((root / "fleet" / name / "serve_check.json").read_text()).get("worker_peak_rss_mb")
    except (OSError, ValueError):
        return None


def render(root: Path, doc: dict) -> str:
    rows = []
    for name, t in doc["targets"].items():
        own = root / "fleet" / name / "report.html"
        link = f'<a href="../fleet/{html.escape(name)}/report.html">report</a>' if own.exists() else ""
        cells = [name, t["status"], t.get("node") and t["node"][:12], t.get("winner"), _fmt(t.get("throughput_rps")),
                 _fmt(t.get("p99_ms")), _fmt(t.get("ready_s"), 2), _fmt(_memory_mb(root, name), 0),
                 ", ".join(t.get("stages_run") or []) or "—", ", ".join(t.get("stages_restored") or []) or "—",
                 t.get("reason") or ""]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c or '—'))}</td>" for c in cells)
                    + f"<td>{link}</td><td><a href=\"../fleet/{html.escape(name)}/log.txt\">log</a></td></tr>")
    head = ["target", "status", "node", "winner", "served req/s", "p99 ms", "READY s", "worker memory MB",
            "ran", "restored", "reason", "", ""]
    return ("<!doctype html><meta charset=utf-8><title>fleet</title>"
            "<style>td,th{border:1px solid #ccc;padding:4px;vertical-align:top;font:13px sans-serif}"
            "table{border-collapse:collapse}</style><h1>Fleet: one build per target</h1><table><tr>"
            + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>")


def write_report(root: Path, doc: dict) -> Path:
    out = root / "reports" / "fleet.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(root, doc))
    return out


def table(doc: dict) -> str:
    """The same table as text, for the console and notes."""
    lines = ["target | status | winner | req/s | p99 ms | READY s | ran | restored | reason"]
    for name, t in doc["targets"].items():
        lines.append(" | ".join([name, t["status"], str(t.get("winner") or "—"), _fmt(t.get("throughput_rps")),
                                 _fmt(t.get("p99_ms")), _fmt(t.get("ready_s"), 2), str(len(t.get("stages_run") or [])),
                                 str(len(t.get("stages_restored") or [])), t.get("reason") or ""]))
    return "\n".join(lines)
