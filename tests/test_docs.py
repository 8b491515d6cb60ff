"""The README is a user's guide and the docs stand alone: the README is short and opens with the two
commands a newcomer runs; every relative link in README.md and docs/ resolves to a file in this
repository; no doc points outside it (the reference notes the project started from are not shipped)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
MAX_README_LINES = 300
DOCS = [README, *sorted((REPO_ROOT / "docs").rglob("*.md"))]

# [text](target) and ![alt](target); the target ends at whitespace or ')' (an optional "title" follows).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)   # http:, https:, mailto:, s3:, …


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


def _outside_code(text: str) -> str:
    """The text with fenced blocks and inline code spans blanked: links are only read in prose."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def _links(path: Path) -> list[str]:
    return LINK.findall(_outside_code(path.read_text(encoding="utf-8")))


def _first_fenced_block(text: str) -> str:
    block, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            if inside:
                return "\n".join(block)
            inside = True
            continue
        if inside:
            block.append(line)
    return ""


def test_docs_are_found():
    names = {_rel(p) for p in DOCS}
    for needed in ("README.md", "docs/architecture.md", "docs/artifacts.md", "docs/handtuned.md"):
        assert needed in names


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move mechanisms to docs/"


def test_readme_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    block = _first_fenced_block(text)
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert "make repro" in commands and "make test" in commands, f"first fenced block:\n{block}"
    # ...and nothing but the title comes before it.
    before = text.split("```", 1)[0]
    prose = [line for line in before.splitlines() if line.strip() and not line.startswith("#")]
    assert not prose, f"text before the two commands: {prose}"


def test_the_two_commands_are_make_targets():
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("repro", "test"):
        assert re.search(rf"^{target}:\s*setup\b", makefile, re.MULTILINE), f"make {target} must set up first"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in _links(doc):
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (doc.parent / path).resolve()
        if not resolved.is_file() or REPO_ROOT not in resolved.parents:
            broken.append(target)
    assert not broken, f"{_rel(doc)}: links that do not resolve to a file in the repository: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_doc_points_outside_the_repository(doc: Path):
    text = doc.read_text(encoding="utf-8")
    for outside in ("measured.md", "shared/"):
        assert outside not in text, f"{_rel(doc)} mentions {outside!r}: the repository must stand alone"


def test_link_reader_reads_links():
    """The checks above are only as good as the link pattern: it must see the forms the docs use."""
    sample = ("See [a](docs/a.md), [b](b.md#part), ![img](img/x.png \"t\") and [web](https://x.org).\n"
              "`[not](in_code.md)`\n```\n[not](in_fence.md)\n```\n")
    assert LINK.findall(_outside_code(sample)) == ["docs/a.md", "b.md#part", "img/x.png", "https://x.org"]


def test_no_source_file_cites_a_file_outside_the_repository():
    """Generated files (config comments, formulas, records) come from the code: it may not cite shared/."""
    offenders = [_rel(p) for root in ("pipeline", "handlers", "stages", "scripts")
                 for p in sorted((REPO_ROOT / root).rglob("*.py"))
                 if any(outside in p.read_text(encoding="utf-8") for outside in ("measured.md", "shared/reference"))]
    assert not offenders, f"source files citing files the repository does not ship: {offenders}"
