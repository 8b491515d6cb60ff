"""benchmark@<variant>: cold load + steady-state curve of one variant on the probed device.

    python -m stages.benchmark <variant>

Writes metrics/benchmark/<variant>.json and artifacts/plots/{curve,throughput,load}/<variant>.json
— always, exit 0: a variant that was not converted is `skipped`, a benchmark that crashes is `failed`, each with the reason. Holds the device lock for
the whole measurement so parallel experiments never share the device.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional

from pipeline.measure.cold import DEFAULT_FEEDS, DEFAULT_LOADER
from pipeline.measure.effort import effort_for
from pipeline.host.device import DeviceError, resolve_device
from pipeline.measure.lock import DeviceBusyError, device_lock
from pipeline.measure.runner import (BenchmarkSettings, benchmark_or_record, curve_rows, load_rows, outcome_record,
                                     throughput_rows)
from pipeline.core.params import ParamsError, load_params
from pipeline.core.paths import BENCHMARK_METRICS, BENCHMARK_PLOTS, ENV_JSON, VARIANTS_DIR

log = logging.getLogger("stages.benchmark")


def benchmark_device(requested: str, env_json: Path) -> str:
    """The device probe resolved (env.json), so this process need not import torch to find out."""
    if requested == "cpu":
        return "cpu"
    if env_json.is_file():
        return json.loads(env_json.read_text())["device"]
    return resolve_device(requested)


def _write_json(path: Path, doc) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def run(variant: str, params, *, variants_dir: Path = VARIANTS_DIR, metrics_dir: Path = BENCHMARK_METRICS,
        plots_dir: Path = BENCHMARK_PLOTS, env_json: Path = ENV_JSON, loader: str = DEFAULT_LOADER,
        feeds: str = DEFAULT_FEEDS, lock_dir: Optional[Path] = None,
        lock_timeout_s: Optional[float] = None) -> dict:
    settings = BenchmarkSettings.from_params(params.benchmark)
    device = "cpu"
    try:
        device = benchmark_device(params.benchmark.device, env_json)
        with device_lock(device, lock_timeout_s, lock_dir) as waited:
            if waited > 1:
                log.info("waited %.1f s for the %s device lock", waited, device)
            t0 = time.monotonic()
            effort = effort_for(variants_dir / variant, variant, settings)
            record = benchmark_or_record(variants_dir / variant, variant, effort.settings, device, loader, feeds)
            record["effort"] = effort.as_dict()
            if effort.why and record["status"] == "ok":
                log.info("%s: measured %s: %s", variant, effort.level, effort.why)
            log.info("%s: %s in %.1f s", variant, record["status"], time.monotonic() - t0)
    except (DeviceError, DeviceBusyError) as e:
        record = outcome_record(variant, "failed", str(e), device, None)
    if record.get("reason"):
        log.warning("%s: %s — %s", variant, record["status"], record["reason"])
    _write_json(metrics_dir / f"{variant}.json", record)
    _write_json(plots_dir / "curve" / f"{variant}.json", curve_rows(record))
    _write_json(plots_dir / "throughput" / f"{variant}.json", throughput_rows(record))
    _write_json(plots_dir / "load" / f"{variant}.json", load_rows(record))
    log.info("wrote %s and plot data under %s", metrics_dir / f"{variant}.json", plots_dir)
    return record


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant")
    a = ap.parse_args(argv)
    try:
        params = load_params()
    except ParamsError as e:
        log.error("%s", e)
        return 2
    if a.variant not in params.variants:
        log.error("variant %r is not in params.yaml `variants` (%s); add it there or pick one of those",
                  a.variant, ", ".join(params.variants))
        return 2
    run(a.variant, params)
    return 0


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/benchmark/<variant>.json: wall time + peak memory
    sys.exit(run_timed("benchmark", main, item=sys.argv[1] if len(sys.argv) > 1 else None))
