"""What the TorchServe derivation (pipeline/decide/serve_config.py) builds on: the `Derived` record,
the benchmark figures it reads, and the settings fixed before an operating point is chosen —
workers × threads for the host, the request and response size limits for the task.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from pipeline.decide.operating_point import CurvePoint

# TorchServe's frontend defaults, used when nothing better is known (torchserve-0.12.md).
TS_DEFAULT_MAX_REQUEST_SIZE = 6553500
JSON_BYTES_PER_FLOAT = 32          # worst case of a float32 as JSON text: "-1.2345678901234567e-05, "
REQUEST_OVERHEAD_BYTES = 4096      # JSON brackets, keys, headers of a multipart body
REFERENCE_DISK_MB_S = 200.0       # the disk the derivation always shows startupTimeout for
MIN_BODY_LIMIT = 65536             # below this, a limit only produces confusing 413s
TEXT_BYTES_PER_TOKEN = 64          # a token is a few UTF-8 chars; 64 leaves room for text the tokenizer truncates


class DerivationError(ValueError):
    """The measurements cannot support a configuration; the message says what is missing."""


# --------------------------------------------------------------------------- value objects
@dataclass(frozen=True)
class Derived:
    value: Any
    formula: str
    inputs: dict
    overridden: bool = False
    derived_value: Any = None       # what the formula gave, kept when an override replaced it

    def as_dict(self) -> dict:
        d = {"value": self.value, "formula": self.formula, "inputs": self.inputs,
             "overridden": self.overridden}
        if self.overridden:
            d["derived_value"] = self.derived_value
        return d


# --------------------------------------------------------------------------- reading measurements
def curve_from_benchmark(benchmark: dict) -> list[CurvePoint]:
    """The measured curve, sorted by batch size; a clear error when there is none."""
    steady = benchmark.get("steady") or {}
    points = []
    for key, m in steady.items():
        try:
            points.append(CurvePoint(
                batch_size=int(m.get("batch_size", key)),
                p50_ms=float(m["p50_ms"]), p99_ms=float(m["p99_ms"]),
                throughput_sps=float(m["throughput_sps"]), cv=float(m.get("cv") or 0.0),
                peak_rss_mb=m.get("peak_rss_mb"), peak_gpu_mb=m.get("peak_gpu_mb"),
                noisy=bool(m.get("noisy", False)), spread=float(m.get("spread") or 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise DerivationError(
                f"benchmark of {benchmark.get('variant')!r}: steady[{key!r}] lacks a usable {e}; "
                f"re-run `dvc repro benchmark@{benchmark.get('variant')}`") from None
    if not points:
        raise DerivationError(
            f"benchmark of {benchmark.get('variant')!r} has no steady-state measurements; "
            f"re-run `dvc repro benchmark@{benchmark.get('variant')}`")
    return sorted(points, key=lambda p: p.batch_size)


def cold_load_ms(benchmark: dict) -> tuple[float, float]:
    """(median, max) of the total cold load in ms; the sum of phase figures when no total was kept."""
    phases = ((benchmark.get("cold_load") or {}).get("phases_ms") or {})
    if "total" in phases:
        return float(phases["total"]["median"]), float(phases["total"]["max"])
    if not phases:
        raise DerivationError(f"benchmark of {benchmark.get('variant')!r} has no cold_load.phases_ms; "
                              f"re-run its benchmark stage")
    return (sum(float(v["median"]) for v in phases.values()), sum(float(v["max"]) for v in phases.values()))


def from_disk(benchmark: dict) -> Optional[dict]:
    """The benchmark's cold start from disk (cold_load.from_disk), when it was measured."""
    d = (benchmark.get("cold_load") or {}).get("from_disk") or {}
    return d if d.get("measured") and d.get("total_ms") is not None else None


