"""pipeline/serve/server/torchserve_logs.py on log files written the way TorchServe 0.12 writes them.

The frontend and metric lines below were copied from a real TorchServe 0.12 run (the double model of
tests/serve/test_torchserve.py, batchSize 4, six concurrent requests); the `[load]` lines are the
message a real handler (handlers/serving.py) logs at initialize, behind the prefix TorchServe's
frontend puts on a worker's stdout. The reading against a live server is covered in test_torchserve.py.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.serve.server.torchserve_logs import ServerLogs, read_from, tail

# One batch of four and one of two, as the Python backend formed them.
BATCH_OF_4 = ["9fdc2c1c-05fc-431f-9328-02631a52308c", "c8610e13-3cc8-4780-b5e9-8b72bc0d6792",
              "60e86338-9864-4657-8cc3-763cbd2e920e", "e2c93683-5d77-4cd8-a33c-2dc1511c450a"]
BATCH_OF_2 = ["068f764c-0460-4f6a-a3c2-658df8a7d75c", "efe0db45-1295-4355-8651-ae3b23c8671a"]

# model_metrics.log (metrics_mode log): one PredictionTime line per batch, every request id in it.
MODEL_METRICS = (
    "2026-12-05T13:31:06,977 - PredictionTime.ms:0.02|#ModelName:double,Level:Model|#hostname:vm,requestID:"
    + ",".join(BATCH_OF_4) + ",timestamp:1796477466\n"
    "2026-12-05T13:31:07,292 - PredictionTime.ms:0.02|#ModelName:double,Level:Model|#hostname:vm,requestID:"
    + ",".join(BATCH_OF_2) + ",timestamp:1796477467\n")

# ts_log.log echoes the worker's raw [METRICS] line (twice) and the MODEL_METRICS line.
TS_LOG_BATCH_4 = "".join(
    f"2026-12-05T13:31:06,976 [INFO ] W-9000-double_1.0-stdout org.pytorch.serve.wlm.WorkerLifeCycle - "
    f"result=[METRICS]PredictionTime.Milliseconds:0.02|#ModelName:double,Level:Model|#type:GAUGE|"
    f"#hostname:vm,1796477466,{','.join(BATCH_OF_4)}, pattern=[METRICS]\n" for _ in range(2))
TS_LOG_BATCH_2 = (
    "2026-12-05T13:31:07,292 [INFO ] W-9000-double_1.0-stdout org.pytorch.serve.wlm.WorkerLifeCycle - "
    "result=[METRICS]PredictionTime.Milliseconds:0.02|#ModelName:double,Level:Model|#type:GAUGE|"
    f"#hostname:vm,1796477467,{','.join(BATCH_OF_2)}, pattern=[METRICS]\n")
WARN_ALLOWED_URLS = ("2026-12-05T13:31:04,021 [WARN ] main org.pytorch.serve.util.ConfigManager - Your torchserve "
                     "instance can access any URL to load models. When deploying to production, make sure to "
                     "limit the set of allowed_urls in config.properties")
WARN_NO_PID = ("2026-12-05T13:31:05,425 [WARN ] pool-3-thread-1 org.pytorch.serve.metrics.MetricCollector - "
               "worker pid is not available yet.")
ERROR_DIED = ("2026-12-05T13:31:09,101 [ERROR] W-9000-double_1.0 org.pytorch.serve.wlm.WorkerThread - "
              "Backend worker error")
INFO_LINE = ("2026-12-05T13:31:06,942 [INFO ] W-9000-double_1.0 org.pytorch.serve.wlm.WorkerThread - "
             "Backend response time: 74")


def worker_load_line(worker: str, ms: float) -> str:
    """ts_metrics.log's WorkerLoadTime line for worker `W-<port>-<model>_<version>`."""
    return (f"2026-12-05T13:31:06,942 - WorkerLoadTime.Milliseconds:{ms}|#WorkerName:{worker},Level:Host"
            f"|#hostname:vm,timestamp:1796477466\n")


def model_log(worker: str, message: str) -> str:
    """A worker's stdout line as the frontend writes it to model_log.log (the worker logs "%(message)s")."""
    return f"2026-12-05T13:31:06,825 [INFO ] {worker}-stdout MODEL_LOG - {message}\n"


@pytest.fixture
def logs(tmp_path) -> Path:
    folder = tmp_path / "logs"
    folder.mkdir()
    return folder


