"""The setups the winner is judged against — the hand-tuned setup (docs/handtuned.md) and the naive
baseline — measured in a stage of their own (dvc.yaml `references`) and reused while their inputs
hold: the host (env.json), the model (the checkpoint and the golden requests), the load (clients,
requests, time cap, warm-up) and their own recipes (the archive stage's). A `serve.*` experiment, a
re-run or a new winner re-measures none of them; the served SLO and the ratios to the winner are
computed when serve_check reads them (pipeline/serve/reference/reference_rounds.py's summaries).

Each is packed from its recipe into a scratch directory while served (reference_archives.py) and
served in a fresh TorchServe under the load serve_check applies, READY measured every time, in
interleaved rounds with each other (the rounds' spread shows the host's drift). The record says
when and on which host they were measured: serve_check's comparison with them is across runs, and
the report says so.
"""
from __future__ import annotations

import datetime as dt
import logging
from typing import Optional

from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.reference.reference_rounds import interleaved_rounds, summarise
from pipeline.serve.serve_check import ServerSpec, check_server

log = logging.getLogger(__name__)

REFERENCES = ("handtuned", "baseline")


def measure_references(specs: dict[str, ServerSpec], cases: list[HttpCase], *, task: str, rounds: int,
                       requests: int, concurrency: int, time_cap_s: float, warmup_s: float) -> dict:
    """{"setups": {name: summary}, "baseline_detail": the baseline's first check or None, ...}.
    The baseline's first serve is a full check_server record (serve_check's winner / baseline ratios
    read its load); no bad inputs (the naive handler is not expected to survive them) and no parity
    (it is the reference model itself)."""
    started = dt.datetime.now(dt.timezone.utc)
    first: dict = {}
    if "baseline" in specs:
        first["baseline"] = check_server(specs["baseline"], cases, task=task, atol=0.0, rtol=0.0, requests=requests,
                                         concurrency=concurrency, time_cap_s=time_cap_s, bad_inputs=False,
                                         parity=False, warmup_s=warmup_s)
    setups = interleaved_rounds(specs, cases, task=task, rounds=rounds, requests=requests, concurrency=concurrency,
                                time_cap_s=time_cap_s, slo_ms=float("inf"), first_round=first,
                                warmup_s=warmup_s) if specs else {}
    return {"measured_at": started.isoformat(timespec="seconds"),
            "seconds": round((dt.datetime.now(dt.timezone.utc) - started).total_seconds(), 1),
            "setups": setups, "rounds_served": {n: len(s["rounds"]) for n, s in setups.items()},
            "baseline_detail": first.get("baseline")}


def setups_at_slo(references: Optional[dict], slo_ms: float) -> dict:
    """The references' summaries with the served SLO applied (their rounds summarised again)."""
    return {name: summarise(s.get("rounds") or [], slo_ms)
            for name, s in ((references or {}).get("setups") or {}).items() if name in REFERENCES}
