"""The device lock, across real processes: critical sections never overlap; a waiter times out
with a clear error naming the holder."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.measure.lock import DeviceBusyError, device_lock, lock_path
from pipeline.core.params import REPO_ROOT

HOLDER = """
import json, sys, time
from pipeline.measure.lock import device_lock
lock_dir, hold_s, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
with device_lock("cpu", None, lock_dir) as waited:
    start = time.time()
    print("LOCKED", flush=True)
    time.sleep(hold_s)
    end = time.time()
open(out, "w").write(json.dumps({"start": start, "end": end, "waited": waited}))
"""


def _spawn(tmp_path: Path, name: str, hold_s: float) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"{name}.json"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "locks"), str(hold_s), str(out)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    return proc, out


def test_two_processes_never_hold_the_device_at_once(tmp_path):
    procs = [_spawn(tmp_path, f"p{i}", 0.6) for i in range(2)]
    for proc, _ in procs:
        assert proc.wait(timeout=60) == 0
    a, b = sorted((json.loads(out.read_text()) for _, out in procs), key=lambda r: r["start"])
    assert a["end"] <= b["start"], f"critical sections overlap: {a} {b}"
    assert b["waited"] > 0.3        # the second one really waited for the first


def test_waiter_times_out_with_the_holders_pid(tmp_path):
    proc, _ = _spawn(tmp_path, "holder", 5.0)
    try:
        assert proc.stdout.readline().strip() == "LOCKED"
        t0 = time.monotonic()
        with pytest.raises(DeviceBusyError, match=rf"device 'cpu' stayed locked by pid {proc.pid}"):
            with device_lock("cpu", timeout_s=0.3, lock_dir=tmp_path / "locks"):
                pass
        assert time.monotonic() - t0 < 4.0
    finally:
        proc.kill()
        proc.wait()
    # the holder died without unlocking: the OS released its lock, the next run proceeds at once
    with device_lock("cpu", timeout_s=2, lock_dir=tmp_path / "locks") as waited:
        assert waited < 2


def test_locks_are_per_device_and_outside_the_workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_LOCK_DIR", str(tmp_path))
    assert lock_path("cpu").parent == tmp_path
    assert lock_path("cpu") != lock_path("cuda")
    with device_lock("cpu"):
        with device_lock("cuda", timeout_s=0.1):     # another device is not blocked
            pass


def test_a_serving_stage_waits_for_a_benchmark_of_another_experiment(tmp_path):
    """tune and serve_check hold the probe's device as benchmarks do: two queued experiments take turns."""
    from pipeline.measure.lock import measuring
    env_json = tmp_path / "env.json"
    env_json.write_text(json.dumps({"device": "cpu"}))
    proc, out = _spawn(tmp_path, "bench", 1.0)
    assert proc.stdout.readline().strip() == "LOCKED"
    with measuring("serve_check", env_json, tmp_path / "locks") as waited:
        entered = time.time()
    assert proc.wait(timeout=60) == 0
    held = json.loads(out.read_text())
    assert entered >= held["end"] and waited > 0.3, (held, entered, waited)
