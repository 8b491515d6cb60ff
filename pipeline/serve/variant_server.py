"""One variant of one model served in a real TorchServe by the pipeline's own steps, outside `dvc repro`:
prepare's golden set, the variant built and verified against it, a selection naming it, the .mar with
the handler it ships with, config.properties; a `TorchServe` for it (a context manager: always stopped).
The served tests (tests/serve/) and scripts/served_vs_transformers.py stand on it.

    params = parse_params({"model": {...}, "variants": ["eager"], "benchmark": {"batch_sizes": [1, 4]}})
    served = serve_variant(params, workdir)          # workdir/{artifacts,server}
    with served.ts as ts:
        ts.api.predict(b"a text", "text/plain")
    with ray_serve_of(served, params, workdir) as rs:   # the same .mar's folder form on Ray Serve
        rs.api.predict(b"a text", "text/plain")
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pipeline.accuracy.verify import tolerance_for
from pipeline.build.builder import build_variant
from pipeline.build.variants import get_converter
from pipeline.core.params import Params
from pipeline.decide.properties import write_config_properties, write_model_config
from pipeline.model.checkpoint import LoadedModel, load_model
from pipeline.model.golden import Golden, write_golden
from pipeline.decide.store_form import unpack_mar
from pipeline.serve.archive import build_archive
from pipeline.serve.server.ray_serve_config import SERVE_CONFIG, write_ray_serve
from pipeline.serve.server.ray_server import RayServe
from pipeline.serve.server.torchserve import TorchServe

# A small operating point that still batches: 4 concurrent clients fill batches of up to 4 requests.
SERVED = {"batch_size": 4, "max_batch_delay_ms": 50, "workers": 1, "threads_per_worker": 1,
          "response_timeout_s": 60, "startup_timeout_s": 120, "job_queue_size": 200,
          "max_request_size": 4_000_000, "max_response_size": 4_000_000, "max_request_bytes": 4_000_000,
          "device": "cpu"}


class VariantBuildError(RuntimeError):
    """The variant did not convert or verify; the message carries the builder's reason."""


@dataclass
class ServedVariant:
    ts: TorchServe               # not started: `with served.ts as ts:`
    golden: Golden
    loaded: LoadedModel          # the eager model the golden set and the variant were built from
    record: dict                 # the variant's conversion.json
    mar: Path


def serve_variant(params: Params, root: Path, *, variant: str = "eager", settings: Optional[dict[str, Any]] = None,
                  device: str = "cpu") -> ServedVariant:
    """Build `variant` of `params.model` under root/artifacts (verified within its dtype's tolerances), archive
    it, and return its (unstarted) TorchServe."""
    root = Path(root)
    art = root / "artifacts"
    settings = {**SERVED, **(settings or {})}
    loaded = load_model(params)
    golden = write_golden(params, loaded, art / "golden")
    converter = get_converter(variant)
    record = build_variant(converter.from_params(params), loaded, golden, art / "variants" / variant, device,
                           tolerance_for(params, converter.dtype), params.conversion.min_topk_agreement)
    if record["status"] != "converted":
        raise VariantBuildError(f"{variant}: {record['status']}: {record.get('reason')}")
    (art / "selection.json").write_text(json.dumps({"winner": variant, "objective": "throughput", "slo_met": True,
                                                    "message": "serve_variant", "variants": {}}))
    serve_dir = art / "serve"
    serve_dir.mkdir(parents=True, exist_ok=True)
    write_model_config(serve_dir / "model-config.yaml", settings)
    mar = build_archive(params, selection_path=art / "selection.json", variants_dir=art / "variants",
                        serve_dir=serve_dir, env_path=art / "env.json", export_dir=art / "store").path
    config = write_config_properties(serve_dir / "config.properties", settings, model_name=params.model.name,
                                     model_store=mar.parent)
    ts = TorchServe(config, mar.parent, params.model.name, workdir=root / "server")
    return ServedVariant(ts=ts, golden=golden, loaded=loaded, record=record, mar=mar)


def ray_serve_of(served: ServedVariant, params: Params, root: Path) -> RayServe:
    """The same archive on Ray Serve, as the archive stage lays it out: the .mar unpacked (root/store/<name>/),
    its Serve config (root/ray-serve/); the (unstarted) `serve run` of it."""
    root = Path(root)
    folder = unpack_mar(served.mar, root / "store" / params.model.name)
    write_ray_serve(params, folder, root / "ray-serve")
    return RayServe(root / "ray-serve" / SERVE_CONFIG, root / "ray-server", params.model.name)
