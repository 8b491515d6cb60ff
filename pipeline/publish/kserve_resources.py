"""The InferenceService's resources and probes, derived from measurements, each with its formula and evidence.

Every figure is returned as `{"value", "formula", "inputs"}` (as pipeline/decide/store_form.py does),
written into artifacts/kserve/resources.json and, as comments, into inferenceservice.yaml:

- memory request = ceil((peak RSS per worker × workers + frontend JVM) × MEMORY_HEADROOM) MiB, where
  the peak per worker is the served winner's in TorchServe (metrics/serve_check.json
  `worker_peak_rss_mb`, the largest of its workers over its load, the checks and the load), else the
  benchmark's for the served variant (artifacts/serve/derivation.json `workers.inputs.peak_rss_mb`,
  read from metrics/benchmark/<variant>.json); memory limit = ceil(request × MEMORY_LIMIT_FACTOR) MiB;
- CPU request = limit = workers × threads per worker: the served figures were measured with that
  many cores doing the model's work, and no more, so the pod asks for what was measured;
- startupProbe: the same check as the readiness probe, every PROBE_PERIOD_S seconds, failureThreshold
  = ceil(startupTimeout / period): the pod gets the derived startupTimeout (model-config.yaml, see
  derivation.json) to bring a worker READY before the kubelet restarts it;
- readinessProbe: true only once a worker is READY. TorchServe 0.12's `/ping` answers 200 "Healthy"
  while the model's workers are still loading, or failing and retrying (seen; tests/publish/test_publish.py
  checks it), and KServe's wrapper reports its model ready as soon as it finds the .mar file, so neither
  can be the readiness probe. The probe asks TorchServe's management API `GET /models/<name>`
  (on 8085, with inference: the KServe layout's config.properties; token authorization off there) and
  passes only when a worker's `status` is `READY` (an exec probe: an httpGet probe reads only the
  status code, which is 200 whatever the workers' state).
"""
from __future__ import annotations

import math
import shlex
from typing import Any, Optional

# Memory, in MiB (the pipeline's "MB" of RSS is 2**20 bytes): what the measured peaks do not cover. The frontend is a JVM beside the workers in the same
# container: 317.9 MB peak RSS (VmHWM) measured for TorchServe 0.12 on Java 17 (this project's host:
# 2 workers, 4000 requests at 16 concurrent clients, answers of 384 floats); its allowance is that,
# rounded up. The serve check does not record the frontend's memory, so it is a constant here.
FRONTEND_JVM_MB = 320
FRONTEND_JVM_EVIDENCE = ("TorchServe 0.12 frontend (Java 17) peak RSS 317.9 MB after 4000 requests at 16 "
                         "concurrent clients with 2 workers, measured on the project's 2-core host")
MEMORY_HEADROOM = 1.2        # inputs longer than the golden set's, allocator growth over days, the KServe wrapper
MEMORY_LIMIT_FACTOR = 1.5    # the limit: room above the request for a spike before the OOM killer acts
PROBE_PERIOD_S = 5
PROBE_TIMEOUT_S = 3
MANAGEMENT_PORT = 8085       # the KServe layout serves management on the inference port (pipeline/publish/kserve.py)


def _int(x: Any) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 else None


def worker_peak_mb(serve_check: Optional[dict], derivation: Optional[dict]) -> Optional[dict]:
    """The measured peak RSS of one worker, MB, and where it was measured; None when nothing measured it."""
    served = _num((serve_check or {}).get("worker_peak_rss_mb"))
    if served:
        return {"value": served, "source": "metrics/serve_check.json worker_peak_rss_mb (the served winner in "
                                            "TorchServe: the largest worker's VmHWM over the check's load)"}
    workers = (derivation or {}).get("workers")
    bench = _num(((workers or {}).get("inputs") or {}).get("peak_rss_mb")) if isinstance(workers, dict) else None
    if bench:
        return {"value": bench, "source": "artifacts/serve/derivation.json workers.inputs.peak_rss_mb (the benchmark's "
                                           "peak RSS of the served variant, metrics/benchmark/<variant>.json)"}
    return None


def memory(workers: int, peak: dict) -> tuple[dict, dict]:
    """(request, limit) in MiB, each with its formula and inputs."""
    total = peak["value"] * workers + FRONTEND_JVM_MB
    request = math.ceil(total * MEMORY_HEADROOM)
    inputs = {"peak_rss_per_worker_mb": peak["value"], "peak_source": peak["source"], "workers": workers,
              "frontend_jvm_mb": FRONTEND_JVM_MB, "frontend_jvm_evidence": FRONTEND_JVM_EVIDENCE,
              "headroom": MEMORY_HEADROOM, "measured_total_mb": round(total, 1)}
    req = {"value": f"{request}Mi", "mib": request, "inputs": inputs,
           "formula": "ceil((peak RSS per worker × workers + frontend JVM) × headroom) MiB"}
    limit = math.ceil(request * MEMORY_LIMIT_FACTOR)
    lim = {"value": f"{limit}Mi", "mib": limit, "inputs": {"request_mib": request, "limit_factor": MEMORY_LIMIT_FACTOR},
           "formula": "ceil(memory request × limit_factor) MiB"}
    return req, lim


