"""kserve: artifacts/kserve/{config/config.properties, model-store/<name>.mar, inferenceservice.yaml, resources.json}.

    python -m stages.kserve [--root DIR]

The layout KServe's TorchServe runtime mounts at /mnt/models; upload the folder to the
InferenceService's storageUri (`publish.kserve_storage_uri` in params.yaml).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import yaml

from pipeline.publish.kserve import KServeError, build_layout
from pipeline.core.params import REPO_ROOT, ParamsError, load_params

log = logging.getLogger("stages.kserve")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(REPO_ROOT),
                        help="folder holding artifacts/ (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    root = Path(args.root)
    serve_dir = root / "artifacts" / "serve"
    try:
        # --root elsewhere (tests, a copy of the outputs) reads that folder's params.yaml;
        # otherwise the usual lookup ($PIPELINE_PARAMS, else the repo's params.yaml).
        own = root / "params.yaml"
        params = load_params(own if root.resolve() != REPO_ROOT and own.is_file() else None)
        name = params.model.name
        try:
            model_config = yaml.safe_load((serve_dir / "model-config.yaml").read_text()) or {}
        except FileNotFoundError:
            raise KServeError(f"{serve_dir / 'model-config.yaml'} not found; run `dvc repro configure` first") from None
        derivation_path = serve_dir / "derivation.json"
        derivation = json.loads(derivation_path.read_text()) if derivation_path.is_file() else None
        # The served winner's peak memory per worker in TorchServe: the manifest's memory request.
        check_path = root / "metrics" / "serve_check.json"
        serve_check = json.loads(check_path.read_text()) if check_path.is_file() else None
        layout = build_layout(name, root / "artifacts" / "model_store" / f"{name}.mar", model_config, derivation,
                              root / "artifacts" / "kserve", params.publish.kserve_storage_uri, serve_check)
    except (ParamsError, KServeError) as e:
        print(f"kserve: error: {e}", file=sys.stderr)
        return 2
    for warning in layout.warnings:
        log.warning("%s", warning)
    log.info("wrote KServe layout in %s: %s, %s, %s and %s", layout.root, layout.config_properties, layout.mar,
             layout.manifest, layout.resources)
    return 0


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/kserve.json: wall time + peak memory
    sys.exit(run_timed("kserve", main))
