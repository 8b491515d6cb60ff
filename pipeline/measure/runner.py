"""Benchmark one variant folder: N fresh processes, each a cold start; the first `steady_runs` of
them go on to a steady-state round — the first sweeps the batch sizes, the others re-measure the
sizes it kept — and each point's figures pool the rounds.

Generic over two callables named by spec ('pkg.module:fn' or 'file.py:fn'), resolved in the
children:
- loader(model_dir, device=..., threads=...) -> runtime with .run(feeds), optional .load_phases / .close()
- feeds(model_dir, batch_size, seq_len) -> feeds
The benchmark stage uses handlers.runtimes:load_runtime and the task adapters; tests use tiny models.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional

from pipeline.measure.cold import DEFAULT_FEEDS, DEFAULT_LOADER, artifact_files, measure_fresh_processes
from pipeline.host.device import serving_threads
from pipeline.measure.feeds import describe_feeds, read_variant
from pipeline.measure.reference import HostReference, per_reference
from pipeline.measure.stats import LatencySummary, RepeatedLatency
from pipeline.measure.steady import RoundSpec

log = logging.getLogger(__name__)

# A steady round's own time limit, on top of cold_timeout_s: the sweep's latency cap bounds it
# long before this; the limit only catches a runtime that hangs.
STEADY_ROUND_TIMEOUT_S = 1800.0


@dataclass
class ProcessBudget:
    """How many fresh processes a variant gets, and how long its required rounds measure, so that its
    whole benchmark — cold loads, steady rounds and the start from disk — stays within `budget_s`
    (0: no limit):
    - the required processes always run: MIN_STEADY_ROUNDS rounds (a spread needs two) and
      MIN_COLD_RUNS cold loads (the rounds' own processes are cold loads too, so a big model gets
      no cold-only one); but a required repeat round measures for at most what is left of the
      budget after its own cold load and the start from disk still to come (`round_allowance`: its
      interleaved passes stop there, the first always runs);
    - an optional process (a further round, a cold-only load) is not started once the time spent,
      plus what such a process took so far (its mean), plus the start from disk still to come
      (`reserve_s`), would pass the budget. A round that does not fit becomes a cold load only.
    For a 90 MB model every process fits (a few seconds each); a 2.2 GB one spends 3–5 s on each
    load and 15–20 s on each round, so two rounds and the start from disk already fill the budget."""
    budget_s: float                       # 0: no limit
    clock: Callable[[], float] = time.monotonic
    took: dict = field(default_factory=lambda: {"steady": [], "cold": []})
    cut: int = 0                          # processes not started or downgraded
    disk_load: bool = False               # a start from disk follows the series (benchmark.from_disk)
    loads: list = field(default_factory=list)         # each process's cold load (spawn → first call), s
    allowances: list = field(default_factory=list)    # what each required repeat round was allowed, s

    def __post_init__(self):
        self.started = self.clock()

    MIN_STEADY_ROUNDS = 2
    MIN_COLD_RUNS = 2

    def loaded(self, seconds: float) -> None:
        self.loads.append(seconds)

    def _load_guess(self) -> float:
        return sum(self.loads) / len(self.loads) if self.loads else 0.0

    @property
    def reserve_s(self) -> float:
        """The start from disk still to come: one more cold load (the mean so far)."""
        return self._load_guess() if self.disk_load else 0.0

    def _fits(self, kind: str) -> bool:
        past = self.took[kind] or self.took["steady"] or self.took["cold"]
        guess = sum(past) / len(past) if past else 0.0
        return not self.budget_s or self.clock() - self.started + guess + self.reserve_s <= self.budget_s

    settled: bool = False                 # the rounds agree: no further process is needed for them

    def required_round(self) -> bool:
        return len(self.took["steady"]) < self.MIN_STEADY_ROUNDS

    def round_allowed(self, rounds_agree: bool = False) -> bool:
        if self.required_round():
            return True
        if rounds_agree:
            self.settled = True
        elif self._fits("steady"):
            return True
        self.cut += 1
        return False

    def round_allowance(self) -> Optional[float]:
        """Seconds a required repeat round may measure for: the budget less the time spent, its own
        cold load and the start from disk still to come (each the mean cold load so far); None
        without a budget."""
        if not self.budget_s:
            return None
        left = self.budget_s - (self.clock() - self.started) - self._load_guess() - self.reserve_s
        self.allowances.append(round(max(0.0, left), 2))
        return max(0.0, left)

    def stop_before(self, i: int, spec) -> bool:
        if spec is not None or i < self.MIN_COLD_RUNS or (not self.settled and self._fits("cold")):
            return False
        self.cut += 1
        return True

    def ran(self, kind: str, seconds: float) -> None:
        self.took[kind].append(seconds)

    def as_dict(self) -> dict:
        return {"budget_s": self.budget_s, "steady_rounds": len(self.took["steady"]),
                "cold_only": len(self.took["cold"]), "cut": self.cut, "rounds_agreed": self.settled,
                "round_allowance_s": list(self.allowances) or None,
                "spent_s": round(self.clock() - self.started, 2)}


@dataclass(frozen=True)
class BenchmarkSettings:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    threads: int = 0                 # 0 → what one serving worker gets (see device.serving_threads)
    cold_runs: int = 5
    steady_runs: int = 5
    budget_s: float = 40.0           # per variant: see ProcessBudget
    rounds_agree_within: float = 0.03  # stop adding rounds once every size's round p50s agree this closely
    interleave_passes: int = 4
    warmup_iters: int = 5
    warmup_max_s: float = 1.0
    min_iters: int = 6
    min_duration_s: float = 0.3
    point_max_s: float = 2.0         # ...or this long with at least 3 calls (0: no cap); see StopRule
    max_cv: float = 0.15
    min_gain: float = 0.05
    sweep_patience: int = 2
    latency_cap_ms: float = 400.0     # see pipeline.core.params.BenchmarkParams
    text_length: int = 24
    tensorrt: bool = False           # ONNX on CUDA: ask the loader for the TensorRT EP first
    from_disk: bool = True           # one more cold start with the artifact dropped from the page cache
    inexact: str = "brief"           # how a variant that cannot win by default is measured (effort.py)
    cold_timeout_s: float = 300.0

    @classmethod
    def from_params(cls, bp) -> "BenchmarkSettings":
        """From pipeline.core.params.BenchmarkParams (already validated)."""
        shared = {f.name: getattr(bp, f.name) for f in fields(cls) if hasattr(bp, f.name)}
        return cls(**{**shared, "batch_sizes": tuple(bp.batch_sizes)})

    def round_spec(self, batch_sizes, sweep: bool, max_s: Optional[float] = None) -> RoundSpec:
        return RoundSpec(tuple(batch_sizes), sweep, self.interleave_passes, self.warmup_iters, self.warmup_max_s, self.min_iters,
                         self.min_duration_s, self.max_cv, self.min_gain, self.sweep_patience, self.latency_cap_ms,
                         self.point_max_s or None, max_s)


def outcome_record(variant: str, status: str, reason: Optional[str], device: str,
                   threads: Optional[int], artifact_bytes: Optional[int] = None) -> dict:
    """The record's frame; figures stay empty for skipped / failed variants."""
    return {"variant": variant, "status": status, "reason": reason, "device": device, "threads": threads,
            "artifact_bytes": artifact_bytes, "cold_load": None, "steady": {}, "stopped_early": None,
            "peak_rss_mb": None, "noisy": False}


