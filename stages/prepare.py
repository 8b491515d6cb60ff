"""prepare: validate params, load the checkpoint safely, write the golden set (artifacts/golden/).

    python -m stages.prepare [--out DIR]

Exits non-zero with one clear message on bad params or a bad checkpoint, before any conversion.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from pipeline.core.params import ParamsError, load_params
from pipeline.core.paths import GOLDEN_DIR

log = logging.getLogger("stages.prepare")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(GOLDEN_DIR), help="golden set folder (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        params = load_params()
    except ParamsError as e:          # before importing torch: bad params fail in a fraction of a second
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    from pipeline.model.checkpoint import CheckpointError, load_model
    from pipeline.model.golden import write_golden
    try:
        t0 = time.perf_counter()
        loaded = load_model(params)
        log.info("loaded %s (%s, %s) in %.1f s: inputs %s, outputs %s", params.model.name, params.model.source,
                 params.model.task, time.perf_counter() - t0, [i.name for i in loaded.inputs], loaded.outputs)
        t1 = time.perf_counter()
        golden = write_golden(params, loaded, args.out)
    except (ParamsError, CheckpointError) as e:   # ParamsError: e.g. a pkg: path whose package is missing
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    log.info("wrote %d golden batches (batch sizes %s) and %d HTTP cases to %s in %.1f s",
             len(golden.batches), golden.batch_sizes, len(golden.http_cases), golden.dir, time.perf_counter() - t1)
    return 0


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/prepare.json: wall time + peak memory
    sys.exit(run_timed("prepare", main))
