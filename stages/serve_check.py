"""serve_check: prove the .mar in a real TorchServe and compare it with the references.

    python -m stages.serve_check

Reads artifacts/model_store/<name>.mar + artifacts/serve/config.properties,
artifacts/golden/http_cases.json and metrics/references.json (the references stage: the hand-tuned
setup and the naive baseline, measured once per host, model, load and recipe); writes
metrics/serve_check.json: the winner's READY, HTTP parity, bad input and load at the expected
concurrency, the server's ceilings served beside it (a do-nothing model at the winner's config), and
the comparison with the references (`references`, measured in their own run: `measured_at` says when).
For task rerank, also a rerank load (`serve_check.rerank_texts` texts per query from `rerank_clients`
clients) in rows/s against the model alone on the same requests, measured right after it
(`rerank_load`). With `servers` listing ray-serve, the same checks and load on the Ray Serve
application (artifacts/ray-serve/), compared side by side (serve_check.json `servers`). Exits non-zero when the model never becomes READY, HTTP parity fails, a request is
lost or gets a 5xx, or bad input is not rejected cleanly.
"""
from __future__ import annotations

import json
import logging
import sys
from typing import Optional

from pipeline.core.params import ParamsError, as_dict, load_concurrency, load_params
from pipeline.core.paths import (GOLDEN_DIR, MODEL_STORE, RAY_SERVE_DIR, REFERENCES_JSON, SERVE_CHECK_JSON, SERVE_DIR,
                                 benchmark_json, variant_dir)
from pipeline.core.numbers import rounded
from pipeline.serve.checks.load import LOAD_KIND
from pipeline.serve.reference.ceiling import (CEILING, CEILING_EMPTY, ceiling_spec, model_alone_rps, served_bound,
                                    served_size_answer, served_variant)
from pipeline.serve.checks.http_cases import load_http_cases, tolerance_from_mar
from pipeline.serve.ray_serve_check import check_ray_serve, compare_servers
from pipeline.serve.server.ray_serve_config import SERVE_CONFIG
from pipeline.serve.reference.references import setups_at_slo
from pipeline.serve.checks.rerank_load import failures_of, measure_rerank_load, rerank_cases
from pipeline.serve.serve_check import ServerSpec, serve_check, with_baseline
from pipeline.serve.server.server_floor import measure_server_floor, readiness_vs_floor
from pipeline.serve.server.startup_check import startup_evidence
from pipeline.serve.server.torchserve import start_command_env
from pipeline.decide.store_form import FORMS, form_of, store_entry

