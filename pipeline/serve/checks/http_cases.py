"""The served checks' inputs: the task's golden HTTP cases and the tolerance their answers are judged by."""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pipeline.serve.archive import PROVENANCE


@dataclass(frozen=True)
class HttpCase:
    id: str
    content_type: Optional[str]
    body: bytes
    expected: Any = None


def load_http_cases(path: Path) -> list[HttpCase]:
    """artifacts/golden/http_cases.json → cases with their bodies as bytes (body_file relative to it)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found; run the prepare stage (it writes the golden HTTP cases)") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: expected a non-empty JSON list of cases "
                         f'[{{"id", "content_type", "body" | "body_file", "expected"}}]')
    cases = []
    for i, c in enumerate(raw):
        if "body_file" in c:
            body = (path.parent / c["body_file"]).read_bytes()
        elif "body" in c:
            b = c["body"]
            body = b.encode("utf-8") if isinstance(b, str) else json.dumps(b).encode("utf-8")
        else:
            raise ValueError(f"{path}: case {i} ({c.get('id')}) has neither `body` nor `body_file`")
        cases.append(HttpCase(str(c.get("id", i)), c.get("content_type"), body, c.get("expected")))
    return cases


def write_http_cases(path: Path, cases: list[HttpCase]) -> Path:
    """`cases` as a cases file `load_http_cases` reads back (bodies inline as text; no expected answers)."""
    path = Path(path)
    path.write_text(json.dumps([{"id": c.id, "content_type": c.content_type, "body": c.body.decode("utf-8")}
                                for c in cases]))
    return path


def tolerance_from_mar(mar: Path) -> Optional[dict]:
    """The variant's verification tolerance {atol, rtol, ...} recorded in the .mar's provenance.json."""
    try:
        with zipfile.ZipFile(mar) as z:
            prov = json.loads(z.read(PROVENANCE))
    except (KeyError, zipfile.BadZipFile, FileNotFoundError, json.JSONDecodeError):
        return None
    tol = (prov.get("verification") or {}).get("tolerance")
    return tol if isinstance(tol, dict) and "atol" in tol else None
