"""Stage convert@<variant>: `python -m stages.convert <variant> [--out DIR] [--golden DIR]`.

Builds artifacts/variants/<variant>/ (artifact, variant.json, extra files, conversion.json) in its
own process with `conversion.timeout_s`. Exit 0 for every recorded outcome (converted, skipped by
the plan's screen, rejected, failed) except when `eager` — the verified reference — is not converted.
The log line gives conversion, screen and verification seconds separately.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pipeline.core.params import VARIANTS, load_params
from pipeline.build.disk_plan import human
from pipeline.core.paths import GOLDEN_DIR, variant_dir

log = logging.getLogger("stages.convert")


def disk_plan_of(params):
    """The run's disk plan as of now: variants already in the workspace add nothing."""
    from pipeline.build.disk_plan import (built_variants, default_scratch, dvc_cache_settings, plan_run,
                                          weight_bytes)
    from pipeline.build.variants.export_cache import cache_root
    from pipeline.core.params import REPO_ROOT, checkpoint_path
    from pipeline.core.paths import VARIANTS_DIR
    cache, types = dvc_cache_settings(REPO_ROOT)
    return plan_run(weight_bytes(checkpoint_path(params)), params.variants, REPO_ROOT, cache, default_scratch(),
                    cache_root(), types, already_built=built_variants(VARIANTS_DIR, params.variants))


def convert_sharing_the_export(variant: str, params, convert):
    """`convert()` with the ONNX export cache kept only for the builds that read it again
    (pipeline/build/variants/export_cache.py): an ONNX variant's build is told which other ONNX
    variants of this run may read its export, and takes its own mark off every entry when it ends.
    Housekeeping outside the outputs: the converted files never depend on it."""
    from pipeline.build.disk_plan import ONNX_VARIANTS
    from pipeline.build.variants import export_cache
    if variant not in ONNX_VARIANTS:
        return convert()
    before = os.environ.get(export_cache.READERS_ENV)
    os.environ[export_cache.READERS_ENV] = ",".join(
        export_cache.reader_id(v) for v in export_cache.later_readers(params.variants, variant, ONNX_VARIANTS))
    try:
        return convert()          # the build's process inherits the environment
    finally:
        if before is None:
            os.environ.pop(export_cache.READERS_ENV, None)
        else:
            os.environ[export_cache.READERS_ENV] = before
        for entry in export_cache.finished(export_cache.reader_id(variant)):
            log.info("ONNX export cache: removed %s (no later build of this run reads it)", entry)


def is_disk_full(reason: str) -> bool:
    return "No space left on device" in reason or "Errno 28" in reason or "ENOSPC" in reason


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.convert", description=__doc__.splitlines()[0])
    ap.add_argument("variant", choices=VARIANTS)
    ap.add_argument("--out", type=Path, help="variant folder (default artifacts/variants/<variant>)")
    ap.add_argument("--golden", type=Path, default=GOLDEN_DIR, help="golden set folder (default artifacts/golden)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    params = load_params()
    from pipeline.build.variants.base import get_converter
    from pipeline.build.builder import convert_isolated, stage_exit_code
    from pipeline.accuracy.verify import tolerance_for
    dtype = get_converter(args.variant).dtype
    out = args.out or variant_dir(args.variant)
    if args.out is None:
        plan = disk_plan_of(params)
        log.info("disk plan: %s", ", ".join(f"{m}: needs {human(n)}, {human(plan.free[m])} free"
                                            for m, n in plan.required.items()))
        if not plan.ok:
            log.error("%s", plan.message())
            return 2
    log.info("converting %s (timeout %s s) into %s", args.variant, params.conversion.timeout_s, out)
    record = convert_sharing_the_export(args.variant, params, lambda: convert_isolated(
        args.variant, out, args.golden, params.conversion.timeout_s, dtype=dtype, tol=tolerance_for(params, dtype)))
    v = record.get("verification") or {}
    figures = ", ".join(f"{o['name']}: max_abs {o['max_abs']:.3g} min_cos {o['min_cosine']:.6f}"
                        for o in v.get("outputs", []))
    log.info("%s: %s (%s); conversion %s s, screen %s s, verification %s s; %s bytes; batch sizes %s; %s. Wrote %s",
             args.variant, record["status"], record["reason"], record.get("conversion_s"), record.get("screen_s"),
             record.get("verification_s"), record.get("artifact_bytes"), v.get("batch_sizes"),
             figures or "no verification", out)
    code = stage_exit_code(args.variant, record["status"])
    if record["status"] == "failed" and is_disk_full(record.get("reason") or ""):
        # The next conversions would fail the same way: stop the run here, with what to do.
        log.error("%s: the disk filled up while converting. %s", args.variant,
                  disk_plan_of(params).message() if args.out is None else "free space and re-run")
        return 3
    if code:
        log.error("the eager reference variant is %s: the pipeline cannot continue without it", record["status"])
    return code


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/convert/<variant>.json: wall time + peak memory
    sys.exit(run_timed("convert", main, item=sys.argv[1] if len(sys.argv) > 1 else None))