log = logging.getLogger("stages.serve_check")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        params = load_params()
    except ParamsError as e:
        log.error("%s", e)
        return 2
    name = params.model.name
    mar = MODEL_STORE / f"{name}.mar"
    config = SERVE_DIR / "config.properties"
    for path, stage in ((mar, "archive"), (config, "configure")):
        if not path.is_file():
            log.error("%s is missing; run the %s stage first (dvc repro %s)", path, stage, stage)
            return 2
    try:
        cases = load_http_cases(GOLDEN_DIR / "http_cases.json")
    except (FileNotFoundError, ValueError) as e:
        log.error("%s", e)
        return 2
    tol = tolerance_from_mar(mar)
    if tol is None:
        tol = as_dict(params.conversion.tolerances["float32"])
        log.warning("%s has no provenance.json tolerance; using the float32 tolerance %s", mar, tol)
    sc = params.serve_check
    refs = read_references(params)
    if isinstance(refs, str):
        log.error("%s", refs)
        return 2
    derivation_path = SERVE_DIR / "derivation.json"
    derivation = json.loads(derivation_path.read_text()) if derivation_path.is_file() else None
    form = form_of(derivation)
    env = start_env(SERVE_DIR)
    # The chosen store form gets every check; the other one (when published) its READY, same run.
    forms = {f: ServerSpec(name, MODEL_STORE, config, mar=store_entry(name, f), env=env) for f in FORMS
             if (MODEL_STORE / store_entry(name, f)).exists()}
    if form not in forms:
        log.error("%s is missing (derivation.json chose the %s store form); re-run the archive stage",
                  MODEL_STORE / store_entry(name, form), form)
        return 2
    alternate = next((spec for f, spec in forms.items() if f != form), None)
    record = serve_check(forms[form], None, cases, task=params.model.task,
                         atol=float(tol["atol"]), rtol=float(tol["rtol"]), gate=tol, requests=sc.requests,
                         concurrency=load_concurrency(params)[0], time_cap_s=sc.time_cap_s, warmup_s=sc.warmup_s,
                         alternate=alternate, store_form=form, startup=startup_evidence(derivation))
    with_baseline(record, refs.get("baseline_detail") if sc.baseline else None)
    if "ray-serve" in params.servers:
        # The second server, the same checks and load, right after TorchServe's (pipeline/serve/ray_serve_check.py).
        ray = check_ray_serve(name, RAY_SERVE_DIR / SERVE_CONFIG, cases, task=params.model.task,
                              atol=float(tol["atol"]), rtol=float(tol["rtol"]), gate=tol, requests=sc.requests,
                              concurrency=load_concurrency(params)[0], time_cap_s=sc.time_cap_s, warmup_s=sc.warmup_s)
        compare_servers(record, ray, slo_ms=params.serve.latency_slo_ms, concurrency=load_concurrency(params)[0])
    if record["ok"] and params.model.task == "rerank":
        # Issue 26: rows/s of a rerank load against the model's own rows/s at the batches it formed.
        record["rerank_load"] = rerank_load(params, forms[form], derivation)
        record["failures"] += failures_of(record["rerank_load"])
        record["ok"] = not record["failures"]
    if record["ok"]:
        record["references"] = references(params, forms[form], record, cases, refs)
    record["reference_archives"] = refs.get("reference_archives")
    # The server's own floor, as the model is served (pipeline/serve/server/server_floor.py): READY is judged
    # against floor + raw read of the artifact. The empty-answer ceiling served in the references'
    # rounds is that start already (a do-nothing model, the served config, workers and environment,
    # after the run's earlier starts); only without it is a do-nothing model started for it.
    workers = workers_in_derivation(derivation)
    floor = floor_from_ceiling(record.get("references"), workers)
    if floor:
        log.info("server floor: the empty-answer ceiling's start, a do-nothing model, %d worker(s), READY in %.2f s "
                 "(WorkerLoadTime %s ms)", workers, floor["ready_s"], floor["worker_load_ms"])
    else:
        floor = measure_server_floor(workers=workers, config=config, env=env)
    record["server_floor"] = floor
    if record["ready"]:
        raw_read_ms = (((derivation or {}).get("startup_timeout_s") or {}).get("inputs") or {}).get("raw_read_ms")
        record["ready_vs_floor"] = readiness_vs_floor(record["ready_s"], record["server_floor"], raw_read_ms)
    SERVE_CHECK_JSON.parent.mkdir(parents=True, exist_ok=True)
    SERVE_CHECK_JSON.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    r = record["ratios"]
    log.info("wrote %s: READY %.2f s, parity %s, %d/%d ok, p99 %s ms, %s req/s; ratios vs baseline: "
             "load %s, throughput %s, p99 %s", SERVE_CHECK_JSON, record["ready_s"] or float("nan"),
             record["parity_ok"], record["requests_ok"], record["requests_sent"], rounded(record["p99_ms"]),
             rounded(record["throughput_rps"]), rounded(r["load"]), rounded(r["throughput"]), rounded(r["p99"]))
    if not record["ok"]:
        for f in record["failures"]:
            log.error("serve_check failed: %s", f)
        return 1
    return 0


def floor_from_ceiling(references: Optional[dict], workers: int) -> Optional[dict]:
    """The server floor from the empty-answer ceiling's starts in the references' rounds (a do-nothing
    model served as the model is: the served config.properties, model-config.yaml's workers, the
    start command's environment; after the run's earlier starts, so primed): the fastest READY. None
    when it was not served."""
    rounds = ((((references or {}).get("setups") or {}).get(CEILING_EMPTY) or {}).get("rounds")) or []
    ready = [r for r in rounds if r.get("ok") and r.get("ready_s") is not None]
    if not ready:
        return None
    best = min(ready, key=lambda r: r["ready_s"])
    return {"ready": True, "ready_s": best["ready_s"], "worker_load_ms": best.get("worker_load_ms"),
            "workers": workers, "primed": True, "measured_by": CEILING_EMPTY}


