"""Where every stage reads and writes. Public paths (named in the README) must stay stable."""
from __future__ import annotations

from pathlib import Path

from pipeline.core.params import REPO_ROOT

ARTIFACTS = REPO_ROOT / "artifacts"
METRICS = REPO_ROOT / "metrics"
REPORTS = REPO_ROOT / "reports"

CHECKPOINT_JSON = ARTIFACTS / "checkpoint.json"      # checkpoint: the checkpoint's files and their sha256
ENV_JSON = ARTIFACTS / "env.json"                    # probe: hardware + library fingerprint
TARGET_JSON = ARTIFACTS / "target.json"              # probe: the fleet target this run is for ($PIPELINE_TARGET)
GOLDEN_DIR = ARTIFACTS / "golden"                    # prepare: inputs + eager fp32 reference outputs
VARIANTS_DIR = ARTIFACTS / "variants"                # convert@<variant>: one folder per variant
BENCHMARK_METRICS = METRICS / "benchmark"            # benchmark@<variant>: <variant>.json
BENCHMARK_PLOTS = ARTIFACTS / "plots"                # plot data (csv/json) for dvc plots
SELECTION_JSON = ARTIFACTS / "selection.json"        # select
CONFIGURED_DIR = ARTIFACTS / "configured"            # configure: the offline proposal (same files as serve/)
CONTENDERS = "contenders"                              # configured/contenders/<variant>/: variants tied with the winner
SERVE_DIR = ARTIFACTS / "serve"                      # tune: config.properties, model-config.yaml, derivation.json, tuning.json
TUNING_METRICS = METRICS / "tuning.json"             # tune: duration, served verdict, chosen point
HANDTUNED_DIR = ARTIFACTS / "handtuned"              # archive: the hand-tuned ONNX reference (recipe of <name>.mar + config.properties)
MODEL_STORE = ARTIFACTS / "model_store"              # archive: <name>.mar
RAY_SERVE_DIR = ARTIFACTS / "ray-serve"              # archive: serve_config.yaml (serve run) + rayservice.yaml (KubeRay)
BASELINE_DIR = ARTIFACTS / "baseline"                # archive: the naive baseline (recipe of <name>.mar + config.properties)
SCRATCH_DIR = REPO_ROOT / ".scratch"                 # references: the references' .mar while served (removed after)
REFERENCES_JSON = METRICS / "references.json"       # references: the hand-tuned setup and the baseline, served
SERVE_CHECK_JSON = METRICS / "serve_check.json"      # serve_check
KSERVE_DIR = ARTIFACTS / "kserve"


def variant_dir(variant: str) -> Path:
    return VARIANTS_DIR / variant


def benchmark_json(variant: str) -> Path:
    return BENCHMARK_METRICS / f"{variant}.json"
