"""Exclusive use of a device: two benchmark runs (e.g. parallel `dvc exp run` jobs, each in its own
workspace) must never measure on the same device at the same time.

The lock file lives outside any workspace (machine-wide temp dir, or $PIPELINE_LOCK_DIR) so every
workspace on the machine sees the same one.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)
LOCK_DIR_ENV = "PIPELINE_LOCK_DIR"


class DeviceBusyError(RuntimeError):
    """Another benchmark held the device for longer than we were willing to wait."""


def lock_path(device: str, lock_dir: Optional[os.PathLike | str] = None) -> Path:
    base = Path(lock_dir or os.environ.get(LOCK_DIR_ENV) or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    # all CPU benchmarks share the CPU; each GPU index its own lock
    return base / f"model-pipeline-benchmark-{device.replace(':', '_')}.lock"


@contextlib.contextmanager
def device_lock(device: str, timeout_s: Optional[float] = None,
                lock_dir: Optional[os.PathLike | str] = None) -> Iterator[float]:
    """Hold the device exclusively; yields the seconds spent waiting. timeout_s None → wait forever."""
    path = lock_path(device, lock_dir)
    holder = path.with_suffix(".holder")
    lock = FileLock(str(path))
    t0 = time.monotonic()
    try:
        lock.acquire(timeout=0)
    except Timeout:
        who = holder.read_text().strip() if holder.exists() else "another process"
        log.info("device %s is busy (held by %s); waiting for %s", device, who, path)
        try:
            lock.acquire(timeout=-1 if timeout_s is None else timeout_s)
        except Timeout:
            raise DeviceBusyError(
                f"device {device!r} stayed locked by {who} for {timeout_s:.0f} s ({path}); another benchmark "
                f"is running — wait for it to finish, or delete the lock file if no benchmark runs") from None
    waited = time.monotonic() - t0
    try:
        holder.write_text(f"pid {os.getpid()}")
        yield waited
    finally:
        with contextlib.suppress(OSError):
            holder.unlink()
        lock.release()


@contextlib.contextmanager
def measuring(stage: str, env_json: Optional[Path] = None, lock_dir: Optional[os.PathLike | str] = None) -> Iterator[float]:
    """A stage that measures in servers (tune, serve_check) holds the device as a benchmark does: two
    experiments run at once (`dvc queue start -j 2`) take turns instead of measuring each other's load.
    The device is the probe's (artifacts/env.json), CPU when it has not run."""
    import json
    if not logging.getLogger().handlers:        # the stage's own logging starts after the wait
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if env_json is None:
        from pipeline.core.paths import ENV_JSON
        env_json = ENV_JSON
    try:
        device = json.loads(Path(env_json).read_text())["device"]
    except (OSError, ValueError, KeyError):
        device = "cpu"
    with device_lock(device, None, lock_dir) as waited:
        if waited > 1:
            log.warning("%s waited %.0f s for the %s device: another experiment was measuring on it", stage, waited,
                        device)
        yield waited