def read_references(params):
    """metrics/references.json of the references stage, or the message saying what to run. A record
    of another model, load or set of references is stale: the references stage runs first in dvc repro."""
    sc = params.serve_check
    if not (sc.baseline or sc.handtuned):
        return {}
    try:
        refs = json.loads(REFERENCES_JSON.read_text())
    except (OSError, ValueError) as e:
        return f"{REFERENCES_JSON} is missing or unreadable ({e}); run the references stage (dvc repro references)"
    clients = load_concurrency(params)[0]
    wanted = {"model": params.model.name, "concurrency": clients}
    stale = {k: refs.get(k) for k, v in wanted.items() if refs.get(k) != v}
    if sc.baseline and "baseline" not in (refs.get("setups") or {}):
        stale["setups"] = sorted(refs.get("setups") or {})
    if stale:
        return (f"{REFERENCES_JSON} was measured for {stale}, not {wanted}; re-run the references stage "
                f"(dvc repro references)")
    return refs


def references(params, winner: ServerSpec, record: dict, cases, refs: dict) -> dict:
    """The winner and the server's ceilings (a do-nothing handler served as the model is) in rounds
    (pipeline/serve/reference/reference_rounds.py; the checks already run count as round 1), beside the
    hand-tuned setup and the naive baseline as the references stage measured them."""
    from pipeline.serve.reference.reference_rounds import interleaved_rounds, ratios
    sc, name = params.serve_check, params.model.name
    specs, first = {"winner": winner}, {"winner": record["winner"]}
    if (SERVE_DIR / "model-config.yaml").is_file():
        specs[CEILING] = ceiling_spec(name, SERVE_DIR / "model-config.yaml", winner.config, env=winner.env,
                                      answer=served_size_answer([c.expected for c in cases]))
        specs[CEILING_EMPTY] = ceiling_spec(name, SERVE_DIR / "model-config.yaml", winner.config, env=winner.env)
    earlier = model_alone_before(name)
    clients, clients_from = load_concurrency(params)
    setups = interleaved_rounds(specs, cases, task=params.model.task, rounds=sc.rounds, requests=sc.requests,
                                concurrency=clients, time_cap_s=sc.time_cap_s,
                                slo_ms=params.serve.latency_slo_ms, first_round=first,
                                decided_band=sc.decided_band, warmup_s=sc.warmup_s,
                                uncompared=frozenset({CEILING, CEILING_EMPTY}))
    wanted = {"handtuned"} if sc.handtuned else set()
    setups.update({k: v for k, v in setups_at_slo(refs, params.serve.latency_slo_ms).items()
                   if k in wanted | ({"baseline"} if sc.baseline else set())})
    handtuned = refs.get("handtuned_setup") or {"available": False, "reason": "serve_check.handtuned is false"}
    if "handtuned" not in setups:
        log.warning("hand-tuned reference not measured: %s", handtuned.get("reason"))
    out = {"rounds": sc.rounds, "decided_band": sc.decided_band,
           "rounds_served": {n: len(s_["rounds"]) for n, s_ in setups.items()}, "concurrency": clients,
           "concurrency_from": clients_from, "latency_slo_ms": params.serve.latency_slo_ms,
           "handtuned_setup": handtuned,
           "setups": setups,
           "ratios_handtuned": ratios(setups["winner"], setups["handtuned"]) if "handtuned" in setups else None,
           "ratios_baseline": ratios(setups["winner"], setups["baseline"]) if "baseline" in setups else None,
           "measured": {"winner": "this run", "references": refs.get("measured_at"),
                        "references_host": refs.get("host"), "references_seconds": refs.get("seconds"),
                        "from": str(REFERENCES_JSON.relative_to(REFERENCES_JSON.parents[1])),
                        "interleaved_with_winner": False}}
    out["load"] = {"clients": clients, "clients_from": clients_from, "connections": "keep-alive, one per client (as production clients hold them)",
                   "client": LOAD_KIND, "warmup_s": sc.warmup_s, "requests": sc.requests, "time_cap_s": sc.time_cap_s,
                   "bodies": "the golden HTTP cases, cycled (the task's example requests)"}
    out["bound"] = bound_of(name, setups, cases, earlier)
    if out["ratios_handtuned"]:
        log.info("winner / hand-tuned (measured %s): %s", refs.get("measured_at"), out["ratios_handtuned"])
    b = out["bound"]
    log.info("served %s req/s of a bound %s (ceiling %s, model alone %s): %s", b["served_rps"], b["bound_rps"],
             b["ceiling_rps"], b["model_alone_rps"], b["served_vs_bound"])
    return out