def _progress(total: int, desc: str):
    """tqdm on a terminal only; quiet in CI / dvc logs."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="process", disable=not sys.stderr.isatty(), leave=False)


def repeat_sizes(first_round: dict, latency_cap_ms: float) -> list[int]:
    """The sizes later rounds re-measure: those the first round measured, except one whose p99 was
    past the latency cap (it only shows where the curve leaves the usable range; measured once)."""
    keep = []
    for b, point in first_round["points"].items():
        if LatencySummary.from_samples(point["samples_s"], int(b)).p99_ms <= latency_cap_ms:
            keep.append(int(b))
    return keep


def rounds_agree(rounds: list[dict], within: float) -> bool:
    """Every size the later rounds re-measure has round p50s within `within` of each other
    (RepeatedLatency.spread), over at least two rounds: another round would move the figures less
    than the tie band selection applies anyway, so the process is saved (0: never)."""
    if within <= 0 or len(rounds) < ProcessBudget.MIN_STEADY_ROUNDS:
        return False
    later = rounds[1:]
    sizes = set.intersection(*(set(r["points"]) for r in later))
    if not sizes:
        return False
    for key in sizes:
        rep = RepeatedLatency(tuple(LatencySummary.from_samples(r["points"][key]["samples_s"], int(key))
                                    for r in rounds if key in r["points"]))
        if rep.spread > within:
            return False
    return True


def host_reference(rounds: list[dict]) -> HostReference:
    """The reference windows every round timed (none from a child that predates them)."""
    return HostReference(tuple(tuple(r.get("reference_ms") or ()) for r in rounds))


def combine_rounds(rounds: list[dict], max_cv: float) -> dict:
    """Per batch size (the first round's sizes): the pooled figures, every round's p50 and their
    spread, flagged noisy when a round stayed noisy or the rounds disagree by more than max_cv.
    Peak memory comes from the sweep round: it runs the sizes in increasing order, so its peak at
    a size is what that size (and the smaller ones) need; an interleaved round has seen them all.
    `p50_ref`: the p50 in units of the host reference kernel's time (comparable across runs)."""
    ref_ms = host_reference(rounds).median_ms
    steady = {}
    for key, first in rounds[0]["points"].items():
        pts = [r["points"][key] for r in rounds if key in r["points"]]
        rep = RepeatedLatency(tuple(LatencySummary.from_samples(p["samples_s"], int(key)) for p in pts))
        figures = rep.as_dict()
        steady[key] = {**figures, "p50_ref": per_reference(figures["p50_ms"], ref_ms),
                       "noisy": any(p["noisy"] for p in pts) or rep.spread > max_cv,
                       "remeasured": any(p["remeasured"] for p in pts),
                       "peak_rss_mb": first["peak_rss_mb"],
                       "peak_gpu_mb": first.get("peak_gpu_mb"),
                       "cpu_share": min(p["cpu_share"] for p in pts)}
    return steady


def benchmark_variant(model_dir, variant: str, settings: BenchmarkSettings, device: str,
                      loader: str = DEFAULT_LOADER, feeds: str = DEFAULT_FEEDS) -> dict:
    """Measure one converted variant; raises on failure (the caller records it)."""
    model_dir = Path(model_dir)
    meta = read_variant(model_dir)
    threads = serving_threads(device, settings.threads)
    seq_len = settings.text_length if meta.get("task", {}).get("kind") == "text-embedding" else None
    files = artifact_files(model_dir, meta)
    started = time.monotonic()
    processes = max(settings.cold_runs, settings.steady_runs)   # every steady round starts as a cold run
    bar = _progress(processes, f"benchmark {variant}")
    budget = ProcessBudget(settings.budget_s, disk_load=settings.from_disk)
    current = {"kind": "cold", "since": time.monotonic()}

    def round_for(i: int, done: list) -> Optional[RoundSpec]:
        spec = None
        if i == 0:
            spec = settings.round_spec(settings.batch_sizes, sweep=True)
        elif i < settings.steady_runs:
            required = budget.required_round()
            if budget.round_allowed(rounds_agree(done, settings.rounds_agree_within)):
                sizes = repeat_sizes(done[0], settings.latency_cap_ms)
                if sizes:
                    spec = settings.round_spec(sizes, sweep=False,
                                               max_s=budget.round_allowance() if required else None)
        current.update(kind="cold" if spec is None else "steady", since=time.monotonic())
        return spec

    def on_run(i: int, run=None):
        budget.ran(current["kind"], time.monotonic() - current["since"])
        if run is not None and run.phases.get("total"):
            budget.loaded(run.phases["total"])
        bar.update()

    try:
        runs = measure_fresh_processes(model_dir, processes, files, loader, feeds, device, threads, seq_len,
                                       settings.cold_timeout_s, settings.tensorrt, round_for=round_for,
                                       steady_timeout_s=STEADY_ROUND_TIMEOUT_S, on_run=on_run,
                                       stop_before=budget.stop_before, from_disk=settings.from_disk)
    finally:
        bar.close()
    log.info("%s: %s", variant, runs.cold.render())
    if runs.disk is not None:
        log.info("%s: %s", variant, runs.disk.render())
    if budget.cut:
        why = (f"the rounds agree within benchmark.rounds_agree_within {settings.rounds_agree_within:g}"
               if budget.settled else f"within benchmark.budget_s {settings.budget_s:g} s")
        log.info("%s: %d steady round(s) and %d cold load(s): %s (%d process(es) not started or cold-only)",
                 variant, len(budget.took["steady"]), runs.cold.runs, why, budget.cut)
    steady = combine_rounds(runs.rounds, settings.max_cv)
    for key, point in steady.items():
        log.info("%s: batch %s: p50 %.2f ms (rounds %s), p99 %.2f ms, cv %.1f%%, spread %.1f%%, %.1f samples/s%s",
                 variant, key, point["p50_ms"], point["round_p50_ms"], point["p99_ms"], 100 * point["cv"],
                 100 * point["spread"], point["throughput_sps"], "  NOISY" if point["noisy"] else "")
    reference = host_reference(runs.rounds).as_dict()
    log.info("%s: host reference %s", variant, reference)
    stopped_early = runs.rounds[0]["stopped_early"]
    if stopped_early:
        log.info("%s: sweep stopped after batch %s: %s", variant, stopped_early["after_batch"], stopped_early["why"])

    record = outcome_record(variant, "ok", None, device, threads, runs.cold.artifact_bytes)
    cold = runs.cold.as_dict()
    if runs.disk is not None:
        cold["from_disk"] = runs.disk.as_dict()
    passes = [r["passes"] for r in runs.rounds if r.get("passes")]
    if any(p.get("run") is not None and p["run"] < p["of"] for p in passes):
        log.info("%s: repeat round(s) cut to fit benchmark.budget_s %g s: passes %s", variant, settings.budget_s,
                 [f"{p['run']}/{p['of']}" for p in passes])
    record.update({
        "cold_load": cold,
        "steady": steady,
        "stopped_early": stopped_early,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs.rounds),
        "host_reference": reference,
        "noisy": any(p["noisy"] for p in steady.values()),
        "settings": asdict(settings),
        "processes": {**budget.as_dict(), "repeat_passes": passes or None},
        "duration_s": round(time.monotonic() - started, 2),
    })
    if feeds == DEFAULT_FEEDS and meta.get("task", {}).get("tokenizer"):
        # The text a curve was measured on: a rerank row is a (query, passage) pair, not a sentence.
        record["feeds"] = describe_feeds(model_dir, sorted(int(k) for k in steady), seq_len)
    return record


