"""The conversion process: `python -m pipeline.build.worker <variant> --out DIR --golden DIR`.

Started by `build.convert_isolated` (never directly by users: `python -m stages.convert <variant>`).
Loads params ($PIPELINE_PARAMS or params.yaml), the checkpoint and the golden set, builds and
verifies the variant, and ALWAYS leaves a conversion.json (an exception → status failed with the
real reason and the traceback tail). Exit code 0 whenever conversion.json was written.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from pipeline.build.builder import CONVERSION_JSON, build_variant, clear_dir, exception_reason, \
    failure_record, traceback_tail, write_json

log = logging.getLogger("convert")


def run(variant: str, out_dir: Path, golden_dir: Path) -> dict:
    converter_cls = dtype = tol = None
    try:
        from pipeline.core.params import load_params
        from pipeline.build.variants.base import get_converter
        from pipeline.accuracy.verify import tolerance_for
        params = load_params()
        converter_cls = get_converter(variant)
        dtype = converter_cls.dtype
        tol = tolerance_for(params, dtype)
        from pipeline.core.paths import ENV_JSON
        from pipeline.build.plan import bounded_golden, make_screen, read_env
        env = read_env(ENV_JSON)
        converter = converter_cls.from_params(params).for_host(env)

        from pipeline.model.checkpoint import load_model
        from pipeline.model.golden import read_golden
        from pipeline.host.device import resolve_device
        device = resolve_device(params.benchmark.device)
        golden = read_golden(golden_dir)
        t0 = time.perf_counter()
        loaded = load_model(params)
        log.info("%s: loaded %s in %.1f s; building for %s", variant, params.model.checkpoint,
                 time.perf_counter() - t0, device)
        golden = bounded_golden(golden, loaded, params, tol)
        screen = make_screen(converter_cls, params, loaded, golden, env, device)
        return build_variant(converter, loaded, golden, out_dir, device, tol,
                             params.conversion.min_topk_agreement, screen=screen)
    except Exception as e:
        clear_dir(out_dir)
        record = failure_record(variant, dtype, tol, exception_reason(e), traceback_tail(e))
        write_json(out_dir / CONVERSION_JSON, record)
        return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.build.worker")
    ap.add_argument("variant")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--golden", required=True, type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run(args.variant, args.out, args.golden)
    return 0


if __name__ == "__main__":
    sys.exit(main())
