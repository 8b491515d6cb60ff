"""Fresh benchmark processes: each times one cold start phase by phase and, when asked, runs a
steady-state round (pipeline.measure.child); plus the raw-read floor of the artifact."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from pipeline.measure import pagecache
from pipeline.measure.child import MARKER
from pipeline.measure.stats import ColdLoadSummary, DiskLoad
from pipeline.measure.steady import RoundSpec
from pipeline.core.params import REPO_ROOT

DEFAULT_LOADER = "handlers.runtimes:load_runtime"
DEFAULT_FEEDS = "pipeline.measure.feeds:example_feeds"


class BenchmarkChildError(RuntimeError):
    """A fresh benchmark process failed, timed out or died; the message carries its stderr tail."""


def thread_env(threads: Optional[int]) -> dict:
    """Environment for a child: intra-op threads pinned before any runtime is imported."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    if threads:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[k] = str(threads)
    return env


@dataclass(frozen=True)
class FreshRun:
    phases: dict[str, float]            # cold-start phase → seconds, with `interpreter` and `total`
    steady: Optional[dict]              # the steady-state round (child.steady_round), when one was asked


def run_fresh_process(model_dir, loader: str = DEFAULT_LOADER, feeds: str = DEFAULT_FEEDS, device: str = "cpu",
                      threads: Optional[int] = None, seq_len: Optional[int] = None,
                      timeout_s: float = 300.0, tensorrt: bool = False, steady: Optional[RoundSpec] = None,
                      python: str = sys.executable) -> FreshRun:
    """One fresh process: its cold start (`total` = spawn → first call done), then the steady round."""
    # -X faulthandler: a process killed by a signal (a native library's crash) leaves its Python stack.
    cmd = [python, "-X", "faulthandler", "-m", "pipeline.measure.child", "--model-dir", str(model_dir),
           "--loader", loader, "--feeds", feeds, "--device", device]
    if threads:
        cmd += ["--threads", str(threads)]
    if seq_len:
        cmd += ["--seq-len", str(seq_len)]
    if tensorrt:
        cmd += ["--tensorrt"]
    if steady is not None:
        cmd += ["--steady", json.dumps(steady.as_dict())]
    # Cold means no compile caches either: each run gets an empty TMPDIR and inductor cache, as a
    # TorchServe worker on a fresh host (or with its own TEMP) has. AOTInductor compiles CPU probes
    # at load (~10 s) — a cost the startupTimeout must cover.
    scratch = tempfile.mkdtemp(prefix="cold-load-")
    env = thread_env(threads)
    env.update(TMPDIR=scratch, TEMP=scratch, TMP=scratch, TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor"))
    spawned_at = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              cwd=str(REPO_ROOT), env=env)
    except subprocess.TimeoutExpired:
        raise BenchmarkChildError(f"benchmark process for {model_dir} ran over {timeout_s:.0f} s; killed") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(MARKER)), None)
    if proc.returncode != 0 or line is None:
        code = proc.returncode
        how = f"died (signal {-code})" if code < 0 else f"failed (exit code {code})"
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        raise BenchmarkChildError(f"benchmark process for {model_dir} {how}: {tail}")
    result = json.loads(line[len(MARKER):])
    phases = dict(result["phases"])
    phases["interpreter"] = max(0.0, result["started_at"] - spawned_at)
    phases["total"] = result["done_at"] - spawned_at
    return FreshRun(phases, result.get("steady"))


def artifact_files(model_dir, variant: dict) -> list[Path]:
    """The artifact and its sidecars (e.g. model.onnx.data): the bytes a load must read."""
    folder = Path(model_dir)
    name = variant["artifact"]
    listed = set(variant.get("files") or [])
    files = [folder / name] + [folder / f for f in sorted(listed) if f != name and f.startswith(name)]
    packed = (variant.get("prepacked") or {}).get("artifact")       # the graph a CPU session may read instead
    if packed and packed in listed:
        files.append(folder / packed)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"artifact file(s) missing: {', '.join(missing)}; re-run the variant's convert stage")
    return files


