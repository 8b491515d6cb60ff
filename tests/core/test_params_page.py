"""params.yaml is the user's page (short, every setting commented, its choices the schema's), and
docs/params.md, generated from the schema, lists every key with its default."""
from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import yaml

from pipeline.core import params_doc
from pipeline.core.params import REPO_ROOT
from pipeline.core.params_schema import Params
from pipeline.core.params_typed import schema_paths

PAGES = ["params.yaml"] + sorted(str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.glob("examples/*/params.yaml"))
SCREEN_LINES = 45


def test_the_reference_is_current():
    assert params_doc.main(["--check"]) == 0, "docs/params.md is stale: run python -m pipeline.core.params_doc"


def test_the_reference_lists_every_key_with_its_default():
    text = (REPO_ROOT / "docs" / "params.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \| ([^|]+) \|", text, re.MULTILINE)}
    paths = schema_paths(Params)
    sections = {k for k in paths if any(q.startswith(k + ".") or q.startswith(k + "[") for q in paths)}
    missing = [k for k in paths if k not in rows and k not in sections]
    assert not missing, f"docs/params.md lacks {missing}"
    assert rows["serve.noise_floor"].strip() == "`0.03`" and rows["model.name"].strip() == "**required**"
    undocumented = [k for k in rows if re.search(rf"^\| `{re.escape(k)}` \|[^|]+\|[^|]+\| +\|", text, re.MULTILINE)]
    assert not undocumented, f"keys without a description in the schema's comments: {undocumented}"


def test_params_yaml_fits_on_two_screens():
    lines = (REPO_ROOT / "params.yaml").read_text().splitlines()
    assert len(lines) <= 2 * SCREEN_LINES, f"params.yaml has {len(lines)} lines"


def _choices(path: str) -> dict[str, tuple]:
    """dotted key -> the Literal's choices, for every Literal field of the schema."""
    out = {}

    def walk(cls, prefix):
        import dataclasses
        for f in dataclasses.fields(cls):
            tp, key = typing.get_type_hints(cls)[f.name], f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(tp):
                walk(tp, key)
            elif typing.get_origin(tp) is typing.Literal:
                out[key] = typing.get_args(tp)
    walk(Params, "")
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_setting_on_the_page_is_commented_and_its_choices_are_the_schemas(page):
    lines = (REPO_ROOT / page).read_text().splitlines()
    choices = _choices(page)
    stack: list[tuple[int, str]] = []
    uncommented, wrong = [], []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z_][\w]*):(.*)$", line)
        if not m:
            continue
        indent, name, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([k for _, k in stack] + [name])
        value, _, comment = rest.partition("#")
        if not value.strip():                       # a section
            stack.append((indent, name))
            continue
        if not comment.strip() and not (i and lines[i - 1].strip().startswith("#")) and key in choices:
            uncommented.append(key)
        listed = re.fullmatch(r"\s*([\w-]+(?:\s*\|\s*[\w-]+)+)\b.*", comment)
        if key in choices and listed:
            said = tuple(c.strip() for c in listed.group(1).split("|"))
            if said != choices[key]:
                wrong.append(f"{key}: the comment says {said}, the schema {choices[key]}")
    assert not wrong, wrong
    assert not uncommented, f"settings with choices but no comment: {uncommented}"
    # every page setting has a one-line comment on its line or just above
    data_lines = [l for l in lines if re.match(r"^ *[A-Za-z_]\w*: *[^ #]", l)]
    bare = [l for j, l in enumerate(lines) if l in data_lines and "#" not in l and not lines[j - 1].strip().startswith("#")]
    assert not bare or page != "params.yaml", f"params.yaml settings without a comment: {bare}"
