"""The report: one page that explains the decision, readable offline.

Reads only the outputs of earlier stages (docs/artifacts.md), tolerating any of them being absent
(a stage not run yet, an optional field missing): the page then says what is missing instead of
failing. Renders the same content twice from one list of blocks:

- `reports/report.md`, images as files under `reports/img/`;
- `reports/report.html`, self-contained: the same PNGs inlined as base64 data URIs, no CDN, no JS.

It also writes `metrics/summary.json`, the figures `dvc exp show` / `dvc metrics diff` compare
between experiments: the decision as served at the top (the .mar, the serve check's req/s, p50, p99
and READY at a named load, the SLO verdict, the configuration, the runner-up), the benchmark's
figures under `offline`.

The page opens on the decision (what to deploy, served how, configured how, started how); offline
figures come after it, in sections labelled offline. The work is done in this order, one module each:

1. report_inputs.py    read every earlier stage's outputs into plain data (`collect_inputs`);
2. report_summary.py   decide the summary and the SLO verdict, as plain data (`summary_metrics`);
3. report_plots.py     draw the PNGs;
4. report_decision.py  the first screen: the decision, worded from the summary;
   report_sections.py  the other sections as blocks (offline figures, variants, configuration…), and
   report_serving.py   the served model's (operating point, start-up and memory);
   report_servers.py   TorchServe and Ray Serve side by side (servers);
5. report_render.py    the blocks as markdown and as HTML.

This module holds the page's order (`build_blocks`) and writes the files (`write_report`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.publish import report_sections as sections
from pipeline.publish.report_decision import decision_blocks
from pipeline.publish.report_inputs import ReportInputs
from pipeline.publish.report_plots import draw_plots
from pipeline.publish.report_render import Block, Heading, render_html, render_markdown
from pipeline.publish.report_servers import servers_blocks
from pipeline.publish.report_serving import (quantized_alternative_blocks, rerank_load_blocks, startup_blocks,
                                             tuning_blocks)
from pipeline.publish.report_summary import summary_metrics


def build_blocks(inputs: ReportInputs, summary: dict, images: dict[str, Path]) -> list[Block]:
    """The page, section by section; `summary` is summary_metrics(inputs) (the decision it words)."""
    return [Heading(f"Model optimization report: {inputs.model_name}", 1),
            # The decision first, as served: it is what the reader came for.
            *decision_blocks(inputs, summary),
            # How it was served and decided in TorchServe.
            *sections.serve_check_blocks(inputs),
            *servers_blocks(inputs),
            *rerank_load_blocks(inputs),
            *tuning_blocks(inputs),
            *startup_blocks(inputs),
            # Offline: the benchmark's figures and selection's reasoning.
            *sections.offline_blocks(inputs, summary),
            *quantized_alternative_blocks(inputs),
            *sections.variants_blocks(inputs),
            *sections.verification_blocks(inputs),
            *sections.accuracy_trade_blocks(inputs),
            *sections.plot_blocks(images),
            # How it was built.
            *sections.stage_cost_blocks(inputs),
            *sections.configuration_blocks(inputs),
            *sections.environment_blocks(inputs),
            *sections.missing_blocks(inputs)]


@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    html: Path
    images: dict[str, Path]
    summary: Path


def write_report(inputs: ReportInputs, reports_dir: Path, summary_json: Path) -> ReportFiles:
    """Render plots, report.md, report.html and the summary metrics; returns where each went."""
    summary = summary_metrics(inputs)       # decided once: summary.json and the page say the same
    images = draw_plots(inputs, reports_dir / "img")
    blocks = build_blocks(inputs, summary, images)
    reports_dir.mkdir(parents=True, exist_ok=True)
    md = reports_dir / "report.md"
    md.write_text(render_markdown(blocks, reports_dir))
    page = reports_dir / "report.html"
    page.write_text(render_html(blocks, f"{inputs.model_name}: model optimization report"))
    summary_json.parent.mkdir(parents=True, exist_ok=True)
    summary_json.write_text(json.dumps(summary, indent=2) + "\n")
    return ReportFiles(markdown=md, html=page, images=images, summary=summary_json)
