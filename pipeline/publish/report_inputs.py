"""The report's inputs: every earlier stage's outputs (docs/artifacts.md) read into plain data.

Any of them may be absent (a stage not run yet, an optional field missing): `collect_inputs` lists
what was not there in `ReportInputs.missing` instead of failing, so the page can say so. A corrupt
JSON file is the one real failure. The accessors below read figures out of those inputs
(steady-state curves, cold-load phases, the served variant and batch size) the same way for the
summary, the plots and the page.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from pipeline.publish.kserve import mar_model_version
from pipeline.core.stage_record import read_records
from pipeline.serve.mar import sha256_file


@dataclass
class ReportInputs:
    """Everything the report reads, as plain data; None / empty where a file is absent."""
    model_name: str
    latency_slo_ms: float
    variants: list[str]                                   # params order; eager first by convention
    env: Optional[dict] = None
    conversions: dict[str, dict] = field(default_factory=dict)
    benchmarks: dict[str, dict] = field(default_factory=dict)
    selection: Optional[dict] = None
    derivation: Optional[dict] = None
    model_config: Optional[dict] = None                   # artifacts/serve/model-config.yaml
    config_properties: Optional[str] = None
    start_command: Optional[str] = None
    serve_check: Optional[dict] = None
    tuning: Optional[dict] = None                         # artifacts/serve/tuning.json (the tune stage)
    tuning_metrics: Optional[dict] = None                 # metrics/tuning.json (its figures, committed to git)
    mar: Optional[dict] = None                            # {"path", "bytes", "sha256"}
    stages: list = field(default_factory=list)            # metrics/stages records (pipeline/core/stage_record.py)
    missing: list[str] = field(default_factory=list)      # inputs that were not there (for the page)


# --------------------------------------------------------------------------- reading
def _read_json(path: Path, missing: list[str], root: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        missing.append(rel_path(path, root))
        return None
    except json.JSONDecodeError as e:
        # A corrupt input is a real failure of an earlier stage: say which file and why.
        raise ValueError(f"{path}: not valid JSON ({e}); re-run the stage that writes it "
                         f"(`dvc repro -f <stage>`)") from None


def _read_text(path: Path, missing: list[str], root: Path) -> Optional[str]:
    try:
        return path.read_text()
    except FileNotFoundError:
        missing.append(rel_path(path, root))
        return None


def rel_path(path: Path, root: Path) -> str:
    """`path` relative to `root` where it lies below it, else as given."""
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def collect_inputs(root: Path, model_name: str, latency_slo_ms: float, variants: list[str]) -> ReportInputs:
    """Read every earlier stage's outputs below `root` (the repo root, or a test's tmp dir)."""
    a, m = root / "artifacts", root / "metrics"
    missing: list[str] = []
    inputs = ReportInputs(model_name=model_name, latency_slo_ms=latency_slo_ms, variants=list(variants),
                          missing=missing)
    inputs.env = _read_json(a / "env.json", missing, root)
    for v in variants:
        conv = _read_json(a / "variants" / v / "conversion.json", missing, root)
        if conv is not None:
            inputs.conversions[v] = conv
        bench = _read_json(m / "benchmark" / f"{v}.json", missing, root)
        if bench is not None:
            inputs.benchmarks[v] = bench
    inputs.selection = _read_json(a / "selection.json", missing, root)
    inputs.derivation = _read_json(a / "serve" / "derivation.json", missing, root)
    mc = _read_text(a / "serve" / "model-config.yaml", missing, root)
    inputs.model_config = yaml.safe_load(mc) if mc else None
    inputs.config_properties = _read_text(a / "serve" / "config.properties", missing, root)
    cmd = _read_text(a / "serve" / "start_command.txt", missing, root)
    inputs.start_command = cmd.strip() if cmd else None
    inputs.serve_check = _read_json(m / "serve_check.json", missing, root)
    inputs.tuning = _read_json(a / "serve" / "tuning.json", missing, root)
    inputs.tuning_metrics = _read_json(m / "tuning.json", missing, root)
    inputs.stages = read_records(m / "stages")
    mar = a / "model_store" / f"{model_name}.mar"
    if mar.is_file():
        inputs.mar = {"path": rel_path(mar, root), "bytes": mar.stat().st_size, "sha256": sha256_file(mar),
                      "model_version": mar_model_version(mar)}
    else:
        missing.append(rel_path(mar, root))
    return inputs


# --------------------------------------------------------------------------- figures read out of the inputs
def as_number(x: Any) -> Optional[float]:
    """x as a float when it is a number (a bool is not), else None."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def steady_points(bench: dict, key: str) -> list[tuple[int, float]]:
    """[(batch_size, value)] sorted by batch size, for one steady-state figure (p99_ms, throughput_sps…)."""
    pts = []
    for bs, row in (bench.get("steady") or {}).items():
        if not isinstance(row, dict):
            continue
        val = as_number(row.get(key))
        try:
            b = int(row.get("batch_size", bs))
        except (TypeError, ValueError):
            continue
        if val is not None:
            pts.append((b, val))
    return sorted(pts)


def phase_medians(bench: dict) -> dict[str, float]:
    phases = ((bench.get("cold_load") or {}).get("phases_ms") or {})
    out = {}
    for name, stats in phases.items():
        med = as_number(stats.get("median")) if isinstance(stats, dict) else as_number(stats)
        if med is not None:
            out[name] = med
    return out


def winner(inputs: ReportInputs) -> Optional[str]:
    """The variant that is served: the tune stage's (its contest may have replaced selection's)."""
    return tuning_record(inputs).get("variant") or (inputs.selection or {}).get("winner")


