"""pipeline/serve/server/server_floor.py: the do-nothing model's READY in a real TorchServe 0.12, and the
READY / (floor + raw read) ratio issue 13 judges a served model by."""
from __future__ import annotations

import json
import shutil
import time
import zipfile

import pytest

from pipeline.serve.server.server_floor import NOOP_NAME, measure_server_floor, readiness_vs_floor
from pipeline.serve.server.processes import processes_of
from pipeline.serve.server.torchserve_logs import ServerLogs

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")


def worker_load_lines(server_dir) -> list[str]:
    text = (server_dir / "logs" / "ts_metrics.log").read_text()
    return [line for line in text.splitlines() if "WorkerLoadTime" in line and f"-{NOOP_NAME}_" in line]


@pytest.mark.torchserve
@needs_java
def test_primed_floor_is_the_second_start_with_every_worker(tmp_path):
    t0 = time.monotonic()
    floor = measure_server_floor(tmp_path, workers=2, prime=True)
    wall_s = time.monotonic() - t0
    assert floor["ready"], floor.get("error")
    assert (floor["workers"], floor["primed"]) == (2, True)
    # Two starts ran; the figure is the second's, well inside the wall time of both.
    first, second = tmp_path / "server0", tmp_path / "server1"
    assert len(worker_load_lines(first)) == 2 and len(worker_load_lines(second)) == 2
    assert floor["worker_load_ms"] == ServerLogs(second / "logs", NOOP_NAME).worker_load_ms()
    assert 0 < floor["ready_s"] < wall_s
    # READY is seen after the slowest worker loaded, on a clock that started before java.
    assert floor["worker_load_ms"] / 1000.0 <= floor["ready_s"]
    # The packaged model really is the do-nothing one with both workers.
    with zipfile.ZipFile(tmp_path / "store" / f"{NOOP_NAME}.mar") as mar:
        assert "minWorkers: 2\nmaxWorkers: 2\n" in mar.read("model-config.yaml").decode()
        assert json.loads(mar.read("MAR-INF/MANIFEST.json"))["model"]["handler"] == "noop_handler.py"
    assert processes_of(first) == [] and processes_of(second) == []


@pytest.mark.torchserve
@needs_java
def test_unprimed_floor_starts_once_under_the_served_config(tmp_path):
    config = tmp_path / "served.properties"
    config.write_text("job_queue_size=37\ndefault_response_timeout=11\n")
    floor = measure_server_floor(tmp_path / "floor", workers=1, config=config, prime=False)
    assert floor["ready"], floor.get("error")
    assert (floor["workers"], floor["primed"]) == (1, False)
    server = tmp_path / "floor" / "server0"
    assert not (tmp_path / "floor" / "server1").exists()
    # The served config is the base of the floor server's own (its overrides come after it).
    assert (server / "config.properties").read_text().startswith(config.read_text())
    assert len(worker_load_lines(server)) == 1
    assert floor["worker_load_ms"] / 1000.0 <= floor["ready_s"]
    assert processes_of(server) == []


@pytest.mark.torchserve
def test_a_server_that_cannot_start_is_reported_not_raised(tmp_path):
    """`env` reaches the server: with JAVA_HOME pointing nowhere, TorchServe's CLI finds no java."""
    floor = measure_server_floor(tmp_path, workers=3, env={"JAVA_HOME": str(tmp_path / "no-java")}, prime=True)
    assert floor["ready"] is False and floor["workers"] == 3
    assert "torchserve --start` failed" in floor["error"] and "java not found" in floor["error"]
    assert not (tmp_path / "server1").exists()          # no second try after a failed priming start


def test_readiness_vs_floor_divides_ready_by_floor_plus_raw_read():
    floor = {"ready": True, "ready_s": 2.0, "workers": 2}
    got = readiness_vs_floor(3.75, floor, raw_read_ms=500.0)
    assert got == {"floor_ready_s": 2.0, "floor_workers": 2, "raw_read_s": 0.5, "floor_plus_read_s": 2.5,
                   "ready_s": 3.75, "ratio": 1.5}
    assert readiness_vs_floor(1.23456, {"ready": True, "ready_s": 1.0}, 0.0)["ratio"] == 1.235
    assert readiness_vs_floor(1.0, {"ready": True, "ready_s": 0.0}, 0.0)["ratio"] is None


@pytest.mark.parametrize("ready_s,floor,raw_read_ms", [
    (None, {"ready": True, "ready_s": 2.0}, 10.0),
    (3.0, None, 10.0),
    (3.0, {"ready": False, "error": "java not found"}, 10.0),
    (3.0, {"ready": True, "ready_s": 2.0}, None),
])
def test_readiness_vs_floor_is_none_when_a_figure_is_missing(ready_s, floor, raw_read_ms):
    assert readiness_vs_floor(ready_s, floor, raw_read_ms) is None
