"""references: the hand-tuned setup and the naive baseline measured in a real TorchServe, once per host,
model, load and recipe (pipeline/serve/reference/references.py).

    python -m stages.references

Reads the recipes artifacts/handtuned/ and artifacts/baseline/ (the archive stage's) and
artifacts/golden/http_cases.json; writes metrics/references.json. The references' .mar files exist
only while served: packed into a scratch directory (.scratch/) removed when the stage ends, by an
error too. dvc.yaml gives this stage exactly the inputs the references depend on, so a `serve.*`
experiment or a new winner reuses the record and serve_check reads it. Exits non-zero only when a
recipe cannot be packed; a reference that fails to serve is recorded as such.
"""
from __future__ import annotations

import json
import logging
import sys

from pipeline.core.params import ParamsError, load_concurrency, load_params
from pipeline.core.paths import BASELINE_DIR, GOLDEN_DIR, HANDTUNED_DIR, REFERENCES_JSON, SCRATCH_DIR
from pipeline.serve.archive import ArchiveError
from pipeline.serve.checks.http_cases import load_http_cases
from pipeline.serve.reference.reference_archives import RECIPE, build_reference, scratch_dir
from pipeline.serve.reference.references import measure_references
from pipeline.serve.serve_check import ServerSpec
from pipeline.serve.server.torchserve import start_command_env

log = logging.getLogger("stages.references")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        params = load_params()
    except ParamsError as e:
        log.error("%s", e)
        return 2
    sc, name = params.serve_check, params.model.name
    try:
        cases = load_http_cases(GOLDEN_DIR / "http_cases.json")
    except (FileNotFoundError, ValueError) as e:
        log.error("%s", e)
        return 2
    if sc.baseline and not (BASELINE_DIR / RECIPE).is_file():
        log.error("%s is missing; run the archive stage, or set serve_check.baseline: false", BASELINE_DIR / RECIPE)
        return 2
    handtuned = handtuned_setup(params)
    clients, clients_from = load_concurrency(params)
    with scratch_dir(SCRATCH_DIR) as scratch:
        specs, built = {}, {}
        try:
            if handtuned.get("available"):
                built["handtuned"] = build_reference(HANDTUNED_DIR, scratch / "handtuned", name)
                specs["handtuned"] = ServerSpec(name, built["handtuned"].store, built["handtuned"].config,
                                                mar=handtuned.get("mar"), env=start_command_env(1))
            else:
                log.warning("hand-tuned reference not measured: %s", handtuned.get("reason"))
            if sc.baseline:
                built["baseline"] = build_reference(BASELINE_DIR, scratch / "baseline", name)
                specs["baseline"] = ServerSpec(name, built["baseline"].store, built["baseline"].config)
        except (ArchiveError, OSError) as e:
            log.error("could not pack the references' archives in %s: %s", scratch, e)
            return 2
        record = measure_references(specs, cases, task=params.model.task, rounds=sc.rounds, requests=sc.requests,
                                    concurrency=clients, time_cap_s=sc.time_cap_s, warmup_s=sc.warmup_s)
    record.update(model=name, handtuned_setup=handtuned, concurrency=clients, concurrency_from=clients_from,
                  host=host_of(), load={"clients": clients, "clients_from": clients_from, "requests": sc.requests,
                                        "time_cap_s": sc.time_cap_s, "warmup_s": sc.warmup_s},
                  reference_archives={"scratch": str(scratch), "removed": not scratch.exists(),
                                      **{k: b.as_record(BASELINE_DIR if k == "baseline" else HANDTUNED_DIR)
                                         for k, b in built.items()}})
    REFERENCES_JSON.parent.mkdir(parents=True, exist_ok=True)
    REFERENCES_JSON.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    for n, s in record["setups"].items():
        log.info("%s: READY %s s, %s req/s, p99 %s ms over %d round(s)", n, s.get("ready_s"), s.get("throughput_rps"),
                 s.get("p99_ms"), len(s.get("rounds") or []))
    log.info("wrote %s in %.0f s", REFERENCES_JSON, record["seconds"])
    return 0


def handtuned_setup(params) -> dict:
    """handtuned.json of the archive stage, or why the hand-tuned reference is not served."""
    from pipeline.serve.reference.handtuned import read_handtuned
    name = params.model.name
    if not params.serve_check.handtuned:
        return {"available": False, "reason": "serve_check.handtuned is false"}
    handtuned = read_handtuned(HANDTUNED_DIR)
    if handtuned.get("available") and handtuned.get("model") != name:
        return {"available": False, "reason": f"{HANDTUNED_DIR} holds model {handtuned.get('model')!r}, not "
                                              f"{name!r}: re-run the archive stage"}
    return handtuned


def host_of() -> dict:
    """The host the references were measured on (artifacts/env.json's CPU and device)."""
    from pipeline.core.paths import ENV_JSON
    try:
        env = json.loads(ENV_JSON.read_text())
    except (OSError, ValueError):
        return {}
    cpu = env.get("cpu") or {}
    return {"cpu": cpu.get("model"), "logical_cores": cpu.get("logical_cores"), "device": env.get("device")}


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/references.json: wall time + peak memory
    from pipeline.measure.lock import measuring          # one experiment measures on a device at a time
    with measuring("references"):
        sys.exit(run_timed("references", main))
