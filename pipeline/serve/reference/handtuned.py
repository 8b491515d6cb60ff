"""The hand-tuned reference of docs/handtuned.md, built by the pipeline so serve_check can
measure it in the same run, on the same host, as the winner.

It is what a careful engineer sets up by hand: the ONNX fp32 export, graph optimised at build time
and loaded with optimisations off (the project's onnx variant), a handler without torch (the
project's ONNX handler: tokenizers + onnxruntime + numpy), warm-up in initialize, batchSize 8,
maxBatchDelay 5 ms, 2 workers × 1 thread. Its timeouts follow from those settings as the configure
stage derives the winner's (pipeline/decide/serve_config.py), on the onnx variant's own curve
(metrics/benchmark/onnx.json) and the expected load's rows per request: a rerank batch of 8 requests
is 8 × R rows, in model calls of 8 rows, not the winner's batch. Everything else (limits) is the
configure stage's, so only those four settings and the timeouts they imply differ from a pipeline
build of the onnx variant.

Output: artifacts/handtuned/ holding the recipe of <name>.mar (pipeline/serve/reference/reference_archives.py:
recipe.json naming the onnx variant's files, the stored small ones, the handler), config.properties,
model-config.yaml, and handtuned.json (what it is, its timeouts with formula and inputs, or why it
could not be built: e.g. the onnx variant is not in `variants`, failed or has no benchmark).
serve_check packs the .mar in a scratch directory while it serves it.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Optional

from pipeline.serve.archive import ArchiveError, archive_packing
from pipeline.core.params import Params
from pipeline.decide.properties import write_config_properties, write_model_config
from pipeline.decide.serve_config import TIMEOUT_KEYS, DerivationError, point_timeouts, rows_of_derivation
from pipeline.serve.reference.reference_archives import Recipe, write_recipe

log = logging.getLogger(__name__)

VARIANT = "onnx"
SETTINGS = {"batch_size": 8, "max_batch_delay_ms": 5, "workers": 2, "threads_per_worker": 1}
RECORD = "handtuned.json"
# Derived for the reference's own batch, not kept from the configure stage (derived for the winner's).
TIMEOUTS = TIMEOUT_KEYS


def handtuned_timeouts(derivation: dict, benchmark: dict, env: dict, serve: Any) -> dict[str, dict]:
    """responseTimeout and startupTimeout for the hand-tuned SETTINGS, derived by the configure
    stage's own formulas on the onnx variant's benchmark (`point_timeouts`: SETTINGS enter as overrides
    over the user's serve.overrides, which still win for the timeouts themselves), rows per call = its
    batchSize (its yaml sets no batch_rows), rows per request those of `derivation`. Each entry as in
    derivation.json (value, formula, inputs, overridden), its inputs naming the batch it is for."""
    hand = {**SETTINGS, "batch_rows": SETTINGS["batch_size"]}
    derived = point_timeouts(benchmark, env, serve, hand, rows=rows_of_derivation(derivation),
                             label="hand_tuned_batch",
                             about={"benchmark": f"metrics/benchmark/{VARIANT}.json (device {benchmark.get('device')})"})
    out = {}
    for key in TIMEOUTS:
        d = derived[key].as_dict()
        d["formula"] += (f" — for the hand-tuned batch: {SETTINGS['batch_size']} requests × rows_per_request "
                         f"in model calls of {hand['batch_rows']} rows, on the {VARIANT} variant's curve")
        out[key] = d
    return out


def _unavailable(out_dir: Path, reason: str) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)            # the stage owns the folder: nothing stale survives
    out_dir.mkdir(parents=True)
    (out_dir / RECORD).write_text(json.dumps({"available": False, "reason": reason}, indent=2) + "\n")
    log.warning("hand-tuned reference not built: %s", reason)


def build_handtuned(params: Params, *, selection_path: Path, variants_dir: Path, derivation_dir: Path,
                    env_path: Path, benchmarks_dir: Path, out_dir: Path) -> Optional[Recipe]:
    """Write the reference's recipe into `out_dir`; None (and handtuned.json saying why) when the onnx
    variant is not available. `benchmarks_dir`: metrics/benchmark (the onnx variant's curve, for its timeouts)."""
    conversion = variants_dir / VARIANT / "conversion.json"
    if VARIANT not in params.variants:
        _unavailable(out_dir, f"the {VARIANT} variant is not in `variants`; add it to compare with the hand-tuned setup")
        return None
    if not conversion.is_file():
        _unavailable(out_dir, f"{conversion} is missing: the {VARIANT} variant was not converted")
        return None
    status = json.loads(conversion.read_text()).get("status")
    if status != "converted":
        _unavailable(out_dir, f"the {VARIANT} variant has status {status!r} (see {conversion})")
        return None
    try:
        derivation = json.loads((derivation_dir / "derivation.json").read_text())
    except FileNotFoundError:
        raise ArchiveError(f"{derivation_dir / 'derivation.json'} is missing; run the configure stage first") from None
    # Its timeouts: derived for its own batch on the onnx variant's curve (handtuned_timeouts).
    bench_path = benchmarks_dir / f"{VARIANT}.json"
    if not bench_path.is_file():
        _unavailable(out_dir, f"{bench_path} is missing: the {VARIANT} variant was not benchmarked, so the "
                              f"timeouts of the hand-tuned batch cannot be derived")
        return None
    benchmark = json.loads(bench_path.read_text())
    if benchmark.get("status", "ok") != "ok":
        _unavailable(out_dir, f"the {VARIANT} variant's benchmark has status {benchmark.get('status')!r} "
                              f"({bench_path}): {benchmark.get('reason')}")
        return None
    try:
        env = json.loads(env_path.read_text())
    except FileNotFoundError:
        raise ArchiveError(f"{env_path} is missing; run the probe stage first") from None
    try:
        timeouts = handtuned_timeouts(derivation, benchmark, env, params.serve)
    except DerivationError as e:
        _unavailable(out_dir, f"the timeouts of the hand-tuned batch cannot be derived: {e}")
        return None
    for key, value in SETTINGS.items():
        derivation[key] = {"value": value, "formula": "hand-tuned reference (docs/handtuned.md)",
                           "inputs": {}, "overridden": False}
    derivation.update(timeouts)
    # Its model calls are its batchSize, as a handler that counts requests runs them (rows per call:
    # pipeline/decide/rows.py), not the derived rows per call.
    derivation.pop("batch_rows", None)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    source = "Hand-tuned reference (docs/handtuned.md)."
    # The packed model-config.yaml is the one beside the recipe (out_dir is the archive's serve_dir:
    # no derivation.json there, so provenance records none, as for every reference build).
    write_model_config(out_dir / "model-config.yaml", derivation, source=source)
    packing = archive_packing(params, selection_path=selection_path, variants_dir=variants_dir, serve_dir=out_dir,
                              env_path=env_path, variant_name=VARIANT, reference=True)
    props = write_config_properties(out_dir / "config.properties", derivation, model_name=params.model.name,
                                    model_store=out_dir.resolve(), source=source)
    recipe = write_recipe(out_dir, packing, config_properties=props.read_text())  # model_store: set when built
    (out_dir / RECORD).write_text(json.dumps({
        "available": True, "model": params.model.name, "variant": VARIANT, "settings": SETTINGS, "mar": recipe.mar,
        # Derived for its own batch (a rerank batch of 8 queries is 8 × R rows), not the winner's.
        "timeouts": timeouts,
        "what": "ONNX fp32, graph optimised at build time and loaded with optimisations off, torch-free handler, "
                "warm-up in initialize; batchSize 8, maxBatchDelay 5 ms, 2 workers × 1 thread "
                "(docs/handtuned.md)"}, indent=2) + "\n")
    return recipe


def read_handtuned(out_dir: Path) -> dict:
    """handtuned.json, or a record saying the archive stage has not built it."""
    try:
        return json.loads((out_dir / RECORD).read_text())
    except FileNotFoundError:
        return {"available": False, "reason": f"{out_dir / RECORD} is missing; run the archive stage"}