def worker_memory_mb(benchmark: dict, point: Optional[CurvePoint]) -> tuple[Optional[float], Optional[float]]:
    """(peak host RSS, peak GPU memory) of one worker at the served batch, MB."""
    rss = (point.peak_rss_mb if point else None) or benchmark.get("peak_rss_mb")
    gpu = point.peak_gpu_mb if point else None
    return (float(rss) if rss is not None else None, float(gpu) if gpu is not None else None)


# --------------------------------------------------------------------------- before the operating point
def serve_dict(serve: Any) -> dict:
    """The serve params as a dict (ServeParams or a plain dict)."""
    return dataclasses.asdict(serve) if dataclasses.is_dataclass(serve) else dict(serve)


def usable_cores(env: dict) -> tuple[int, dict]:
    """Cores one host gives to all workers together: physical cores, capped by the CPUs this process
    may use (containers / affinity) when the probe recorded them."""
    cpu = env.get("cpu") or {}
    physical = cpu.get("physical_cores") or cpu.get("logical_cores") or 1
    usable = cpu.get("usable_cpus") or env.get("usable_cpus")
    cores = int(min(physical, usable)) if usable else int(physical)
    return max(1, cores), {"physical_cores": cpu.get("physical_cores"), "usable_cpus": usable}


def request_limits(task: Optional[dict], sample_elements: Optional[dict]) -> tuple[Derived, Derived]:
    """Handler request-size limit and response-size bound from the task and the sample sizes.

    task: {"kind", "input_shape"?, "max_length"?}; sample_elements: {"input": n, "output": n}
    per sample (from the golden set) or None."""
    kind = (task or {}).get("kind")
    inputs: dict = {"task": kind, "sample_elements": sample_elements}
    if kind == "tensor" and ((sample_elements or {}).get("input") or task.get("input_shape")):
        n = (sample_elements or {}).get("input") or math.prod(task["input_shape"])
        req = max(MIN_BODY_LIMIT, n * JSON_BYTES_PER_FLOAT + REQUEST_OVERHEAD_BYTES)
        rf = f"max({MIN_BODY_LIMIT}, input elements per sample × {JSON_BYTES_PER_FLOAT} B + {REQUEST_OVERHEAD_BYTES} B)"
        inputs["input_elements"] = n
    elif kind == "text-embedding":
        ml = int(task.get("max_length") or 128)
        req = max(MIN_BODY_LIMIT, ml * TEXT_BYTES_PER_TOKEN + REQUEST_OVERHEAD_BYTES)
        rf = f"max({MIN_BODY_LIMIT}, max_length × {TEXT_BYTES_PER_TOKEN} B + {REQUEST_OVERHEAD_BYTES} B)"
        inputs["max_length"] = ml
    else:
        # Images arrive encoded at any resolution (a phone photo is several MB): keep TorchServe's cap.
        req = TS_DEFAULT_MAX_REQUEST_SIZE
        rf = "TorchServe default (encoded images come at any resolution)"
    out_n = (sample_elements or {}).get("output")
    if out_n:
        resp = max(MIN_BODY_LIMIT, out_n * JSON_BYTES_PER_FLOAT + REQUEST_OVERHEAD_BYTES)
        pf = f"max({MIN_BODY_LIMIT}, output elements per sample × {JSON_BYTES_PER_FLOAT} B + {REQUEST_OVERHEAD_BYTES} B)"
    else:
        resp, pf = TS_DEFAULT_MAX_REQUEST_SIZE, "TorchServe default (output size unknown: no golden outputs)"
    return Derived(int(req), rf, inputs), Derived(int(resp), pf, {"output_elements": out_n})


