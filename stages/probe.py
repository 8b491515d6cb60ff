"""probe: write artifacts/env.json, the hardware + library fingerprint the benchmarks depend on.

    python -m stages.probe
"""
from __future__ import annotations

import json
import logging
import os
import sys

from pipeline.host.device import DeviceError
from pipeline.core.params import ParamsError, load_params
from pipeline.core.paths import ENV_JSON, TARGET_JSON
from pipeline.host.probe import fingerprint

log = logging.getLogger("stages.probe")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        params = load_params()
        env = fingerprint(params.benchmark.device)
    except (ParamsError, DeviceError) as e:
        log.error("%s", e)
        return 2
    ENV_JSON.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(env, indent=2, sort_keys=True) + "\n"
    # rewrite only on change, so the file's mtime is stable too
    if not ENV_JSON.exists() or ENV_JSON.read_text() != text:
        ENV_JSON.write_text(text)
    # The fleet target (pipeline/fleet sets PIPELINE_TARGET): the benchmarks depend on it, so their
    # run-cache entries are per target. Only the name: a volatile value would defeat every cache hit.
    target = json.dumps({"target": os.environ.get("PIPELINE_TARGET") or "local"}, indent=2) + "\n"
    if not TARGET_JSON.exists() or TARGET_JSON.read_text() != target:
        TARGET_JSON.write_text(target)
    cpu, gpu = env["cpu"], env["gpu"]
    log.info("device %s (benchmark.device %s); CPU %s, %s physical / %s usable cores; GPU %s; wrote %s",
             env["device"], params.benchmark.device, cpu["model"], cpu["physical_cores"], cpu["usable_cpus"],
             gpu["name"] if gpu else "none", ENV_JSON)
    return 0


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/probe.json: wall time + peak memory
    sys.exit(run_timed("probe", main))