def cpu(workers: int, threads: int) -> dict:
    return {"value": str(workers * threads), "inputs": {"workers": workers, "threads_per_worker": threads},
            "formula": "workers × threads per worker (the cores the served figures were measured with)"}


def ready_check(model_name: str, port: int = MANAGEMENT_PORT) -> list[str]:
    """The probe's command: exit 0 only when TorchServe describes a worker of the model as READY
    (GET /models/<name> on the management API); no worker READY: exit 1; any error (refused, 404,
    a timeout) is an uncaught exception: exit 1 too. Python's standard library only: the TorchServe
    image has Python, not necessarily curl or jq."""
    url = f"http://127.0.0.1:{port}/models/{model_name}"
    script = (f"import json,sys,urllib.request as u; d=json.load(u.urlopen({url!r},timeout={PROBE_TIMEOUT_S - 1})); "
              "sys.exit(0 if any(w.get('status')=='READY' for m in d for w in m.get('workers') or []) else 1)")
    return ["python3", "-c", script]


def probes(model_name: str, startup_timeout_s: int) -> dict:
    """{"startupProbe", "readinessProbe"} for the predictor container, and the startup budget's derivation."""
    threshold = max(1, math.ceil(startup_timeout_s / PROBE_PERIOD_S))
    startup = {"exec": {"command": ready_check(model_name)}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": PROBE_TIMEOUT_S,
               "failureThreshold": threshold}
    readiness = {"exec": {"command": ready_check(model_name)}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": PROBE_TIMEOUT_S,
                 "failureThreshold": 1, "successThreshold": 1}
    budget = {"value": threshold * PROBE_PERIOD_S, "formula": "failureThreshold × periodSeconds, failureThreshold = "
              "ceil(startupTimeout / periodSeconds)", "inputs": {"startup_timeout_s": startup_timeout_s,
                                                                  "period_s": PROBE_PERIOD_S,
                                                                  "failure_threshold": threshold}}
    return {"startupProbe": startup, "readinessProbe": readiness, "startup_budget_s": budget}


def derive(model_name: str, model_config: dict, derivation: Optional[dict], serve_check: Optional[dict]) -> dict:
    """Everything the manifest's resources and probes take from the measurements, with formulas; the
    memory entries are None (and the manifest says so) when no peak RSS was measured."""
    workers = _int(model_config.get("maxWorkers")) or _int(model_config.get("minWorkers")) or 1
    threads = _int((model_config.get("handler") or {}).get("threads")) or 1
    startup = _int(model_config.get("startupTimeout")) or 120
    peak = worker_peak_mb(serve_check, derivation)
    out: dict[str, Any] = {"workers": workers, "threads_per_worker": threads, "cpu": cpu(workers, threads)}
    out["memory_request"], out["memory_limit"] = memory(workers, peak) if peak else (None, None)
    out.update(probes(model_name, startup))
    out["startup_budget_s"]["inputs"]["source"] = "artifacts/serve/model-config.yaml startupTimeout (derivation.json startup_timeout_s)"
    return out


def comment_lines(d: dict) -> list[str]:
    """The derivation as the manifest's header comments."""
    lines = ["Resources and probes from the measurements (artifacts/kserve/resources.json has every input):"]
    c = d["cpu"]
    lines.append(f"  cpu {c['value']} = {c['formula']}: {c['inputs']['workers']} × {c['inputs']['threads_per_worker']}")
    req, lim = d.get("memory_request"), d.get("memory_limit")
    if req:
        i = req["inputs"]
        lines.append(f"  memory request {req['value']} = {req['formula']}: ceil(({i['peak_rss_per_worker_mb']:g} MiB × "
                     f"{i['workers']} + {i['frontend_jvm_mb']} MiB) × {i['headroom']:g})")
        lines.append(f"    peak per worker: {i['peak_source']}")
        lines.append(f"    frontend JVM: {i['frontend_jvm_evidence']}")
        lines.append(f"  memory limit {lim['value']} = {lim['formula']}: ceil({lim['inputs']['request_mib']} × "
                     f"{lim['inputs']['limit_factor']:g})")
    else:
        lines.append("  memory: NOT SET, no peak RSS measured (run `dvc repro serve_check`); set it before applying")
    b = d["startup_budget_s"]
    lines.append(f"  startupProbe budget {b['value']} s = {b['formula']}: startupTimeout "
                 f"{b['inputs']['startup_timeout_s']} s, period {b['inputs']['period_s']} s")
    lines.append("  readinessProbe: passes only when GET /models/<name> (management API, port "
                 f"{MANAGEMENT_PORT}) lists a worker READY; /ping says Healthy before that")
    return lines


def command_text(command: list[str]) -> str:
    """The probe's command as one shell line (for the docs and the tests)."""
    return " ".join(shlex.quote(a) for a in command)