def plan_workers(benchmark: dict, env: dict, serve: Any,
                 curve: Optional[list[CurvePoint]] = None) -> tuple[Derived, Derived]:
    """(workers, threads_per_worker) for one host, before overrides.

    Memory per worker is the peak over every measured batch (conservative, and it lets the worker
    count be known before the batch size, which it bounds: see `fill_limit`)."""
    s = serve_dict(serve)
    curve = curve if curve is not None else curve_from_benchmark(benchmark)
    device = benchmark.get("device") or env.get("device") or "cpu"
    rss_mb = max([p.peak_rss_mb for p in curve if p.peak_rss_mb is not None] +
                 ([benchmark["peak_rss_mb"]] if benchmark.get("peak_rss_mb") is not None else []), default=None)
    gpu_mb = max((p.peak_gpu_mb for p in curve if p.peak_gpu_mb is not None), default=None)
    cores, core_inputs = usable_cores(env)
    bench_threads = int(benchmark.get("threads") or 1)
    share = float(s.get("memory_share", 0.8))
    host_mb = env.get("memory_mb")
    mem_cap = int(host_mb * share // rss_mb) if host_mb and rss_mb else None
    if device == "cuda":
        gpu = env.get("gpu") or {}
        n_gpu = int(gpu.get("count") or 1)
        gpu_cap = int(gpu["memory_mb"] * share // gpu_mb) if gpu.get("memory_mb") and gpu_mb else None
        per_gpu = max(1, min(int(s.get("max_workers_per_gpu", 2)), gpu_cap if gpu_cap is not None else 10**6))
        w = per_gpu * n_gpu
        if mem_cap is not None:
            w = min(w, max(1, mem_cap))
        workers = Derived(w,
            "per GPU: min(max_workers_per_gpu, floor(gpu memory × memory_share / peak GPU MB per worker)) "
            "× GPUs, capped by floor(host memory × memory_share / peak RSS)",
            {"gpus": n_gpu, "gpu_memory_mb": gpu.get("memory_mb"), "peak_gpu_mb": gpu_mb,
             "max_workers_per_gpu": s.get("max_workers_per_gpu"), "memory_share": share,
             "host_memory_mb": host_mb, "peak_rss_mb": rss_mb})
        served = _workers_override(s) or w
        threads = Derived(max(1, min(bench_threads, cores // max(1, served))),
            "min(benchmark threads, cores // workers): CPU-side pre/post-processing threads",
            {"benchmark_threads": bench_threads, "cores": cores, "workers": served, **core_inputs})
    else:
        cpu_cap = max(1, cores // bench_threads)
        w = cpu_cap if mem_cap is None else max(1, min(cpu_cap, mem_cap))
        workers = Derived(w,
            "min(cores // benchmark threads, floor(host memory × memory_share / peak RSS per worker)), >= 1 "
            "(workers × threads <= cores: no oversubscription)",
            {"cores": cores, "benchmark_threads": bench_threads, "host_memory_mb": host_mb,
             "peak_rss_mb": rss_mb, "memory_share": share, **core_inputs})
        threads = Derived(bench_threads, "the intra-op thread count the curve was measured with",
                          {"benchmark_threads": bench_threads})
    return workers, threads


def _workers_override(s: dict) -> Optional[int]:
    override = (s.get("overrides") or {}).get("workers")
    return int(override) if override else None


def served_workers(benchmark: dict, env: Optional[dict], serve: Any) -> int:
    """The worker count configure will write: serve.overrides.workers, else `plan_workers`; 1 when
    the host is unknown (no env.json)."""
    s = serve_dict(serve)
    return _workers_override(s) or (plan_workers(benchmark, env, s)[0].value if env else 1)


def values(derivation: dict) -> dict:
    """{key: value} from a derivation (Derived objects or their dicts) or from plain values."""
    res = {}
    for k, v in derivation.items():
        if isinstance(v, Derived):
            res[k] = v.value
        elif isinstance(v, dict) and "value" in v:
            res[k] = v["value"]
        else:
            res[k] = v
    return res


def derivation_as_dict(derivation: dict[str, Derived]) -> dict:
    return {k: (v.as_dict() if isinstance(v, Derived) else v) for k, v in derivation.items()}