def curve_rows(record: dict) -> list[dict]:
    """Plot data: latency and throughput vs batch size."""
    return [{"variant": record["variant"], "batch_size": int(b), "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"],
             "throughput_sps": s["throughput_sps"]} for b, s in (record.get("steady") or {}).items()]


def throughput_rows(record: dict) -> list[dict]:
    """Plot data: throughput vs batch size (its own folder: DVC plots one y field set per folder)."""
    return [{"variant": r["variant"], "batch_size": r["batch_size"], "throughput_sps": r["throughput_sps"]}
            for r in curve_rows(record)]


def load_rows(record: dict) -> list[dict]:
    """Plot data: cold-load breakdown (median per phase) with the raw-read floor."""
    cold = record.get("cold_load")
    if not cold:
        return []
    rows = [{"variant": record["variant"], "phase": name, "ms": p["median"]}
            for name, p in cold["phases_ms"].items() if name not in ("phases_sum", "total")]
    rows.append({"variant": record["variant"], "phase": "raw_read", "ms": cold["raw_read_ms"]})
    return rows


def read_conversion(model_dir) -> tuple[Optional[dict], str, Optional[str]]:
    """(record, status, reason) of the variant's conversion.json; a missing one reads as not converted."""
    import json
    path = Path(model_dir) / "conversion.json"
    if not path.is_file():
        return None, "missing", (f"{path} not found: the variant was not converted "
                                 f"(run `dvc repro convert@{Path(model_dir).name}`)")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, "unreadable", f"{path} is not valid JSON ({e})"
    return doc, str(doc.get("status")), doc.get("reason")


