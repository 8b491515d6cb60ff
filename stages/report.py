"""report: reports/report.md + self-contained reports/report.html + metrics/summary.json.

    python -m stages.report [--root DIR]

Reads every earlier stage's outputs (docs/artifacts.md); a missing one is named in the report
rather than failing the stage, so a partial pipeline still gets a page.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from pipeline.core.params import REPO_ROOT, ParamsError, load_params
from pipeline.publish.report import write_report
from pipeline.publish.report_inputs import collect_inputs

log = logging.getLogger("stages.report")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(REPO_ROOT),
                        help="folder holding artifacts/ and metrics/; reports/ is written there (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    root = Path(args.root)
    try:
        # --root elsewhere (tests, a copy of the outputs) reads that folder's params.yaml;
        # otherwise the usual lookup ($PIPELINE_PARAMS, else the repo's params.yaml).
        own = root / "params.yaml"
        params = load_params(own if root.resolve() != REPO_ROOT and own.is_file() else None)
        t0 = time.perf_counter()
        inputs = collect_inputs(root, params.model.name, params.serve.latency_slo_ms, params.variants)
        if inputs.missing:
            log.warning("inputs not found (the report says so): %s", ", ".join(inputs.missing))
        files = write_report(inputs, root / "reports", root / "metrics" / "summary.json")
    except (ParamsError, ValueError) as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    log.info("wrote %s, %s (%d plots in %s) and %s in %.1f s", files.markdown, files.html, len(files.images),
             files.markdown.parent / "img", files.summary, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/report.json: wall time + peak memory
    sys.exit(run_timed("report", main))
