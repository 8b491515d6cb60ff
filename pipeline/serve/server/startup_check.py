"""What a worker that missed its startupTimeout needed: the measured load against the timeout.

TorchServe kills a worker that does not answer LOAD within startupTimeout and retries it with
backoff for minutes (pipeline/serve/server/torchserve.py stops at the first kill). The server cannot say how
long the load would have taken (the worker was killed first), but the benchmark measured the cold
load of this very artifact and the configure stage derived the timeout it needs from it
(artifacts/serve/derivation.json `startup_timeout_s`). This module turns those records into one
message: the load measured, the timeout configured, the timeout needed, and what to change.
"""
from __future__ import annotations

from typing import Optional


def startup_evidence(derivation: Optional[dict]) -> Optional[dict]:
    """The measured load and the timeouts from a derivation.json dict (None when absent)."""
    d = (derivation or {}).get("startup_timeout_s")
    if not isinstance(d, dict):
        return None
    inputs = d.get("inputs") or {}
    overridden = bool(d.get("overridden"))
    needed = d.get("derived_value") if overridden else d.get("value")
    return {"configured_s": d.get("value"), "needed_s": needed, "overridden": overridden,
            "cold_load_median_ms": inputs.get("cold_load_median_ms"),
            "cold_load_max_ms": inputs.get("cold_load_max_ms"),
            "worker_import_s": inputs.get("worker_import_s"), "formula": d.get("formula")}


def diagnose_missed_startup(startup_timeout_s: Optional[float], waited_s: Optional[float],
                            evidence: Optional[dict]) -> dict:
    """{measured_load_s, startup_timeout_s, needed_startup_timeout_s, message} for a worker that
    TorchServe killed at its startupTimeout."""
    ev = evidence or {}
    worst = ev.get("cold_load_max_ms")
    measured_s = round(worst / 1000.0, 2) if worst is not None else None
    needed = ev.get("needed_s")
    timeout = startup_timeout_s if startup_timeout_s is not None else ev.get("configured_s")
    if needed is not None and timeout is not None and needed <= timeout:
        # The derivation was honoured yet missed: this server loads slower than the benchmark saw,
        # and the killed worker cannot say by how much: only "more than the timeout" is known.
        needed = None
        cause = (f"the derived {ev.get('configured_s')} s was applied, so this server loaded slower than the "
                 f"benchmark measured (a slower disk or a busier host): raise serve.startup_safety, or set "
                 f"serve.target_disk_read_mb_s to this disk's speed, and re-run configure")
    elif ev.get("overridden"):
        cause = (f"serve.overrides.startup_timeout_s = {ev.get('configured_s')} replaced the derived {needed} s: "
                 f"remove the override or set it to at least {needed} s")
    elif needed is not None:
        cause = f"set startupTimeout to at least {needed} s (model-config.yaml wins over config.properties)"
    else:
        cause = "no benchmark record of this model's load was found: run the benchmark and configure stages"
    load = (f"the benchmark measured a cold load of {measured_s} s (worst; median "
            f"{round(ev['cold_load_median_ms'] / 1000.0, 2)} s)" if measured_s is not None
            and ev.get("cold_load_median_ms") is not None else "the load time was not measured")
    need = f">= {needed} s" if needed is not None else f"> {timeout} s"
    message = (f"the worker missed its startupTimeout of {timeout} s and TorchServe killed it (it would retry it "
               f"with backoff, forever): {load}; it needs startupTimeout {need}; {cause}")
    return {"measured_load_s": measured_s, "startup_timeout_s": timeout, "needed_startup_timeout_s": needed,
            "waited_s": round(waited_s, 2) if waited_s is not None else None, "message": message}
