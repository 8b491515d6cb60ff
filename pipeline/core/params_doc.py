"""docs/params.md from the schema: every key of params.yaml with its default, what is allowed and
what it does — the comments beside each field in pipeline/core/params_schema.py (and
fleet_params.py), the ranges from params_checks.RANGES.

    python -m pipeline.core.params_doc            # rewrite docs/params.md
    python -m pipeline.core.params_doc --check    # exit 1 when docs/params.md is stale (tests run it)
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

import yaml

from pipeline.core import fleet_params, params_schema
from pipeline.core.params import DEFAULT_PARAMS, REPO_ROOT
from pipeline.core.params_checks import RANGES
from pipeline.core.params_schema import Params
from pipeline.core.params_typed import _section_type, type_name

DOC = REPO_ROOT / "docs" / "params.md"
MODULES = (params_schema, fleet_params)


def field_comments(module) -> dict[tuple[str, str], str]:
    """(class, field) -> its comment: the comment lines just above it at its indentation, the one on
    its line, and the deeper-indented comment lines that continue it."""
    source = inspect.getsource(module)
    lines = source.splitlines()
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip())
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                continue
            col, text = stmt.col_offset, []
            above = stmt.lineno - 1
            while above >= 1 and above in comments and comments[above][0] == col and \
                    lines[above - 1].strip().startswith("#"):
                above -= 1
            text += [comments[n][1] for n in range(above + 1, stmt.lineno)]
            text += [comments[n][1] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
            below = stmt.end_lineno + 1
            while below in comments and comments[below][0] > col and lines[below - 1].strip().startswith("#"):
                text.append(comments[below][1])
                below += 1
            out[(node.name, stmt.target.id)] = " ".join(t for t in text if t)
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in value.items()} \
            if isinstance(value, dict) else value
    return dataclasses.MISSING


def _render(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "**required**"
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        # a mapping of sections: each entry's values that differ from the section's own defaults
        return "<br>".join(f"`{k}: {json.dumps(_own(v))}`" for k, v in value.items())
    return f"`{json.dumps(value)}`"


def _own(entry: dict) -> dict:
    from pipeline.core.params_schema import Tolerance
    defaults = {f.name: f.default for f in dataclasses.fields(Tolerance) if f.default is not dataclasses.MISSING}
    return {k: v for k, v in entry.items() if k not in defaults or defaults[k] != v}


def _written(data: Any, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def rows(cls: type, prefix: str, comments: dict, page: dict) -> list[tuple[str, str, str, str, str]]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        section = _section_type(tp)
        text = comments.get((cls.__name__, f.name), "")
        if section is not None and section[1] == "":          # a nested section: its own rows
            out += rows(section[0], key, comments, page)
            continue
        allowed = type_name(tp)
        rule = RANGES.get(key.replace("[0]", "[]"))
        if rule is not None:
            optional = type(None) in typing.get_args(tp) and "null" not in rule.allowed
            allowed = rule.allowed + (" or null" if optional else "")
        if section is not None:                               # a mapping or a list of sections: one row, then theirs
            allowed = "a mapping of name → {…}" if section[1] != "[]" else "a list of {…}"
            out.append((key, _render(_default(f)), allowed, text, "yes" if _written(page, key) else ""))
            out += rows(section[0], key + section[1], comments, page)
            continue
        out.append((key, _render(_default(f)), allowed, text, "yes" if _written(page, key) else ""))
    return out


def render() -> str:
    comments = {}
    for module in MODULES:
        comments.update(field_comments(module))
    page = yaml.safe_load(DEFAULT_PARAMS.read_text())
    table = rows(Params, "", comments, page)
    sections: dict[str, list] = {}
    for row in table:
        sections.setdefault(row[0].split(".")[0], []).append(row)
    parts = [
        "# params.yaml reference",
        "",
        "Every setting, its default, what is allowed and what it does. Generated from the schema",
        "(`pipeline/core/params_schema.py`, `pipeline/core/fleet_params.py`) and the ranges in",
        "`pipeline/core/params_checks.py` by `python -m pipeline.core.params_doc`; a test keeps it current.",
        "",
        "`params.yaml` writes out only the settings users change (column *in params.yaml*); every other key",
        "keeps the default below. To change one, add it to `params.yaml` under its section, or run an",
        "experiment with DVC's `+` for a key the file does not write out: `dvc exp run -S +serve.noise_floor=0.05`",
        "(a key the file has: `dvc exp run -S serve.latency_slo_ms=50`). The first stage (`checkpoint`) checks",
        "the whole file before any work and names every problem at once, each with its key, value and fix.",
        "",
    ]
    hints = typing.get_type_hints(Params)
    for name, items in sections.items():
        parts += [f"## {name}", ""]
        section = _section_type(hints[name])
        doc = inspect.getdoc(section[0]) if section else None
        if doc and not doc.startswith(section[0].__name__ + "("):      # a written docstring, not dataclass's
            parts += [" ".join(doc.split()), ""]
        parts += ["| key | default | allowed | what it does | in params.yaml |", "|---|---|---|---|---|"]
        for key, default, allowed, text, written in items:
            cells = [f"`{key}`", default, allowed, text, written]
            parts.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        parts.append("")
    return "\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/params.md is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            print(f"{DOC.relative_to(REPO_ROOT)} is stale: run python -m pipeline.core.params_doc", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(REPO_ROOT)} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
