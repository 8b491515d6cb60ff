"""The winner proven in Ray Serve as it is in TorchServe: the same checks (READY, HTTP parity with the golden set,
bad input beside valid requests, warm-up, the measured load at the expected concurrency) on the Ray Serve
application the archive stage wrote (artifacts/ray-serve/serve_config.yaml, `serve run` of it on a loopback
Ray, always stopped), in the same run and host as TorchServe's check, and the two compared.

`servers` lists ray-serve to run it (pipeline/core/params_schema.py). The record (serve_check.json
`servers`): each server's READY, p50/p99, throughput, batches formed and SLO verdict, and Ray Serve / TorchServe
ratios. Where the rest of the time goes: the handler's own time per request (its profile, the same code in
both servers) against the client's wall time per request, for each server.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Optional

from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.server.ray_server import RayServe
from pipeline.serve.serve_check import ServerSpec, _failures, _flat, check_server

log = logging.getLogger(__name__)

SUMMARY_KEYS = ("ready", "ready_s", "worker_load_ms", "first_request_ms", "parity_ok", "p50_ms", "p99_ms",
                "throughput_rps", "requests_ok", "requests_sent", "errors_5xx", "requests_lost", "batch_sizes_seen",
                "worker_peak_rss_mb", "settings")


def server_summary(flat: dict, slo_ms: float) -> dict:
    """One server's line of the comparison: its figures, the SLO verdict, and where a request's time goes."""
    out: dict[str, Any] = {k: flat.get(k) for k in SUMMARY_KEYS}
    p99 = flat.get("p99_ms")
    out["slo_ms"] = slo_ms
    out["slo_met"] = bool(flat.get("ready") and p99 is not None and p99 <= slo_ms)
    profile = flat.get("handler_profile") or {}
    rps, workers = flat.get("throughput_rps"), ((flat.get("settings") or {}).get("workers") or 1)
    if rps and profile.get("handle_us"):
        # The same handler code in both servers: its time per request (its batch's time / the batch's requests),
        # and the share of each worker's (replica's) wall it fills; the rest is the server's request path
        # and the waits for a batch to form.
        out["handler_us_per_request"] = profile["handle_us"]
        out["model_us_per_request"] = profile.get("model_us")
        out["worker_busy_share"] = round(profile["handle_us"] * rps / workers / 1e6, 3)
    return out


def ratios(ray: dict, torchserve: dict) -> dict:
    def div(a, b):
        return round(a / b, 3) if a is not None and b else None
    return {"throughput": div(ray.get("throughput_rps"), torchserve.get("throughput_rps")),
            "p99": div(ray.get("p99_ms"), torchserve.get("p99_ms")),
            "ready": div(ray.get("ready_s"), torchserve.get("ready_s"))}


def check_ray_serve(name: str, config: Path, cases: list[HttpCase], *, task: str, atol: float, rtol: float,
                    gate: Optional[dict], requests: int, concurrency: int, time_cap_s: float, warmup_s: float,
                    workdir: Optional[Path] = None) -> dict:
    """check_server's record for the Ray Serve application of `config`; `ready: false` + `error` when `serve run`
    never served it (a missing config is that error too, naming the stage that writes it)."""
    if not Path(config).is_file():
        return {"server": "ray-serve", "ready": False,
                "error": f"{config} is missing: the archive stage writes it (dvc repro archive)"}
    workdir = Path(workdir or tempfile.mkdtemp(prefix="ray-serve-check-"))
    server = RayServe(Path(config), workdir, name)
    spec = ServerSpec(name, Path(config).parent, Path(config), mar=name)
    try:
        return check_server(spec, cases, task=task, atol=atol, rtol=rtol, gate=gate, requests=requests,
                            concurrency=concurrency, time_cap_s=time_cap_s, warmup_s=warmup_s, server=server)
    finally:
        server.cleanup()


def compare_servers(record: dict, ray_record: dict, *, slo_ms: float, concurrency: int) -> dict:
    """serve_check.json's `servers` section, and the Ray Serve failures (prefixed) added to the record's."""
    ts = server_summary(record, slo_ms)
    ray_flat = _flat(ray_record)
    ray = server_summary(ray_flat, slo_ms)
    section = {"torchserve": ts, "ray-serve": ray, "ray_vs_torchserve": ratios(ray_flat, record),
               "concurrency": concurrency, "ray_serve_detail": ray_record}
    failures = [f"ray-serve: {f}" for f in _failures(ray_record)]
    record["failures"] = list(record.get("failures") or []) + failures
    record["ok"] = not record["failures"]
    record["servers"] = section
    r = section["ray_vs_torchserve"]
    log.info("Ray Serve: READY %s s, p99 %s ms, %s req/s; vs TorchServe: throughput x%s, p99 x%s, READY x%s",
             ray.get("ready_s"), ray.get("p99_ms"), ray.get("throughput_rps"), r["throughput"], r["p99"], r["ready"])
    return section
