"""tune: serve candidate operating points in a real TorchServe under the expected load, keep the one
that serves best, and give the served SLO verdict (artifacts/serve/ + metrics/tuning.json).

    python -m stages.tune

Reads the configure stage's proposal (artifacts/configured/), the winner's variant folder and
benchmark curve, artifacts/golden/http_cases.json (the load) and artifacts/env.json. Writes
artifacts/serve/{derivation.json, model-config.yaml, config.properties, start_command.txt,
tuning.json}: what archive, serve_check, report and kserve use. Exits 1 when serve.require_slo is
true and the served p99 misses the SLO (the message says why, in numbers), 2 on missing inputs.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pipeline.serve.archive import ArchiveError, build_archive
from pipeline.core.params import ParamsError, load_params
from pipeline.core.paths import (BENCHMARK_METRICS, CONFIGURED_DIR, CONTENDERS, ENV_JSON, GOLDEN_DIR, MODEL_STORE, SELECTION_JSON,
                            SERVE_DIR, TUNING_METRICS, VARIANTS_DIR)
from pipeline.decide.properties import ConfigWriteError, write_serve_files
from pipeline.decide.selection import tied_contenders
from pipeline.serve.checks.http_cases import load_http_cases
from pipeline.decide.serve_config import (DerivationError, curve_from_benchmark, rows_of_derivation, usable_cores,
                                          values)
from pipeline.serve.tune.candidates import FRONTEND_CANDIDATES, candidates_from_curve, with_timeouts
from pipeline.serve.tune.decision import TuningError
from pipeline.serve.tune.tuner import ServedModel
from pipeline.serve.tune.tuning import (Contender, TuneSettings, frontend_properties, progress_bar, tune, tuned_derivation,
                                   variant_contest)

log = logging.getLogger("stages.tune")


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise TuningError(f"{path} not found ({what}); run the earlier stages: `dvc repro tune`")
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        params = load_params()
        serve, t, name = params.serve, params.tune, params.model.name
        selection = _read_json(SELECTION_JSON, "the select stage's decision")
        winner = selection.get("winner")
        if not winner:
            raise TuningError(f"{SELECTION_JSON}: no winner — {selection.get('message')}")
        configured = _read_json(CONFIGURED_DIR / "derivation.json", "the configure stage's derivation")
        model_store = serve.model_store or str(MODEL_STORE.resolve())
        source = f"Winner: {winner} (objective {selection.get('objective')}, SLO {serve.latency_slo_ms:g} ms)."
        if not t.enabled:
            record = {"enabled": False, "slo_met": selection.get("slo_met"),
                      "basis": "offline prediction (tune.enabled is false: nothing was served)",
                      "message": selection.get("message"), "duration_s": 0.0, "variant": winner}
            derivation = configured
        else:
            env = _read_json(ENV_JSON, "the probe stage's environment")
            cases = load_http_cases(GOLDEN_DIR / "http_cases.json")
            proposals = {winner: CONFIGURED_DIR}
            for folder in sorted((CONFIGURED_DIR / CONTENDERS).glob("*/derivation.json")):
                proposals.setdefault(folder.parent.name, folder.parent)
            ranked = [winner] + [v for v in tied_contenders(selection) if v in proposals]
            contenders = ranked[:t.contenders]
            settings = TuneSettings(latency_slo_ms=serve.latency_slo_ms, objective=serve.objective,
                                    min_gain=serve.min_batch_gain, expected_concurrency=serve.expected_concurrency,
                                    rounds=t.rounds, measure_s=t.measure_s, warmup_requests=t.warmup_requests,
                                    frontend=t.frontend, max_rounds=t.max_rounds)
            t_build = time.monotonic()
            with tempfile.TemporaryDirectory(prefix="tune-store-") as tmp:
                store = Path(tmp) / "store"
                contest = None
                if len(contenders) > 1:
                    contest = run_contest(params, env, proposals, contenders, cases, settings, store, Path(tmp))
                chosen = contest["chosen"] if contest else winner
                candidates, benchmark = operating_candidates(params, env, proposals[chosen], chosen)
                log.info("candidates for %s: %s", chosen, "; ".join(f"{c.name} ({c.describe()})" for c in candidates))
                settings = dataclasses.replace(
                    settings, side_by_side=fits_side_by_side(candidates, benchmark, env, serve.memory_share))
                model = served_model(params, proposals[chosen], chosen, store)
                build_s = time.monotonic() - t_build - (contest["duration_s"] if contest else 0.0)
                record = tune(model, cases, candidates, settings, workroot=Path(tmp) / "servers")
            record["variant"] = chosen
            record["variant_contest"] = contest
            if contest:
                record["duration_s"] = round(record["duration_s"] + contest["duration_s"], 1)
                record["server_starts"] += contest["server_starts"]
            record["build_s"] = round(build_s, 2)
            record["predicted_slo_met"] = selection.get("slo_met")
            configured = _read_json(proposals[chosen] / "derivation.json", f"the proposal for {chosen}")
            # Units (pipeline/decide/rows.py): throughput_rps, p99 and expected_concurrency count requests;
            # settings' batch_size is TorchServe's batch in requests, batch_rows the rows per model call.
            record["rows_per_request"] = float(values(configured).get("rows_per_request") or 1.0)
            if chosen != winner:
                source = (f"Served winner: {chosen}, which served better beyond the noise than selection's "
                          f"{winner} in TorchServe (SLO {serve.latency_slo_ms:g} ms; see tuning.json).")
            derivation = tuned_derivation(configured, record)
        write_serve_files(SERVE_DIR, derivation, model_name=name, serve=serve, model_store=model_store,
                          source=source, frontend=frontend_properties(derivation))
        (SERVE_DIR / "tuning.json").write_text(json.dumps(record, indent=2) + "\n")
        TUNING_METRICS.parent.mkdir(parents=True, exist_ok=True)
        TUNING_METRICS.write_text(json.dumps(_metrics(record), indent=2) + "\n")
    except (ParamsError, TuningError, ArchiveError, DerivationError, ConfigWriteError,
            FileNotFoundError, ValueError) as e:
        print(f"tune: error: {e}", file=sys.stderr)
        return 2
    for c in record.get("candidates") or []:
        log.info("%-28s predicted %-32s served %s req/s, p99 %s ms (spread %.0f%%), batches %s",
                 c["name"], c["predicted"], c["throughput_rps"], c["p99_ms"], 100 * c["throughput_spread"],
                 c["batches_formed"])
    for step in record.get("decision_steps") or []:
        log.info("decision: %s", step)
    log.info("%s (tuning took %s s)", record.get("message"), record.get("duration_s"))
    if serve.require_slo and not record.get("slo_met"):
        print(f"tune: error: {record.get('message')} — failing because serve.require_slo is true", file=sys.stderr)
        return 1
    return 0


def served_model(params, proposal: Path, variant: str, store: Path) -> ServedModel:
    """`variant` as a folder-form model in its own store: each candidate rewrites its model-config.yaml."""
    folder = build_archive(params, selection_path=SELECTION_JSON, variants_dir=VARIANTS_DIR, serve_dir=proposal,
                           env_path=ENV_JSON, export_dir=store / variant, archive_format="no-archive",
                           variant_name=variant).path
    base_yaml = yaml.safe_load((proposal / "model-config.yaml").read_text()) or {}
    return ServedModel(folder.parent, params.model.name, folder.name, proposal / "config.properties", base_yaml)


def operating_candidates(params, env: dict, proposal: Path, variant: str) -> tuple[list, dict]:
    """The operating points to serve for `variant` (offline choice first) from its configure proposal
    and benchmark curve, each with the timeouts of its own point, and that benchmark record."""
    serve = params.serve
    benchmark = _read_json(BENCHMARK_METRICS / f"{variant}.json", f"the benchmark of {variant}")
    derivation = _read_json(proposal / "derivation.json", f"the proposal for {variant}")
    cores = usable_cores(env)[0] if (benchmark.get("device") or "cpu") == "cpu" else 0   # layouts share CPU cores only
    overridden = frozenset(k for k, v in derivation.items() if isinstance(v, dict) and v.get("overridden"))
    offline = values(derivation)
    candidates = candidates_from_curve(
        curve_from_benchmark(benchmark), offline, slo_ms=serve.latency_slo_ms,
        headroom_share=serve.delay_headroom_share, expected_concurrency=serve.expected_concurrency,
        cores=cores, bench_threads=int(benchmark.get("threads") or 1), overridden=overridden,
        max_candidates=params.tune.max_candidates,
        rows_per_request=float(offline.get("rows_per_request") or 1.0))
    # responseTimeout / startupTimeout for each candidate's own batch, as configure derives the offline one's.
    return with_timeouts(candidates, benchmark, env, serve, rows=rows_of_derivation(derivation)), benchmark


def run_contest(params, env: dict, proposals: dict, contenders: list[str], cases, settings: TuneSettings,
                store: Path, tmp: Path) -> dict:
    """Serve the variants tied offline against each other (pipeline.serve.tune.tuning.variant_contest), logged."""
    log.info("contest: %s are within the benchmark's noise of each other; serving each at its offline point",
             ", ".join(contenders))
    entries = [Contender(v, served_model(params, proposals[v], v, store),
                         operating_candidates(params, env, proposals[v], v)[0][0]) for v in contenders]
    bar = progress_bar(len(entries) * settings.rounds, "tune: variant contest")
    try:
        contest = variant_contest(entries, cases, settings, workroot=tmp / "contest",
                                  progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    for c in contest["candidates"]:
        log.info("contest %-20s served %s req/s, p99 %s ms (spread %.0f%%)", c["variant"], c["throughput_rps"],
                 c["p99_ms"], 100 * c["throughput_spread"])
    for step in contest["decision_steps"]:
        log.info("contest decision: %s", step)
    return contest


def fits_side_by_side(candidates, benchmark: dict, env: dict, memory_share: float) -> bool:
    """Every candidate's workers (and the frontend variants of the largest) held at once within the
    memory share of the host: peak RSS per worker from the benchmark; unknown → no."""
    rss = max([float(p["peak_rss_mb"]) for p in (benchmark.get("steady") or {}).values()
               if isinstance(p, dict) and p.get("peak_rss_mb")] or [0.0])
    host = env.get("memory_mb")
    if not rss or not host:
        return False
    workers = max(sum(c.workers for c in candidates),
                  (len(FRONTEND_CANDIDATES) + 1) * max(c.workers for c in candidates))
    return workers * (rss + JAVA_MB_PER_SERVER) <= host * memory_share


JAVA_MB_PER_SERVER = 300     # a TorchServe frontend's resident memory, roughly, counted per worker (conservative)


def _metrics(record: dict) -> dict:
    """The flat figures `dvc exp show` compares."""
    keys = ("slo_met", "served_p99_ms", "served_throughput_rps", "predicted_request_p99_ms",
            "littles_law_floor_ms", "inflight_within_slo", "replicas", "duration_s", "server_starts",
            "replaced_offline", "chosen_name", "variant")
    out = {k: record.get(k) for k in keys}
    contest = record.get("variant_contest")
    out["variant_replaced_selection"] = bool(contest and contest.get("replaced_selection"))
    out["chosen"] = record.get("chosen")
    return out


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/tune.json: wall time + peak memory
    from pipeline.measure.lock import measuring          # one experiment measures on a device at a time
    with measuring("tune"):
        sys.exit(run_timed("tune", main))