# --------------------------------------------------------------------------- read_from, tail
def test_read_from_returns_whole_lines_and_keeps_a_partial_one_for_later(tmp_path):
    path = tmp_path / "ts_log.log"
    assert read_from(path, 7) == ("", 7)                   # not written yet: offset unchanged
    path.write_bytes(b"first line\nsecond, half")
    text, offset = read_from(path, 0)
    assert (text, offset) == ("first line\n", len(b"first line\n"))
    with open(path, "ab") as f:
        f.write(b" written\nthird\n")
    text, offset = read_from(path, offset)
    assert text == "second, half written\nthird\n" and offset == path.stat().st_size
    assert read_from(path, offset) == ("", offset)         # nothing new


def test_tail_gives_the_last_lines_or_says_the_file_is_missing(tmp_path):
    path = tmp_path / "model_log.log"
    assert tail(path, 3) == "(model_log.log: not written)"
    path.write_text("".join(f"line {i}\n" for i in range(10)))
    assert tail(path, 3) == "line 7\nline 8\nline 9"
    assert tail(path, 50).splitlines()[0] == "line 0"


# --------------------------------------------------------------------------- WorkerLoadTime
def test_worker_load_ms_is_the_slowest_of_this_models_workers(logs):
    (logs / "ts_metrics.log").write_text(
        "2026-12-05T12:53:00,525 - MemoryUsed.Megabytes:903.921875|#Level:Host|#hostname:vm,timestamp:1796475180\n"
        + worker_load_line("W-9000-my_model_1.0", 1439.0)
        + worker_load_line("W-9001-my_model_1.0", 1494.0)
        # Another model whose name starts with this one's: not ours, however slow.
        + worker_load_line("W-9002-my_model_v2_1.0", 9999.0)
        + worker_load_line("W-9003-other_1.0", 8888.0))
    assert ServerLogs(logs, "my_model").worker_load_ms() == 1494.0
    assert ServerLogs(logs, "my_model_v2").worker_load_ms() == 9999.0
    assert ServerLogs(logs, "absent").worker_load_ms() is None


def test_worker_load_ms_is_none_before_the_metrics_file_exists(logs):
    assert ServerLogs(logs, "double").worker_load_ms() is None


# --------------------------------------------------------------------------- the handler's [load] line
def real_load_message(tmp_path, caplog, name: str) -> tuple[str, dict]:
    """The `[load]` message a real handler logs at initialize, with the phases it kept."""
    from handlers.torch_handler import TorchHandler
    from tests.handlers.test_handlers import load, make_variant
    folder, _ = make_variant(tmp_path / name, "tensor", "torchscript")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="handlers.serving"):
        handler = load(TorchHandler, folder)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[load] variant=")]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    return lines[0], handler.load_breakdown_ms


def test_handler_load_ms_parses_the_slowest_workers_load_line(logs, tmp_path, caplog):
    first, first_phases = real_load_message(tmp_path, caplog, "w0")
    second, second_phases = real_load_message(tmp_path, caplog, "w1")
    reader = ServerLogs(logs, "tiny")
    assert reader.handler_load_ms() is None                 # no model_log.log yet
    (logs / "model_log.log").write_text(
        model_log("W-9000-tiny_1.0", "Torch worker started.")
        + model_log("W-9000-tiny_1.0", first)
        # The prepack note is a [load] line too, with no phases: never taken for a load.
        + model_log("W-9001-tiny_1.0", "[load] weights pre-packed on another host: ORT packs them at load")
        + model_log("W-9001-tiny_1.0", second))
    slowest = max((first_phases, second_phases), key=lambda d: d["total"])
    assert reader.handler_load_ms() == slowest
    assert {"read", "deserialize", "adapter", "total"} <= set(slowest)


def test_handler_load_ms_reads_phases_after_a_setting_with_spaces(logs):
    # threads=runtime default holds a space, and the settings before ": " are not phases.
    (logs / "model_log.log").write_text(model_log(
        "W-9000-tiny_1.0", "[load] variant=onnx family=onnx format=onnx dtype=float32 device=cpu "
                           "threads=runtime default prepacked=yes: read=1.5ms session=20.25ms runtime_total=22.0ms "
                           "adapter=0.5ms warmup_bs8=4.0ms total=26.5ms"))
    assert ServerLogs(logs, "tiny").handler_load_ms() == {
        "read": 1.5, "session": 20.25, "runtime_total": 22.0, "adapter": 0.5, "warmup_bs8": 4.0, "total": 26.5}


