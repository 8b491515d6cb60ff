"""archive: pack the winner into artifacts/model_store/<name>.mar, and write the recipes of the
references serve_check compares it with: the naive baseline into artifacts/baseline/ and the
hand-tuned ONNX setup into artifacts/handtuned/ (pipeline/serve/reference/handtuned.py). A recipe names the
files its .mar packs where they already lie (the checkpoint, the onnx variant) and stores the small
ones; serve_check packs it while it serves it (pipeline/serve/reference/reference_archives.py).

    python -m stages.archive [--params FILE] [--no-baseline]

Also unpacks the .mar into artifacts/model_store/<name>/ (the folder form, pipeline/decide/store_form.py),
its model files hard links to the variant's. Reads artifacts/selection.json, artifacts/serve/tuning.json
(the served variant: the tune stage's contest may have replaced selection's winner),
artifacts/variants/<variant>/, artifacts/serve/model-config.yaml (+ derivation.json),
artifacts/env.json, metrics/benchmark/onnx.json (the hand-tuned reference's timeouts). Exits non-zero
with one clear message when an input is missing.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional

from pipeline.serve.archive import ArchiveError, build_archive
from pipeline.core.params import ParamsError, load_params
from pipeline.serve.reference.handtuned import build_handtuned
from pipeline.serve.reference.reference_archives import write_baseline
from pipeline.core.paths import (BASELINE_DIR, BENCHMARK_METRICS, ENV_JSON, HANDTUNED_DIR, MODEL_STORE, RAY_SERVE_DIR,
                                 SELECTION_JSON, SERVE_DIR, VARIANTS_DIR)
from pipeline.serve.server.ray_serve_config import write_ray_serve
from pipeline.decide.store_form import unpack_mar

log = logging.getLogger("stages.archive")


def served_variant(serve_dir: Path) -> Optional[str]:
    """The variant the tune stage served and certified (its contest may have replaced selection's
    winner); None without a tuning record: selection's winner then."""
    path = serve_dir / "tuning.json"
    return json.loads(path.read_text()).get("variant") if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=None, help="params file (default: params.yaml)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the naive baseline's recipe")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        params = load_params(args.params)
        t0 = time.perf_counter()
        result = build_archive(params, selection_path=SELECTION_JSON, variants_dir=VARIANTS_DIR,
                               serve_dir=SERVE_DIR, env_path=ENV_JSON, export_dir=MODEL_STORE,
                               variant_name=served_variant(SERVE_DIR))
        log.info("wrote %s (%d files, %.1f MB, handler %s) in %.1f s", result.path, len(result.files),
                 result.bytes / 1e6, result.handler, time.perf_counter() - t0)
        # Both store forms are published: the .mar, and the folder TorchServe can use in place (its
        # model files linked to the variant's: no second copy of the weights).
        t1 = time.perf_counter()
        folder = unpack_mar(result.path, MODEL_STORE / params.model.name, sources=result.sources)
        log.info("unpacked it into %s (the folder model store form) in %.1f s", folder, time.perf_counter() - t1)
        # The second server: Ray Serve serves that folder with the same handler and settings.
        ray = write_ray_serve(params, folder, RAY_SERVE_DIR, benchmarks_dir=BENCHMARK_METRICS)
        log.info("wrote %s/ (Ray Serve: %d replica(s), batch %d, delay %.3f s)", RAY_SERVE_DIR, ray["num_replicas"],
                 ray["max_batch_size"], ray["batch_wait_timeout_s"])
        if not args.no_baseline:
            t1 = time.perf_counter()
            base = write_baseline(params, variants_dir=VARIANTS_DIR, baseline_dir=BASELINE_DIR)
            log.info("wrote the baseline's recipe %s (its .mar: %.1f MB, %.1f MB of them named where they lie) "
                     "in %.1f s", base.dir, base.bytes / 1e6, base.named_bytes / 1e6, time.perf_counter() - t1)
        # The hand-tuned ONNX setup (docs/handtuned.md), recorded here so serve_check measures it beside the winner.
        t1 = time.perf_counter()
        ref = build_handtuned(params, selection_path=SELECTION_JSON, variants_dir=VARIANTS_DIR,
                              derivation_dir=SERVE_DIR, env_path=ENV_JSON, benchmarks_dir=BENCHMARK_METRICS,
                              out_dir=HANDTUNED_DIR)
        if ref is not None:
            log.info("wrote the hand-tuned reference's recipe %s (its .mar: %.1f MB) in %.1f s", ref.dir,
                     ref.bytes / 1e6, time.perf_counter() - t1)
    except (ParamsError, ArchiveError) as e:
        print(f"archive: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/archive.json: wall time + peak memory
    sys.exit(run_timed("archive", main))