def rerank_load(params, winner: ServerSpec, derivation: Optional[dict]) -> dict:
    """The winner under `serve_check.rerank_texts` texts per query from `rerank_clients` keep-alive
    clients: rows/s served, the model alone's rows/s on the same requests measured right after it
    (the benchmark's figure at the calls it formed beside it), their ratio (pipeline/serve/checks/rerank_load.py)."""
    sc = params.serve_check
    derivation = derivation or {}
    batch_rows = int(_value(derivation, "batch_rows") or _value(derivation, "batch_size") or 1)
    variant, bench = served_benchmark(params.model.name)
    workers = workers_in_derivation(derivation)
    # A query over the served cap (model.text.max_texts) would only be answered 413.
    texts = min(sc.rerank_texts, params.model.text.max_texts)
    if texts < sc.rerank_texts:
        log.warning("rerank load: %d texts per query, not serve_check.rerank_texts %d: the served cap "
                    "model.text.max_texts is %d", texts, sc.rerank_texts, params.model.text.max_texts)

    def alone(cases, batch: int) -> dict:
        # The served variant alone on the load's own requests, model calls of the served batch_rows.
        if not variant:
            return {"ok": False, "errors": [f"no served variant found in {MODEL_STORE} for {params.model.name}"]}
        return run_model_alone(variant, batch, workers, cases=cases, batch_rows=batch_rows)

    return measure_rerank_load(winner, rerank_cases(GOLDEN_DIR, texts), clients=sc.rerank_clients,
                               requests=sc.requests, time_cap_s=sc.time_cap_s, warmup_s=sc.warmup_s,
                               batch_rows=batch_rows, workers=workers, benchmark=bench, variant=variant,
                               configured_batch=_value(derivation, "batch_size"), model_alone=alone)


def _value(derivation: dict, key: str):
    return (derivation.get(key) or {}).get("value") if isinstance(derivation.get(key), dict) else None


def served_benchmark(name: str) -> tuple[Optional[str], dict]:
    """The variant the archive packed and its benchmark record ({} when absent)."""
    variant = served_variant(MODEL_STORE, name)
    bench_path = benchmark_json(variant) if variant else None
    return variant, (json.loads(bench_path.read_text()) if bench_path and bench_path.is_file() else {})


def model_alone_before(name: str) -> Optional[dict]:
    """The first of the model-alone measurements, taken before the rounds (bound_of takes the second)."""
    derivation_path = SERVE_DIR / "derivation.json"
    derivation = json.loads(derivation_path.read_text()) if derivation_path.is_file() else {}
    batch, variant = _value(derivation, "batch_size"), served_benchmark(name)[0]
    return measured_model_alone(variant, int(batch), workers_in_derivation(derivation)) if batch and variant else None


