"""TorchServe settings derived from the winner's measurements.

Every value is a `Derived` record — value, formula, the inputs it was computed from, and whether
`serve.overrides.*` replaced it — so `artifacts/serve/derivation.json` explains each setting.
Plain data in (benchmark / env dicts as in docs/artifacts.md, serve params as a dict or ServeParams),
plain data out; the writers in `pipeline/decide/properties.py` turn the result into files.

The operating point (batch size + batch delay on a latency-vs-batch curve) lives here and is reused
by `pipeline/decide/selection.py`, so the variant is chosen at exactly the point it will be served at.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from pipeline.decide.store_form import choose_store_form

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
class CurvePoint:
    """One measured batch size of the steady-state curve (metrics/benchmark/<v>.json `steady`)."""
    batch_size: int
    p50_ms: float
    p99_ms: float
    throughput_sps: float
    cv: float = 0.0                 # per-call coefficient of variation
    peak_rss_mb: Optional[float] = None
    peak_gpu_mb: Optional[float] = None
    noisy: bool = False
    spread: float = 0.0             # how far the p50s of the rounds (fresh processes) disagree

    @property
    def noise(self) -> float:
        """The relative uncertainty of this point's figures: per-call CV or cross-process spread,
        whichever is larger."""
        return max(self.cv, self.spread)


@dataclass(frozen=True)
class OperatingPoint:
    """Where a variant will be served: batch size, batch delay and the figures measured there."""
    batch_size: int
    delay_ms: int
    batch_p99_ms: float
    request_p99_ms: float           # batch p99 + the batch delay a request may wait
    throughput_sps: float
    noise: float                    # the served point's CurvePoint.noise
    fits_slo: bool
    steps: list = field(default_factory=list)   # why this batch: one line per measured batch

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


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


def noise_between(a: CurvePoint, b: CurvePoint, floor: float) -> float:
    """Relative difference two throughput figures of ONE variant must exceed to count as real.

    The per-call CV is taken as the uncertainty: deliberately conservative (whole-run means differ
    by more than their standard error suggests). Not the rounds' spread: a variant's batch sizes
    were measured in the same rounds, interleaved, so host drift moves them together; the spread
    matters when comparing variants measured at different times (selection). Independent errors
    add in quadrature."""
    return max(floor, math.hypot(a.cv, b.cv))


def batch_delay_ms(point: CurvePoint, slo_ms: float, headroom_share: float, workers: int = 1) -> tuple[int, dict]:
    """maxBatchDelay for a batch: at most a share of the SLO headroom left by its p99, at most the
    time a batch takes to fill when the workers run at that batch's throughput (waiting longer
    only adds latency under load), and at least 1 ms (TorchServe turns 0 into 100 ms)."""
    headroom = slo_ms - point.p99_ms
    fill_ms = (point.batch_size - 1) * 1000.0 / max(point.throughput_sps * workers, 1e-9)
    delay = max(1, int(math.floor(min(headroom * headroom_share, fill_ms))))
    return delay, {"slo_ms": slo_ms, "batch_p99_ms": point.p99_ms, "headroom_ms": round(headroom, 3),
                   "headroom_share": headroom_share, "fill_ms": round(fill_ms, 3), "workers": workers,
                   "throughput_sps": point.throughput_sps, "batch_size": point.batch_size}


def choose_operating_point(curve: list[CurvePoint], slo_ms: float, *, objective: str = "throughput",
                           min_gain: float = 0.05, noise_floor: float = 0.03,
                           headroom_share: float = 0.5, workers: int = 1,
                           max_batch: Optional[int] = None) -> OperatingPoint:
    """The batch to serve at.

    max_batch: the largest batch the expected load can fill on every worker at once (`fill_limit`);
    bigger measured batches are skipped: under that load they would only ever leave partly full,
    after waiting maxBatchDelay. The smallest measured batch stays a candidate whatever the limit.
    throughput / cold_load objectives: walk the measured batches upwards; a batch that fits the SLO
    (p99 + its delay) replaces the current choice only if its throughput beats the CURRENT CHOICE by
    more than max(min_gain, noise). Comparing with the choice, not the neighbour, handles a
    non-monotonic curve: 1:100, 2:200, 4:150, 8:205 stays at 2. latency objective: the smallest
    measured batch with no wait. Nothing fits: the batch with the lowest p99 (fits_slo False)."""
    steps = []

    def point_at(p: CurvePoint) -> tuple[int, float]:
        d, _ = batch_delay_ms(p, slo_ms, headroom_share, workers)
        return d, p.p99_ms + d

    if max_batch is not None:
        over = [p for p in curve[1:] if p.batch_size > max_batch]
        if over:
            steps.append(f"batch {', '.join(str(p.batch_size) for p in over)}: above {max_batch}, the largest batch "
                         f"the expected concurrent requests fill on each of {workers} worker(s): skipped")
        curve = curve[:1] + [p for p in curve[1:] if p.batch_size <= max_batch]
    fitting = []
    for p in curve:
        ok = p.p99_ms + 1 <= slo_ms          # with the 1 ms minimum delay
        if ok:
            fitting.append(p)
        else:
            steps.append(f"batch {p.batch_size}: p99 {p.p99_ms:.1f} ms + 1 ms delay exceeds the SLO {slo_ms:g} ms")
    if not fitting:
        best = min(curve, key=lambda p: p.p99_ms)
        return OperatingPoint(best.batch_size, 1, best.p99_ms, best.p99_ms + 1, best.throughput_sps,
                              best.noise, False, steps + [f"no batch fits: lowest p99 is batch {best.batch_size}"])
    if objective == "latency":
        chosen = fitting[0]
        d = 1
        steps.append(f"objective latency: smallest batch {chosen.batch_size}, no wait")
        return OperatingPoint(chosen.batch_size, d, chosen.p99_ms, chosen.p99_ms + d, chosen.throughput_sps,
                              chosen.noise, True, steps)
    chosen = fitting[0]
    steps.append(f"batch {chosen.batch_size}: fits, {chosen.throughput_sps:.1f} samples/s (start)")
    for p in fitting[1:]:
        need = noise_between(chosen, p, max(min_gain, noise_floor))
        gain = p.throughput_sps / chosen.throughput_sps - 1 if chosen.throughput_sps > 0 else math.inf
        if gain > need:
            steps.append(f"batch {p.batch_size}: +{gain:.1%} over batch {chosen.batch_size} > {need:.1%}: taken")
            chosen = p
        else:
            steps.append(f"batch {p.batch_size}: {gain:+.1%} over batch {chosen.batch_size} <= {need:.1%}: not worth it")
    d, req = point_at(chosen)
    return OperatingPoint(chosen.batch_size, d, chosen.p99_ms, req, chosen.throughput_sps, chosen.noise, True, steps)


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


def fill_limit(expected_concurrency: int, workers: int) -> int:
    """The largest batch every worker can fill at once when `expected_concurrency` requests are in
    flight: TorchServe splits the queue between its workers, so a bigger batch only ever leaves
    after maxBatchDelay, part full, and the workers idle while it waits."""
    return max(1, int(expected_concurrency) // max(1, int(workers)))


# --------------------------------------------------------------------------- derivation
def _serve_dict(serve: Any) -> dict:
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
    s = _serve_dict(serve)
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
    s = _serve_dict(serve)
    return _workers_override(s) or (plan_workers(benchmark, env, s)[0].value if env else 1)


def derive_serve_config(benchmark: dict, env: dict, serve: Any, *, task: Optional[dict] = None,
                        sample_elements: Optional[dict] = None) -> dict[str, Derived]:
    """All TorchServe settings for the winner. Keys match `serve.overrides.*`."""
    s = _serve_dict(serve)
    overrides = s.get("overrides") or {}
    slo = float(s["latency_slo_ms"])
    curve = curve_from_benchmark(benchmark)
    device = benchmark.get("device") or env.get("device") or "cpu"
    out: dict[str, Derived] = {}

    def put(key: str, d: Derived) -> Derived:
        ov = overrides.get(key)
        if ov is not None:
            d = Derived(ov, d.formula, d.inputs, overridden=True, derived_value=d.value)
        out[key] = d
        return d

    out["device"] = Derived(device, "the device the winner was benchmarked on", {"benchmark.device": device})

    # ---- workers × threads first: how many workers share the queue bounds the batch they can fill
    workers_d, threads_d = plan_workers(benchmark, env, s, curve)
    workers = put("workers", workers_d).value
    put("threads_per_worker", threads_d)

    # ---- batch size
    conc = int(s.get("expected_concurrency", 16))
    max_batch = fill_limit(conc, workers)
    op = choose_operating_point(curve, slo, objective=s.get("objective", "throughput"),
                                min_gain=s.get("min_batch_gain", 0.05), noise_floor=s.get("noise_floor", 0.03),
                                headroom_share=s.get("delay_headroom_share", 0.5), workers=workers,
                                max_batch=max_batch)
    batch = put("batch_size", Derived(op.batch_size,
        "largest measured batch with p99 + delay <= SLO and batch <= expected_concurrency // workers whose "
        "throughput beats the current choice by more than max(min_batch_gain, noise); objective latency: "
        "smallest batch",
        {"slo_ms": slo, "objective": s.get("objective"), "fits_slo": op.fits_slo,
         "expected_concurrency": conc, "workers": workers, "max_batch": max_batch, "steps": op.steps,
         "curve": {p.batch_size: {"p99_ms": p.p99_ms, "throughput_sps": p.throughput_sps, "cv": p.cv,
                                   "spread": p.spread}
                   for p in curve}})).value
    point = _point_for(batch, curve)

    # ---- batch delay, now that the number of workers sharing the queue is known
    if s.get("objective") == "latency" and not overrides.get("batch_size"):
        delay, dinputs = 1, {"objective": "latency"}
        dformula = "objective latency: 1 ms (no wait; 0 would become 100 ms)"
    else:
        delay, dinputs = batch_delay_ms(point, slo, float(s.get("delay_headroom_share", 0.5)), workers)
        if batch == 1:
            dformula = "batch 1: 1 ms (nothing to wait for; 0 would become 100 ms)"
        else:
            dformula = ("max(1, floor(min(delay_headroom_share × (SLO − p99(batch)), "
                        "(batch − 1) × 1000 / (workers × throughput(batch)))))")
    delay = put("max_batch_delay_ms", Derived(delay, dformula, dinputs)).value
    if delay <= 0:
        raise DerivationError(f"serve.overrides.max_batch_delay_ms = {delay}: TorchServe turns 0 into 100 ms; "
                              f"use 1 for 'no wait'")

    # ---- timeouts
    med_ms, max_ms = cold_load_ms(benchmark)
    disk = from_disk(benchmark)
    # The first start on a host reads the artifact from the disk; every later one from memory.
    worst_ms = max(max_ms, disk["total_ms"]) if disk else max_ms
    safety, margin = float(s["startup_safety"]), float(s["startup_margin_s"])
    worker_import = float(s.get("worker_import_s", 1.3))
    warmup_s = point.p99_ms / 1000.0
    artifact_bytes = int(benchmark.get("artifact_bytes") or 0)
    raw_read_ms = (benchmark.get("cold_load") or {}).get("raw_read_ms")
    read_ms = disk["raw_read_ms"] if disk else raw_read_ms      # this host's disk, when it was measured
    measured_mb_s = (artifact_bytes / 1e6) / (read_ms / 1000.0) if read_ms and artifact_bytes else None
    target = s.get("target_disk_read_mb_s")
    base_s = (worst_ms / 1000.0 + worker_import + warmup_s) * safety + margin

    def slower_disk_s(mb_s: Optional[float]) -> float:
        return artifact_bytes / 1e6 / float(mb_s) if mb_s and artifact_bytes and (
            measured_mb_s is None or mb_s < measured_mb_s) else 0.0

    def timeout_for(extra_s: float) -> int:
        return max(int(s["startup_floor_s"]), int(math.ceil(base_s + extra_s)))
    disk_s = slower_disk_s(target)
    raw = base_s + disk_s
    put("startup_timeout_s", Derived(timeout_for(disk_s),
        "max(startup_floor_s, ceil((worst cold load, from the page cache or the disk + worker torch import "
        "+ warm-up call at batchSize) × startup_safety + startup_margin_s + [artifact MB / "
        "target_disk_read_mb_s when that disk is slower than the measured read]))",
        {"cold_load_max_ms": max_ms, "cold_load_median_ms": med_ms,
         "cold_load_from_disk_ms": disk["total_ms"] if disk else None, "worst_cold_load_ms": worst_ms,
         "worker_import_s": worker_import,
         "warmup_ms": point.p99_ms, "startup_safety": safety, "startup_margin_s": margin,
         "artifact_bytes": artifact_bytes, "raw_read_ms": raw_read_ms,
         "disk_raw_read_ms": disk["raw_read_ms"] if disk else None,
         "measured_read_mb_s": round(measured_mb_s, 1) if measured_mb_s else None,
         "target_disk_read_mb_s": target, "disk_read_s": round(disk_s, 3),
         "startup_floor_s": s["startup_floor_s"], "unrounded_s": round(raw, 3),
         # What a plain 200 MB/s disk (a cloud volume, a cold host) would need, whatever the target.
         "at_reference_disk": {"read_mb_s": REFERENCE_DISK_MB_S,
                               "disk_read_s": round(slower_disk_s(REFERENCE_DISK_MB_S), 3),
                               "startup_timeout_s": timeout_for(slower_disk_s(REFERENCE_DISK_MB_S))}}))

    # ---- how the model sits in the model store: .mar, or the .mar unpacked into a folder
    form, fformula, finputs = choose_store_form(artifact_bytes or None, raw_read_ms,
                                                float(s.get("folder_store_min_mb", 500.0)))
    put("store_form", Derived(form, fformula, finputs))
    rsafety = float(s["response_safety"])
    rraw = (point.p99_ms * rsafety + delay) / 1000.0
    put("response_timeout_s", Derived(max(int(s["response_floor_s"]), int(math.ceil(rraw))),
        "max(response_floor_s, ceil((p99(batchSize) × response_safety + maxBatchDelay) / 1000))",
        {"batch_p99_ms": point.p99_ms, "response_safety": rsafety, "max_batch_delay_ms": delay,
         "response_floor_s": s["response_floor_s"], "unrounded_s": round(rraw, 3)}))

    # ---- queue and size limits
    put("job_queue_size", Derived(max(2 * conc, 2 * workers * batch),
        "max(2 × expected_concurrency, 2 × workers × batchSize): every expected in-flight request plus "
        "a burst; beyond it TorchServe answers 503 instead of letting requests wait past the SLO",
        {"expected_concurrency": conc, "workers": workers, "batch_size": batch}))
    req, resp = request_limits(task, sample_elements)
    handler_req = put("max_request_bytes", req).value
    # The frontend limit sits above the handler's, so an oversized body gets the handler's clear
    # JSON 413 rather than Netty's bare one; far larger bodies are still cut off by the frontend.
    put("max_request_size", Derived(int(handler_req) * 2, "2 × max_request_bytes (the handler's own limit)",
                                    {"max_request_bytes": handler_req}))
    put("max_response_size", resp)
    return out


def _point_for(batch: int, curve: list[CurvePoint]) -> CurvePoint:
    """The measured point for `batch`; for an override that was not measured, the next larger
    measured batch (conservative) or a linear extrapolation of the largest one."""
    for p in curve:
        if p.batch_size >= batch:
            if p.batch_size == batch:
                return p
            return dataclasses.replace(p, batch_size=batch)
    top = curve[-1]
    k = batch / top.batch_size
    return dataclasses.replace(top, batch_size=batch, p50_ms=top.p50_ms * k, p99_ms=top.p99_ms * k)


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