def raw_read_seconds(files: Sequence[Path], repeats: int = 3, chunk: int = 16 * 2**20) -> float:
    """Median time to read the files' bytes with plain reads into one buffer: the floor any
    loader pays for these bytes on this disk / page cache."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(view):
                    pass
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# Share of an artifact's bytes that may stay cached after dropping them for a disk-load run to
# still count as one (a few pages another process holds mapped do not make it a memory read).
MAX_RESIDENT_FOR_DISK = 0.05
# The disk's sequential read rate is a property of the disk, not of the artifact: the disk read
# after the disk-load start reads at most this many of the artifact's bytes and prices the rest at
# that rate (a 3.4 GB ONNX variant read whole took 7.6 s on a 450 MB/s disk; its first 256 MiB give
# the same rate in 0.6 s). Smaller artifacts are read whole, as before.
DISK_READ_SAMPLE_BYTES = 256 * 2**20


def disk_read_seconds(files: Sequence[Path], sample_bytes: int = DISK_READ_SAMPLE_BYTES,
                      chunk: int = 16 * 2**20) -> tuple[float, int]:
    """(seconds to read all of `files`, bytes actually read): a plain sequential read of their
    first `sample_bytes` bytes (in the files' order), scaled to their whole size; every byte when
    they are smaller. The caller drops them from the page cache first."""
    total = sum(f.stat().st_size for f in files)
    buf = bytearray(chunk)
    view = memoryview(buf)
    left, read = max(1, sample_bytes), 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while left > 0:
                n = fh.readinto(view[:min(chunk, left)])
                if not n:
                    break
                read += n
                left -= n
        if left <= 0:
            break
    seconds = time.perf_counter() - t0
    return (seconds * total / read if read else seconds), read


def measure_from_disk(artifact_paths: Sequence[Path], start: Callable[[], FreshRun]) -> DiskLoad:
    """Drop the artifact's bytes from the page cache, then `start()` one fresh process (its cold
    start reads from the disk); then drop them again and time a plain read of them from the disk
    (of up to DISK_READ_SAMPLE_BYTES of them, scaled to the whole: `disk_read_seconds`)."""
    size = sum(p.stat().st_size for p in artifact_paths)
    why = pagecache.supported()
    if why:
        return DiskLoad.unavailable(why, size)
    left = pagecache.evict(artifact_paths)
    if left > MAX_RESIDENT_FOR_DISK:
        return DiskLoad.unavailable(f"{100 * left:.0f}% of the artifact stayed in memory after dropping it "
                                    f"(a filesystem held in memory, e.g. tmpfs, or another process maps it)",
                                    size, left)
    run = start()
    pagecache.evict(artifact_paths)
    seconds, read = disk_read_seconds(artifact_paths, DISK_READ_SAMPLE_BYTES)
    return DiskLoad(run.phases, seconds, size, left, raw_read_bytes=read)


@dataclass(frozen=True)
class FreshRuns:
    cold: ColdLoadSummary
    rounds: list[dict]                  # steady-state rounds, in the order they ran
    disk: Optional[DiskLoad] = None     # the cold start from disk, when asked


def measure_fresh_processes(model_dir, runs: int, artifact_paths: Sequence[Path], loader: str = DEFAULT_LOADER,
                            feeds: str = DEFAULT_FEEDS, device: str = "cpu", threads: Optional[int] = None,
                            seq_len: Optional[int] = None, timeout_s: float = 300.0, tensorrt: bool = False,
                            round_for: Optional[Callable[[int, list], Optional[RoundSpec]]] = None,
                            steady_timeout_s: float = 0.0, on_run=None,
                            stop_before: Optional[Callable[[int, Optional[RoundSpec]], bool]] = None,
                            from_disk: bool = False) -> FreshRuns:
    """Up to `runs` fresh processes, each a cold start; `round_for(i, rounds_so_far)` names the
    steady-state round process i continues with (None: cold start only), so a later round can
    depend on what the first one found; `stop_before(i, spec)` true ends the series there.
    `from_disk`: one more cold start after them, with the artifact dropped from the page cache.
    `on_run(i, run)` is called after each process with its FreshRun."""
    if runs < 1:
        raise ValueError(f"benchmark.cold_runs must be >= 1, got {runs}")
    samples, rounds = [], []
    for i in range(runs):
        spec = round_for(i, rounds) if round_for else None
        if stop_before is not None and i > 0 and stop_before(i, spec):
            break
        run = run_fresh_process(model_dir, loader, feeds, device, threads, seq_len,
                                timeout_s + (steady_timeout_s if spec else 0.0), tensorrt, spec)
        samples.append(run.phases)
        if run.steady is not None:
            rounds.append(run.steady)
        if on_run:
            on_run(i, run)
    # As many reads of the bytes as cold loads were measured (the budget may have started fewer
    # processes than `runs`: a 2 GB variant read its artifact 5 times beside its 2 loads).
    raw = raw_read_seconds(artifact_paths, repeats=len(samples))
    disk = None
    if from_disk:
        disk = measure_from_disk(artifact_paths, lambda: run_fresh_process(
            model_dir, loader, feeds, device, threads, seq_len, timeout_s, tensorrt))
    cold = ColdLoadSummary.from_runs(samples, raw, sum(p.stat().st_size for p in artifact_paths))
    return FreshRuns(cold, rounds, disk)