# --------------------------------------------------------------------------- batches
def test_batches_are_read_once_from_either_log(logs):
    reader = ServerLogs(logs, "double")
    assert reader.batches() == []
    (logs / "ts_log.log").write_text(INFO_LINE + "\n" + TS_LOG_BATCH_4 + TS_LOG_BATCH_2)
    from_frontend = reader.batches()
    assert sorted(map(sorted, from_frontend)) == sorted([sorted(BATCH_OF_4), sorted(BATCH_OF_2)])
    # metrics_mode log also writes model_metrics.log: the same two batches, not four.
    (logs / "model_metrics.log").write_text(MODEL_METRICS)
    assert sorted(map(sorted, reader.batches())) == sorted(map(sorted, from_frontend))


def test_batch_sizes_for_counts_only_the_batches_holding_these_requests(logs):
    (logs / "model_metrics.log").write_text(MODEL_METRICS)
    reader = ServerLogs(logs, "double")
    assert reader.batch_sizes_for(BATCH_OF_4 + BATCH_OF_2) == Counter({4: 1, 2: 1})
    assert reader.batch_sizes_for([BATCH_OF_2[1]]) == Counter({2: 1})
    assert reader.batch_sizes_for([BATCH_OF_4[0], BATCH_OF_4[3], None]) == Counter({4: 1})


def test_batch_sizes_for_waits_for_a_batch_still_being_written(logs):
    """The metric line of the last batch lands after its response: the reader waits for it."""
    (logs / "model_metrics.log").write_text(MODEL_METRICS.splitlines(keepends=True)[0])
    reader = ServerLogs(logs, "double")

    def write_later():
        time.sleep(0.4)
        with open(logs / "model_metrics.log", "a") as f:
            f.write(MODEL_METRICS.splitlines(keepends=True)[1])

    writer = threading.Thread(target=write_later)
    writer.start()
    try:
        assert reader.batch_sizes_for(BATCH_OF_4 + BATCH_OF_2, wait_s=20) == Counter({4: 1, 2: 1})
    finally:
        writer.join()
    # A request that never ran: give up after wait_s with what was found.
    t0 = time.monotonic()
    assert reader.batch_sizes_for([BATCH_OF_2[0], "00000000-0000-0000-0000-000000000000"], wait_s=0.3) == Counter({2: 1})
    assert time.monotonic() - t0 >= 0.3


# --------------------------------------------------------------------------- failure reports
def test_log_tail_shows_the_worker_log_and_each_frontend_warning_once(logs):
    (logs / "model_log.log").write_text("".join(model_log("W-9000-double_1.0", f"line {i}") for i in range(30)))
    # The frontend writes many warnings twice in a row; stack frames and INFO lines are not wanted.
    (logs / "ts_log.log").write_text("\n".join([WARN_ALLOWED_URLS, WARN_ALLOWED_URLS, INFO_LINE, WARN_NO_PID,
                                                WARN_NO_PID, "\tat org.pytorch.serve.wlm.WorkerThread.run",
                                                ERROR_DIED]) + "\n")
    text = ServerLogs(logs, "double").log_tail(n=4)
    worker_part, frontend_part = text.split("(warnings/errors) ==\n")
    assert worker_part.startswith(f"== {logs / 'model_log.log'} ==\n")
    assert [line.rsplit(" - ", 1)[1] for line in worker_part.strip().splitlines()[1:-1]] == \
        ["line 26", "line 27", "line 28", "line 29"]
    # n // 2 = 2: the last two distinct warnings/errors.
    assert frontend_part.splitlines() == [WARN_NO_PID, ERROR_DIED]
    assert ServerLogs(logs, "double").log_tail(n=40).split("(warnings/errors) ==\n")[1].splitlines() == \
        [WARN_ALLOWED_URLS, WARN_NO_PID, ERROR_DIED]


def test_log_tail_of_a_server_that_wrote_nothing(logs):
    text = ServerLogs(logs, "double").log_tail()
    assert "(model_log.log: not written)" in text and text.endswith("(warnings/errors) ==\n")


def test_wait_for_python_error_sees_a_traceback_written_late(logs):
    reader = ServerLogs(logs, "broken")
    (logs / "model_log.log").write_text(model_log("W-9000-broken_1.0", "Torch worker started."))
    t0 = time.monotonic()
    assert reader.wait_for_python_error(timeout_s=0.3) is False
    assert time.monotonic() - t0 >= 0.3

    def write_later():
        time.sleep(0.3)
        with open(logs / "model_log.log", "a") as f:
            f.write(model_log("W-9000-broken_1.0", "Traceback (most recent call last):")
                    + model_log("W-9000-broken_1.0", "ModuleNotFoundError: No module named 'missing_dependency'"))

    writer = threading.Thread(target=write_later)
    writer.start()
    try:
        assert reader.wait_for_python_error(timeout_s=20) is True
    finally:
        writer.join()
