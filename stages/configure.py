"""configure: derive the TorchServe settings from the winner's measurements (artifacts/configured/).

    python -m stages.configure [--out DIR]

Writes derivation.json (every value with formula, inputs, overridden), model-config.yaml (packed
into the .mar), config.properties and start_command.txt. The variants selection found within the
measured noise of the winner get their own proposal under contenders/<variant>/: the tune stage
serves them against the winner in TorchServe, where the tie is decided.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Optional

from pipeline.core.params import ParamsError, load_params
from pipeline.core.paths import (BENCHMARK_METRICS, CONFIGURED_DIR, CONTENDERS, ENV_JSON, GOLDEN_DIR, MODEL_STORE,
                            SELECTION_JSON)
from pipeline.decide.properties import ConfigWriteError, write_serve_files
from pipeline.decide.rows import rows_of_cases
from pipeline.decide.selection import tied_contenders
from pipeline.decide.serve_config import DerivationError, derive_serve_config

log = logging.getLogger("stages.configure")


class ConfigureError(RuntimeError):
    pass


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConfigureError(f"{path} not found ({what}); run the earlier stages: `dvc repro configure`")
    return json.loads(path.read_text())


def sample_elements(golden_dir: Path) -> Optional[dict]:
    """Elements per sample of all inputs / all outputs, from the golden set (None when absent)."""
    if not (golden_dir / "golden.json").is_file():
        return None
    from pipeline.model.golden import read_golden
    g = read_golden(golden_dir)
    b = g.batches[0]
    return {"input": int(sum(a.size for a in b.feeds.values()) // b.batch_size),
            "output": int(sum(a.size for a in b.outputs) // b.batch_size)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(CONFIGURED_DIR),
                        help="output folder: the offline proposal the tune stage tests in TorchServe "
                             "(default: %(default)s)")
    parser.add_argument("--selection", default=str(SELECTION_JSON), help="decision (default: %(default)s)")
    parser.add_argument("--benchmarks-dir", default=str(BENCHMARK_METRICS),
                        help="benchmark records (default: %(default)s)")
    parser.add_argument("--env", default=str(ENV_JSON), help="environment fingerprint (default: %(default)s)")
    parser.add_argument("--golden", default=str(GOLDEN_DIR), help="golden set, for sample sizes (default: %(default)s)")
    parser.add_argument("--model-store", default=str(MODEL_STORE.resolve()),
                        help="model store written when serve.model_store is unset (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        params = load_params()
        selection = _read_json(Path(args.selection), "the select stage's decision")
        winner = selection.get("winner")
        if not winner:
            raise ConfigureError(f"{args.selection}: no winner — {selection.get('message')}")
        env = _read_json(Path(args.env), "the probe stage's environment")
        m = params.model
        task = {"kind": m.task, "input_shape": m.input_shape, "max_length": m.text.max_length}
        elements = sample_elements(Path(args.golden))
        rows = rows_of_cases(Path(args.golden))      # rows per request of the expected load (rerank: many)
        log.info("expected load: %s rows per request (%s)", rows["rows_per_request"], rows["source"])
        serve = params.serve
        out = Path(args.out)
        model_store = serve.model_store or args.model_store

        def propose(variant: str, folder: Path, source: str) -> dict:
            benchmark = _read_json(Path(args.benchmarks_dir) / f"{variant}.json", f"the benchmark of {variant}")
            derivation = derive_serve_config(benchmark, env, serve, task=task, sample_elements=elements, rows=rows)
            folder.mkdir(parents=True, exist_ok=True)
            write_serve_files(folder, derivation, model_name=m.name, serve=serve, model_store=model_store,
                              source=source)
            return derivation

        derivation = propose(winner, out, f"Winner: {winner} (objective {selection.get('objective')}, SLO "
                                          f"{serve.latency_slo_ms:g} ms, slo_met {selection.get('slo_met')}).")
        shutil.rmtree(out / CONTENDERS, ignore_errors=True)
        for variant in tied_contenders(selection):
            propose(variant, out / CONTENDERS / variant,
                    f"Contender: {variant}, within the measured noise of the winner {winner}; the tune stage "
                    f"serves both.")
            log.info("contender %s: proposal in %s", variant, out / CONTENDERS / variant)
    except (ParamsError, ConfigureError, DerivationError, ConfigWriteError) as e:
        print(f"configure: error: {e}", file=sys.stderr)
        return 2
    log.info("winner %s on %s", winner, derivation["device"].value)
    dinputs = derivation["max_batch_delay_ms"].inputs
    p99 = dinputs.get("request_work_ms", dinputs.get("batch_p99_ms"))   # a request's model calls (rerank: several)
    if p99 is not None and p99 + derivation["max_batch_delay_ms"].value > serve.latency_slo_ms:
        print(f"configure: WARNING: batch p99 {p99:.1f} ms + maxBatchDelay {derivation['max_batch_delay_ms'].value} ms "
              f"exceeds serve.latency_slo_ms {serve.latency_slo_ms:g} ms (see selection.json / the overrides)",
              file=sys.stderr)
    for key, d in derivation.items():
        log.info("%-20s = %-10s %s%s", key, d.value, d.formula, "  [OVERRIDDEN, derived %s]" % d.derived_value
                 if d.overridden else "")
    log.info("wrote derivation.json, model-config.yaml, config.properties, start_command.txt to %s", out)
    return 0


if __name__ == "__main__":
    from pipeline.core.stage_record import run_timed   # metrics/stages/configure.json: wall time + peak memory
    sys.exit(run_timed("configure", main))