def bound_of(name: str, setups: dict, cases: list, earlier: Optional[dict] = None) -> dict:
    """Served vs what the server and the model together permit (pipeline/serve/reference/ceiling.py), in
    requests/s: the model alone measured in this run on the served requests, else the benchmark's
    rows/s at the served rows per model call ÷ rows per request (pipeline/decide/rows.py)."""
    derivation_path = SERVE_DIR / "derivation.json"
    derivation = json.loads(derivation_path.read_text()) if derivation_path.is_file() else {}
    batch = _value(derivation, "batch_size")                         # requests per server batch
    rows = _value(derivation, "batch_rows") or batch                  # rows per model call
    rows_per_request = float(_value(derivation, "rows_per_request") or 1.0)
    workers = workers_in_derivation(derivation)
    variant, bench = served_benchmark(name)
    benchmarked = model_alone_rps(bench, int(rows), workers, rows_per_request) if rows else None
    measured = measured_model_alone(variant, int(batch), workers) if batch and variant else None
    # Measured before and after the rounds: a bound is what the host allows, so the faster of the
    # two (the other saw more of the host's drift or a neighbour's work); both are recorded.
    samples = [m for m in (earlier, measured) if m and m.get("value")]
    if samples:
        measured = dict(max(samples, key=lambda m: m["value"]),
                        samples_rps=[m["value"] for m in samples],
                        why="the faster of the measurements before and after the rounds")
    model = measured if measured and measured.get("value") else benchmarked
    ceiling = (setups.get(CEILING) or {}).get("throughput_rps")
    out = served_bound((setups.get("winner") or {}).get("throughput_rps"), ceiling, model)
    out["variant"] = variant
    out["ceiling_answer_bytes"] = len(served_size_answer([c.expected for c in cases])) if cases else None
    out["ceiling_empty_rps"] = rounded((setups.get(CEILING_EMPTY) or {}).get("throughput_rps"), 2)
    out["model_alone_benchmark"] = benchmarked
    return out


def measured_model_alone(variant: str, batch: int, workers: int) -> Optional[dict]:
    """The served variant alone on the served requests (the golden HTTP cases), now, in requests/s."""
    r = run_model_alone(variant, batch, workers)
    if not r.get("ok"):
        log.warning("model alone not measured in this run (%s): the bound uses the benchmark's figure", r.get("errors"))
        return None
    return {"value": r["requests_per_s"], "rows_per_s": r["rows_per_s"], "batch_size": batch, "workers": workers,
            "threads_per_process": r.get("threads_per_process"), "measured": r,
            "formula": "the served variant in `workers` processes at once on the served requests, "
                       "in server batches of batch_size requests, this run (requests/s)"}


def run_model_alone(variant: str, batch: int, workers: int, *, cases=None, batch_rows: Optional[int] = None) -> dict:
    """pipeline/serve/checks/model_alone.py's record: the served variant in `workers` processes, run as
    model-config.yaml says the workers run it (threads, device, rows per model call), on `cases`
    (HttpCase list) or else the golden HTTP cases, in server batches of `batch` requests."""
    import yaml
    from pipeline.serve.checks.model_alone import measure, measure_cases
    path = SERVE_DIR / "model-config.yaml"
    handler = ((yaml.safe_load(path.read_text()) or {}).get("handler") or {}) if path.is_file() else {}
    threads = handler.get("threads") or None
    device = handler.get("device") if handler.get("device") in ("cpu", "cuda") else "cpu"
    rows = int(batch_rows or handler.get("batch_rows") or batch)
    kw = dict(batch_size=batch, batch_rows=rows, workers=workers, threads=threads, device=device)
    if cases is not None:
        return measure_cases(variant_dir(variant), cases, **kw)
    return measure(variant_dir(variant), GOLDEN_DIR / "http_cases.json", **kw)


def workers_in_derivation(derivation: Optional[dict]) -> int:
    """The worker count configure derived (derivation.json), 1 when unknown."""
    value = ((derivation or {}).get("workers") or {}).get("value")
    return int(value) if value else 1


def start_env(serve_dir) -> dict:
    """The environment of the generated start command (thread counts from model-config.yaml's
    `handler.threads`), so the server runs as it will be deployed."""
    import yaml

    path = serve_dir / "model-config.yaml"
    cfg = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    threads = (cfg.get("handler") or {}).get("threads")
    return start_command_env(int(threads)) if threads else {}


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/serve_check.json: wall time + peak memory
    from pipeline.measure.lock import measuring          # one experiment measures on a device at a time
    with measuring("serve_check"):
        sys.exit(run_timed("serve_check", main))
