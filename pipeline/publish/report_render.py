"""The report's document model and its two renderings.

A page is a list of blocks (Heading, Para, Table, Image, Code), rendered twice:

- `render_markdown`: reports/report.md, images as files under reports/img/;
- `render_html`: reports/report.html, self-contained: the same PNGs inlined as base64 data URIs,
  no CDN, no JS.

`fmt` / `fmt_bytes` write a value the way both renderings show it: never a raw dict or list (`plain`
words them), and `scrub` rewrites what a page must not show, whoever wrote the text: a dict repr
inside a message (`{'sample': 0, ...}`) and another machine's absolute paths (a run folder's
`/…/artifacts/x` is written `artifacts/x`, a scratch folder `…/name`). Nothing here decides anything:
the blocks carry the words and figures (pipeline/publish/report_decision.py, report_sections.py,
report_serving.py).
"""
from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.publish.report_inputs import rel_path


# --------------------------------------------------------------------------- document model
@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Para:
    text: str                      # plain text; `code` spans and **bold** are rendered in both formats


@dataclass
class Table:
    header: list[str]
    rows: list[list[Any]]


@dataclass
class Image:
    path: Path                     # the PNG on disk
    alt: str


@dataclass
class Code:
    text: str
    lang: str = ""


Block = Heading | Para | Table | Image | Code


def fmt(x: Any) -> str:
    """A value as a table cell / inline figure shows it ('–' for None, yes/no, 4 significant digits;
    a dict or list in words, never its repr)."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if 0.99 <= x < 1:          # cosines / agreements: the digits that matter are the nines
            return f"{x:.9f}".rstrip("0").rstrip(".")
        return f"{x:.4g}"
    if isinstance(x, (dict, list, tuple)):
        return plain(x)
    return scrub(str(x))


def plain(x: Any, depth: int = 0) -> str:
    """A dict or list in words: `key value; key value`, a list's items joined with commas; nested
    containers deeper than two levels are only counted."""
    if isinstance(x, dict):
        if depth >= 2:
            return f"({len(x)} entries)"
        parts = []
        for k, v in x.items():
            text = plain(v, depth + 1) if isinstance(v, (dict, list, tuple)) else fmt(v)
            parts.append(f"{k} {text}" if not isinstance(v, dict) or depth >= 1 else f"{k}: {text}")
        return "; ".join(parts) if depth == 0 else ", ".join(parts)
    if isinstance(x, (list, tuple)):
        if depth >= 2 and any(isinstance(v, (dict, list, tuple)) for v in x):
            return f"({len(x)} entries)"
        return ", ".join(plain(v, depth + 1) if isinstance(v, (dict, list, tuple)) else fmt(v) for v in x)
    return fmt(x)


def batches_text(counts: Any) -> str:
    """TorchServe's batches formed ({size: count}) in words, largest size first: `213 of 8, 1 of 7`."""
    if not isinstance(counts, dict) or not counts:
        return fmt(counts) if counts else "–"
    def size(kv):
        try:
            return -int(kv[0])
        except (TypeError, ValueError):
            return 0
    return ", ".join(f"{n} of {k}" for k, n in sorted(counts.items(), key=size))


# A dict repr inside a message: {'sample': 0, 'batch': 0} (no nesting), or {"8": 375}.
_DICT_REPR = re.compile(r"\{((?:\s*['\"][^'\"{}]+['\"]\s*:\s*[^,{}]+,?)+)\s*\}")
_REPR_ITEM = re.compile(r"['\"]([^'\"]+)['\"]\s*:\s*([^,]+)")
# Absolute paths of a run folder: /<anything>/artifacts/x is artifacts/x (the repo-relative path)...
_RUN_PATH = re.compile(r"(?<![\w.~/-])/(?:[\w.+@-]+/)+?(?=(?:artifacts|metrics|reports)/)")
# ...and any other machine path under a home, scratch or work folder keeps only its last name.
_MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:home|tmp|work|root|Users|var/folders|private)(?:/[\w.+@-]+)*/([\w.+@-]+)")


def scrub(text: str) -> str:
    """`text` without dict reprs (written `key value, ...`) and without absolute machine paths."""
    text = _DICT_REPR.sub(lambda m: ", ".join(f"{k} {v.strip()}" for k, v in _REPR_ITEM.findall(m.group(1))), text)
    text = _RUN_PATH.sub("", text)
    return _MACHINE_PATH.sub(lambda m: "…/" + m.group(1), text)


def fmt_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "–"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


# --------------------------------------------------------------------------- markdown
def _code_text(blk: Code) -> str:
    """A code block's text with run folders' absolute paths made repo-relative (its braces are the
    file's own: a code block shows a file, not a value)."""
    return _MACHINE_PATH.sub(lambda m: "…/" + m.group(1), _RUN_PATH.sub("", blk.text.rstrip()))


def _md_cell(x: Any) -> str:
    return fmt(x).replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list[Block], md_dir: Path) -> str:
    out = []
    for blk in blocks:
        if isinstance(blk, Heading):
            out.append("#" * blk.level + " " + blk.text)
        elif isinstance(blk, Para):
            out.append(scrub(blk.text))
        elif isinstance(blk, Table):
            out.append("| " + " | ".join(_md_cell(h) for h in blk.header) + " |")
            out.append("|" + "---|" * len(blk.header))
            out.extend("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in blk.rows)
        elif isinstance(blk, Image):
            out.append(f"![{blk.alt}]({rel_path(blk.path, md_dir)})")
        elif isinstance(blk, Code):
            fence = "````" if "```" in blk.text else "```"
            out.append(f"{fence}{blk.lang}\n{_code_text(blk)}\n{fence}")
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------- HTML
def _inline_html(text: str) -> str:
    """Escape, then render `code` and **bold** spans (the only inline markup the blocks use)."""
    s = html.escape(text)
    s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", s)


_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}table{border-collapse:collapse;margin:.8em 0;font-size:.9em}
td,th{border:1px solid #ccc;padding:.25em .5em;vertical-align:top}th{background:#f3f3f3}
pre{background:#f6f8fa;padding:.8em;overflow-x:auto;font-size:.85em}img{max-width:100%;border:1px solid #eee}
code{background:#f6f8fa;padding:0 .2em}h1{border-bottom:2px solid #4e79a7}"""


def data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def render_html(blocks: list[Block], title: str) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"]
    for blk in blocks:
        if isinstance(blk, Heading):
            out.append(f"<h{blk.level}>{html.escape(blk.text)}</h{blk.level}>")
        elif isinstance(blk, Para):
            out.append(f"<p>{_inline_html(scrub(blk.text))}</p>")
        elif isinstance(blk, Table):
            out.append("<table><thead><tr>" + "".join(f"<th>{html.escape(fmt(h))}</th>" for h in blk.header)
                       + "</tr></thead><tbody>")
            out.extend("<tr>" + "".join(f"<td>{_inline_html(fmt(c))}</td>" for c in row) + "</tr>"
                       for row in blk.rows)
            out.append("</tbody></table>")
        elif isinstance(blk, Image):
            # Inlined: the page must open offline, alone, without its img/ folder.
            out.append(f'<figure><img alt="{html.escape(blk.alt)}" src="{data_uri(blk.path)}"></figure>')
        elif isinstance(blk, Code):
            out.append(f"<pre><code>{html.escape(_code_text(blk))}</code></pre>")
    out.append("</body></html>")
    return "\n".join(out)