def tuning_record(inputs: ReportInputs) -> dict:
    """The tune stage's record: artifacts/serve/tuning.json, else its figures in metrics/tuning.json
    (committed to git, so a checkout without the DVC cache still has the served verdict and choice)."""
    return inputs.tuning or inputs.tuning_metrics or {}


def _int(x: Any) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def serving_batch_size(inputs: ReportInputs) -> Optional[int]:
    """The batchSize the generated config serves with (model-config.yaml wins: it is what TorchServe reads;
    then the derivation, the tune stage's choice, the settings the serve check found in the server)."""
    mc = inputs.model_config or {}
    if isinstance(mc.get("batchSize"), int):
        return mc["batchSize"]
    for key in ("batchSize", "batch_size"):
        entry = (inputs.derivation or {}).get(key)
        if isinstance(entry, dict) and isinstance(entry.get("value"), int):
            return entry["value"]
    chosen = tuning_record(inputs).get("chosen") or {}
    if _int(chosen.get("batch_size")) is not None:
        return chosen["batch_size"]
    return _int(((inputs.serve_check or {}).get("settings") or {}).get("batchSize"))


def serving_batch_rows(inputs: ReportInputs) -> Optional[int]:
    """Rows per model call the served model runs (model-config.yaml `handler.batch_rows`, else the
    derivation's `batch_rows`, else batchSize: one row per request): the benchmark curve's batch."""
    handler = (inputs.model_config or {}).get("handler") or {}
    if isinstance(handler.get("batch_rows"), int):
        return handler["batch_rows"]
    if isinstance(inputs.model_config, dict) and isinstance(inputs.model_config.get("batchSize"), int):
        return inputs.model_config["batchSize"]
    entry = (inputs.derivation or {}).get("batch_rows")
    if isinstance(entry, dict) and isinstance(entry.get("value"), int):
        return entry["value"]
    chosen = tuning_record(inputs).get("chosen") or {}
    if _int(chosen.get("batch_rows")) is not None:
        return chosen["batch_rows"]
    return serving_batch_size(inputs)


def serving_config(inputs: ReportInputs) -> dict:
    """The configuration the .mar serves with: batch size, rows per call, delay, workers, threads per
    worker, startup and response timeouts, and where they were read (`source`). model-config.yaml
    (packed in the .mar: TorchServe obeys it) wins; then the tune stage's choice (metrics/tuning.json
    `chosen`), then the settings the serve check read back from the running server."""
    mc = inputs.model_config or {}
    chosen = tuning_record(inputs).get("chosen") or {}
    settings = (inputs.serve_check or {}).get("settings") or {}
    handler = mc.get("handler") or {}
    picks = {"batch_size": (mc.get("batchSize"), chosen.get("batch_size"), settings.get("batchSize")),
             "batch_rows": (handler.get("batch_rows"), chosen.get("batch_rows"), None),
             "max_batch_delay_ms": (mc.get("maxBatchDelay"), chosen.get("max_batch_delay_ms"),
                                    settings.get("maxBatchDelay")),
             "workers": (mc.get("maxWorkers", mc.get("minWorkers")), chosen.get("workers"),
                         settings.get("maxWorkers", settings.get("workers"))),
             "threads_per_worker": (handler.get("threads"), chosen.get("threads_per_worker"), None),
             "startup_timeout_s": (mc.get("startupTimeout"), chosen.get("startup_timeout_s"),
                                   settings.get("startupTimeout")),
             "response_timeout_s": (mc.get("responseTimeout"), chosen.get("response_timeout_s"),
                                    settings.get("responseTimeout"))}
    names = ("artifacts/serve/model-config.yaml", "metrics/tuning.json", "metrics/serve_check.json")
    out: dict[str, Any] = {}
    used = set()
    for key, values in picks.items():
        for name, v in zip(names, values):
            if _int(v) is not None:
                out[key] = v
                used.add(name)
                break
        else:
            out[key] = None
    if out["batch_rows"] is None:
        out["batch_rows"] = out["batch_size"]       # one row per request
    out["source"] = ", ".join(n for n in names if n in used) or None
    return out


def expected_concurrency(inputs: ReportInputs) -> Optional[int]:
    """serve.expected_concurrency as the deciding stages recorded it (the tune stage, else selection)."""
    for rec in (inputs.tuning or {}, inputs.tuning_metrics or {},
                ((inputs.selection or {}).get("criteria") or {})):
        if _int(rec.get("expected_concurrency")) is not None:
            return rec["expected_concurrency"]
    return None


def serve_check_load(inputs: ReportInputs) -> Optional[int]:
    """Concurrent clients the serve check measured the winner with, as its record names them
    (references.concurrency / references.load.clients, else the load's own concurrency); None when
    the record does not say."""
    sc = inputs.serve_check or {}
    refs = sc.get("references") or {}
    for v in (refs.get("concurrency"), (refs.get("load") or {}).get("clients"),
              ((sc.get("winner") or {}).get("load") or {}).get("concurrency"), (sc.get("load") or {}).get("concurrency")):
        if _int(v) is not None:
            return v
    return None


def model_bytes(inputs: ReportInputs) -> Optional[int]:
    """The reference model's size: the eager variant's artifact (the checkpoint's weights)."""
    eager = inputs.conversions.get("eager") or inputs.benchmarks.get("eager") or {}
    n = eager.get("artifact_bytes")
    return int(n) if isinstance(n, (int, float)) and n else None