def conversion_status(model_dir) -> tuple[str, Optional[str]]:
    """(status, reason) from the variant's conversion.json."""
    return read_conversion(model_dir)[1:]


def benchmark_or_record(model_dir, variant: str, settings: BenchmarkSettings, device: str,
                        loader: str = DEFAULT_LOADER, feeds: str = DEFAULT_FEEDS) -> dict:
    """Never raises: a variant that was not converted is `skipped`, a benchmark that fails is
    `failed` with the reason — one variant's trouble never stops the others. The runtime only ever
    runs in child processes, so even one that kills its interpreter (segfault, abort, OOM kill)
    becomes a `failed` record here."""
    status, reason = conversion_status(model_dir)
    if status != "converted":
        why = f"conversion status is {status!r}" + (f": {reason}" if reason else "")
        log.warning("%s: skipped (%s)", variant, why)
        return outcome_record(variant, "skipped", why, device, serving_threads(device, max(settings.threads, 0)))
    try:
        return benchmark_variant(model_dir, variant, settings, device, loader, feeds)
    except Exception as e:
        log.exception("%s: benchmark failed", variant)
        return outcome_record(variant, "failed", f"{type(e).__name__}: {str(e)[:2000]}", device,
                              serving_threads(device, max(settings.threads, 0)))
