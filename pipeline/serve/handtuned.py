"""The hand-tuned reference of docs/handtuned.md, built by the pipeline so serve_check can
measure it in the same run, on the same host, as the winner.

It is what a careful engineer sets up by hand: the ONNX fp32 export, graph optimised at build time
and loaded with optimisations off (the project's onnx variant), a handler without torch (the
project's ONNX handler: tokenizers + onnxruntime + numpy), warm-up in initialize, batchSize 8,
maxBatchDelay 5 ms, 2 workers × 1 thread. Everything else (timeouts, limits) is the configure
stage's, so only those four settings differ from a pipeline build of the onnx variant.

Output: artifacts/handtuned/<name>.mar, config.properties, model-config.yaml, handtuned.json (what
it is, or why it could not be built: e.g. the onnx variant is not in `variants` or failed).
"""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Optional

from pipeline.serve.archive import ArchiveError, ArchiveResult, build_archive
from pipeline.core.params import Params
from pipeline.decide.properties import write_config_properties, write_model_config

log = logging.getLogger(__name__)

VARIANT = "onnx"
SETTINGS = {"batch_size": 8, "max_batch_delay_ms": 5, "workers": 2, "threads_per_worker": 1}
RECORD = "handtuned.json"


def _unavailable(out_dir: Path, reason: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RECORD).write_text(json.dumps({"available": False, "reason": reason}, indent=2) + "\n")
    log.warning("hand-tuned reference not built: %s", reason)


def build_handtuned(params: Params, *, selection_path: Path, variants_dir: Path, derivation_dir: Path,
                    env_path: Path, out_dir: Path) -> Optional[ArchiveResult]:
    """Build the reference into `out_dir`; None (and handtuned.json saying why) when the onnx
    variant is not available."""
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
    for key, value in SETTINGS.items():
        derivation[key] = {"value": value, "formula": "hand-tuned reference (shared/reference/measured.md)",
                           "inputs": {}, "overridden": False}
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="handtuned-") as tmp:
        serve = Path(tmp)
        write_model_config(serve / "model-config.yaml", derivation, source="Hand-tuned reference (measured.md).")
        result = build_archive(params, selection_path=selection_path, variants_dir=variants_dir, serve_dir=serve,
                               env_path=env_path, export_dir=out_dir, variant_name=VARIANT)
    write_model_config(out_dir / "model-config.yaml", derivation, source="Hand-tuned reference (measured.md).")
    write_config_properties(out_dir / "config.properties", derivation, model_name=params.model.name,
                            model_store=out_dir.resolve(), source="Hand-tuned reference (measured.md).")
    (out_dir / RECORD).write_text(json.dumps({
        "available": True, "model": params.model.name, "variant": VARIANT, "settings": SETTINGS, "mar": result.path.name,
        "what": "ONNX fp32, graph optimised at build time and loaded with optimisations off, torch-free handler, "
                "warm-up in initialize; batchSize 8, maxBatchDelay 5 ms, 2 workers × 1 thread "
                "(shared/reference/measured.md)"}, indent=2) + "\n")
    return result


def read_handtuned(out_dir: Path) -> dict:
    """handtuned.json, or a record saying the archive stage has not built it."""
    try:
        return json.loads((out_dir / RECORD).read_text())
    except FileNotFoundError:
        return {"available": False, "reason": f"{out_dir / RECORD} is missing; run the archive stage"}
