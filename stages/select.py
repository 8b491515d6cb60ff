"""select: choose one variant from the verification and benchmark records (artifacts/selection.json).

    python -m stages.select [--out FILE]

Always writes one decision. Exits non-zero only when nothing can be served, or when
serve.require_slo is true and no variant meets the constraints.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Optional

from pipeline.core.params import ParamsError, load_params
from pipeline.core.paths import BENCHMARK_METRICS, ENV_JSON, GOLDEN_DIR, SELECTION_JSON, VARIANTS_DIR
from pipeline.decide.rows import rows_of_cases
from pipeline.decide.selection import Criteria, SelectionError, check_decision, select
from pipeline.decide.serve_config import served_workers

log = logging.getLogger("stages.select")


def _read(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        log.warning("%s is not valid JSON (%s): treating the variant as failed", path, e)
        return {"status": "failed", "reason": f"{path} is not valid JSON: {e}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(SELECTION_JSON), help="decision file (default: %(default)s)")
    parser.add_argument("--variants-dir", default=str(VARIANTS_DIR), help="conversion records (default: %(default)s)")
    parser.add_argument("--benchmarks-dir", default=str(BENCHMARK_METRICS),
                        help="benchmark records (default: %(default)s)")
    parser.add_argument("--env", default=str(ENV_JSON), help="probed host, for the worker count (default: %(default)s)")
    parser.add_argument("--golden", default=str(GOLDEN_DIR),
                        help="golden set, for the rows per request of the load (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        params = load_params()
    except ParamsError as e:
        print(f"select: error: {e}", file=sys.stderr)
        return 2
    # Judged under the expected load's rows per request (a rerank request is many rows).
    criteria = dataclasses.replace(Criteria.from_serve(params.serve),
                                   rows_per_request=rows_of_cases(Path(args.golden))["rows_per_request"])
    conversions = {v: _read(Path(args.variants_dir) / v / "conversion.json") for v in params.variants}
    benchmarks = {v: _read(Path(args.benchmarks_dir) / f"{v}.json") for v in params.variants}
    env = _read(Path(args.env))

    # configure's worker count, so each variant is judged at the batch it would be served at
    # (select asks only for variants whose steady curve it could read)
    decision = select(params.variants, conversions, benchmarks, criteria,
                      lambda benchmark: served_workers(benchmark, env, params.serve))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(decision, indent=2) + "\n")
    for v, rec in decision["variants"].items():
        f = rec["figures"]
        figs = (f"batch {f['batch_size']}, p99/request {f['request_p99_ms']:.1f} ms, {f['throughput_sps']:.1f} "
                f"samples/s, noise {f['noise']:.3f}, {f['worker_memory_mb'] or 0:.0f} MB, cold {f['cold_load_median_ms']:.0f} ms"
                if "throughput_sps" in f else "no measurements")
        log.info("%-10s %-8s %s%s", v, rec["status"], figs,
                 ("  — " + "; ".join(rec["reasons"])) if rec["reasons"] else "")
    if decision["slo_met"]:
        log.info("decision: %s", decision["message"])
    else:
        print(f"select: WARNING: {decision['message']}", file=sys.stderr)
    log.info("wrote %s", out)
    try:
        check_decision(decision, params.serve.require_slo)
    except SelectionError as e:
        print(f"select: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/select.json: wall time + peak memory
    sys.exit(run_timed("select", main))
