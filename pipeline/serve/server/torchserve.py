"""Run a real TorchServe 0.12 in isolation, know when its model is really READY, always stop it.

One `TorchServe` = one server in its own working dir: own cwd (logs/, key_file.json), own
TEMP/TMPDIR (pid file, worker sockets, unpacked models all follow java.io.tmpdir), its own free
loopback ports — gRPC included, since 7070/7071 always start — so parallel servers never collide.
The given config.properties is copied and overrides are appended: java.util.Properties (and the
CLI's naive parser) let a later duplicate key win, so the original stays byte-for-byte in front.

Readiness is the management API's `workers[].status == "READY"`, never /ping (which reports
Healthy while a worker is failing and retrying). A load that exceeds startupTimeout or a dying
worker is reported at once with the worker log's tail, and the server is stopped.
Token authorization stays on: keys come from the server's own key_file.json.

This module is the process lifecycle. Once started, `ts.api` (pipeline/serve/server/torchserve_http.py) makes
the HTTP calls and `ts.log` (pipeline/serve/server/torchserve_logs.py) reads what the server wrote.
"""
from __future__ import annotations

import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from pipeline.decide.properties import format_properties, start_command
from pipeline.decide.serve_config import TS_DEFAULT_MAX_REQUEST_SIZE
from pipeline.serve.server.torchserve_http import HOST, Client, Response, ServerApi, TorchServeError, read_properties  # noqa: F401
from pipeline.serve.server.torchserve_logs import ServerLogs, read_from, tail
from pipeline.serve.server.processes import _alive, free_ports, process_peak_rss_mb, processes_of
POLL_S = 0.05
# Frontend log lines that mean the model will not become READY on this attempt.
_STARTUP_TIMEOUT_MARK = "did not respond in given time"
_WORKER_DIED_MARKS = ("Backend worker process died", "Load model failed", "Worker died")


# Seconds a stopped server's JVM gets to exit on its own before it is killed (TorchServe.stop).
STOP_GRACE_S = 0.5

class ModelNotReady(TorchServeError):
    """The model did not become READY. `reason`: startup_timeout | worker_died | server_exited | timeout."""

    def __init__(self, message: str, reason: str, log_tail: str = "", *,
                 startup_timeout_s: Optional[float] = None, waited_s: Optional[float] = None):
        super().__init__(f"{message}\n--- worker/server log tail ---\n{log_tail}" if log_tail else message)
        self.reason = reason
        self.log_tail = log_tail
        self.startup_timeout_s = startup_timeout_s    # the model's startupTimeout as the server reported it
        self.waited_s = waited_s                      # `--start` → the failure was seen


@dataclass(frozen=True)
class Ports:
    inference: int
    management: int
    metrics: int
    grpc_inference: int
    grpc_management: int


@dataclass
class Readiness:
    ready_s: float                  # `torchserve --start` → first worker READY
    all_ready_s: float              # … → every listed worker READY
    worker_load_ms: Optional[float]  # TorchServe's WorkerLoadTime (max over this model's workers)
    description: dict = field(default_factory=dict)


def start_command_env(threads: int) -> dict:
    """The environment the generated start command sets for `threads` threads per worker (its
    thread variables: pipeline/decide/properties.start_command), so a server runs as deployed."""
    return start_command(model_name="m", model_store=".", config_path=".", threads=threads)["env"]


def _torchserve_cli() -> str:
    beside = Path(sys.executable).parent / "torchserve"
    if beside.exists():
        return str(beside)
    found = shutil.which("torchserve")
    if not found:
        raise TorchServeError("`torchserve` not found next to the Python interpreter or on PATH; "
                              "install the pinned requirements (`make setup`)")
    return found


class TorchServe:
    """A TorchServe process for one model, as a context manager that always stops it.

        with TorchServe(config, model_store, "minilm", models="minilm=minilm.mar") as ts:
            ready = ts.readiness           # ready_s, worker_load_ms, description
            r = ts.api.predict(b'{"text": "hi"}', "application/json")
            sizes = ts.log.batch_sizes_for([r.request_id])
    """

    def __init__(self, config: Optional[Path], model_store: Path, model_name: str, *,
                 workdir: Optional[Path] = None, models: Optional[str] = None,
                 ready_timeout_s: Optional[float] = None, start_slack_s: float = 30.0,
                 extra_properties: Optional[dict] = None, env: Optional[dict] = None,
                 wait_all_workers: bool = True):
        self.config = Path(config) if config else None
        self.model_store = Path(model_store)
        self.model_name = model_name
        self.models = models
        self.ready_timeout_s = ready_timeout_s   # None → the model's startupTimeout + start_slack_s
        self.start_slack_s = start_slack_s       # JVM start + .mar unpack: not covered by startupTimeout
        self.extra_properties = dict(extra_properties or {})
        self.extra_env = dict(env or {})
        self.wait_all_workers = wait_all_workers
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="torchserve-"))
        self.tmpdir = self.workdir / "tmp"
        self.logs = self.workdir / "logs"
        self.ports: Optional[Ports] = None
        self.java_pid: Optional[int] = None
        self.readiness: Optional[Readiness] = None
        self.api: Optional[ServerApi] = None      # set at start, once the ports are known
        self.log = ServerLogs(self.logs, model_name)
        self._started = False
        self._stop_sent = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "TorchServe":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        # On failure inside the block, stop without masking the original error.
        self.stop(check=exc[0] is None)

    def _env(self) -> dict:
        env = dict(os.environ)
        for k in ("TEMP", "TMPDIR", "TMP"):
            env[k] = str(self.tmpdir)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.pop("TS_CONFIG_FILE", None)   # would replace our --ts-config
        env.update(self.extra_env)
        return env

    def _write_config(self) -> Path:
        p = self.ports
        base = self.config.read_text() if self.config else ""
        if base and not base.endswith("\n"):
            base += "\n"
        overrides = {
            "inference_address": f"http://{HOST}:{p.inference}",
            "management_address": f"http://{HOST}:{p.management}",
            "metrics_address": f"http://{HOST}:{p.metrics}",
            "grpc_inference_port": str(p.grpc_inference),
            "grpc_management_port": str(p.grpc_management),
            "model_store": self.model_store.resolve().as_posix(),
        }
        if self.models:
            overrides["load_models"] = self.models
        overrides.update({k: str(v) for k, v in self.extra_properties.items()})
        block = format_properties(overrides, ["--- appended by pipeline.serve.server.torchserve for an isolated run "
                                              "(a later duplicate key wins) ---"])
        path = self.workdir / "config.properties"
        path.write_text(base + "\n" + block)
        return path

    def start(self) -> Readiness:
        if self._started:
            raise TorchServeError("this TorchServe is already started; use a new instance")
        self._started = True
        try:
            self.readiness = self._start()
        except BaseException:
            self.stop(check=False)     # whatever went wrong (Ctrl-C included), nothing stays running
            raise
        return self.readiness

    def _start(self) -> Readiness:
        if not self.model_store.is_dir():
            raise TorchServeError(f"model store {self.model_store} is not a directory; "
                                  f"run the archive stage first")
        if shutil.which("java") is None:
            raise TorchServeError("java not found: TorchServe 0.12 needs Java 17 (`make java`)")
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        self.ports = Ports(*free_ports(5))
        self.api = ServerApi(self.workdir, self.ports.inference, self.ports.management, self.model_name)
        config = self._write_config()
        cmd = [_torchserve_cli(), "--start", "--ncs", "--ts-config", str(config),
               "--model-store", str(self.model_store.resolve())]
        t0 = time.monotonic()
        with open(self.workdir / "torchserve.out", "ab") as out:
            rc = subprocess.run(cmd, cwd=self.workdir, env=self._env(), stdout=out,
                                stderr=subprocess.STDOUT, timeout=60).returncode
        pid_file = self.tmpdir / ".model_server.pid"
        if pid_file.exists():
            self.java_pid = int(pid_file.read_text().strip() or 0) or None
        if rc != 0 or self.java_pid is None:
            raise TorchServeError(f"`torchserve --start` failed (exit {rc}) in {self.workdir}:\n"
                                  f"{tail(self.workdir / 'torchserve.out', 30)}")
        return self._wait_ready(t0)

    def request_stop(self) -> None:
        """`torchserve --stop` (SIGTERM to java) without waiting for the server to exit: servers up
        side by side are asked together and then waited for (`stop_all`), so their shutdowns overlap."""
        if not self._started or self._stop_sent or not (self.java_pid and psutil.pid_exists(self.java_pid)):
            return
        self._stop_sent = True
        try:
            with open(self.workdir / "torchserve.out", "ab") as out:
                subprocess.run([_torchserve_cli(), "--stop"], cwd=self.workdir, env=self._env(),
                               stdout=out, stderr=subprocess.STDOUT, timeout=30)
        except (subprocess.TimeoutExpired, OSError):
            pass

    def stop(self, check: bool = True, grace_s: float = STOP_GRACE_S) -> None:
        """`torchserve --stop` (unless `request_stop` sent it), `grace_s` for java to exit, then java
        killed and the rest ended; with check, raise if any process of this server is still alive
        afterwards. After SIGTERM the frontend closes its listeners at once, then idles ~2.5 s in its
        event loops' quiet period (Netty's graceful shutdown) with nothing left to serve: a check server
        (its figures taken, its logs read) need not wait that out before the next one starts."""
        if not self._started:
            return
        if self.java_pid and psutil.pid_exists(self.java_pid):
            self.request_stop()
            try:
                java = psutil.Process(self.java_pid)
                java.wait(timeout=grace_s)
            except psutil.TimeoutExpired:
                try:
                    java.kill()
                    java.wait(timeout=10)
                except (psutil.NoSuchProcess, psutil.TimeoutExpired):
                    pass
            except psutil.NoSuchProcess:
                pass
        self._started = False
        left = self._kill_leftovers()
        if check and left:
            raise TorchServeError(f"processes of the TorchServe in {self.workdir} survived stop and kill: "
                                  + ", ".join(f"{p.pid}" for p in left))

    def _kill_leftovers(self) -> list[psutil.Process]:
        procs = processes_of(self.workdir)
        if self.java_pid:
            try:
                java = psutil.Process(self.java_pid)
                if java.status() != psutil.STATUS_ZOMBIE and java not in procs:
                    procs.append(java)
            except psutil.NoSuchProcess:
                pass
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        return processes_of(self.workdir)

    def cleanup(self) -> None:
        """Remove the working dir (only one this object created), after stop."""
        if self._own_workdir and not self._started:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ readiness
    def _wait_ready(self, t0: float) -> Readiness:
        deadline = t0 + self.ready_timeout_s if self.ready_timeout_s else None
        startup_timeout = None
        log_offset = 0
        first_ready = None
        desc: dict = {}
        while True:
            now = time.monotonic()
            if self.java_pid and not _alive(self.java_pid):
                self._fail("TorchServe exited during start-up", "server_exited")
            text, log_offset = read_from(self.logs / "ts_log.log", log_offset)
            if _STARTUP_TIMEOUT_MARK in text:
                # TorchServe kills the worker and retries it with backoff for minutes (predictions
                # hang, /ping stays Healthy): stop at the first kill instead.
                st = startup_timeout if startup_timeout is not None else "its"
                self._fail(f"model {self.model_name!r}: loading exceeded its startupTimeout "
                           f"({st} s): the worker did not answer LOAD in time and TorchServe killed it "
                           f"({now - t0:.1f} s after start; it would retry it with backoff). "
                           f"Raise startupTimeout in model-config.yaml or make loading faster",
                           "startup_timeout", startup_timeout_s=startup_timeout, waited_s=now - t0)
            if any(m in text for m in _WORKER_DIED_MARKS):
                self._fail(f"model {self.model_name!r}: the worker died while loading "
                           f"(see the model log below for the Python error)", "worker_died")
            d = self._try_describe()
            if d is not None:
                desc = d
                if startup_timeout is None:
                    startup_timeout = d.get("startupTimeout")
                    if deadline is None and startup_timeout:
                        deadline = t0 + float(startup_timeout) + self.start_slack_s
                statuses = [w.get("status") for w in d.get("workers", [])]
                if "READY" in statuses and first_ready is None:
                    first_ready = now - t0
                if first_ready is not None and (not self.wait_all_workers or
                                                (statuses and all(s == "READY" for s in statuses))):
                    return Readiness(first_ready, now - t0, self._wait_worker_load_ms(), desc)
            limit = deadline if deadline is not None else t0 + 120.0 + self.start_slack_s
            if now > limit:
                self._fail(f"model {self.model_name!r} not READY after {now - t0:.1f} s "
                           f"(startupTimeout {startup_timeout} s + {self.start_slack_s} s start slack); "
                           f"workers: {[w.get('status') for w in desc.get('workers', [])]}", "timeout")
            time.sleep(POLL_S)

    def _fail(self, message: str, reason: str, **details):
        if reason == "worker_died":
            self.log.wait_for_python_error()
        log_tail = self.log.log_tail()
        self.stop(check=False)
        raise ModelNotReady(f"{message} [server dir: {self.workdir}]", reason, log_tail, **details)

    def _try_describe(self) -> Optional[dict]:
        try:
            if not self.api.ready():
                return None
            r = self.api.management("GET", f"/models/{self.model_name}", timeout_s=5)
        except (OSError, http.client.HTTPException):
            return None
        if r.status != 200:
            return None
        data = r.json()
        return data[0] if isinstance(data, list) and data else None

    def _wait_worker_load_ms(self, wait_s: float = 3.0) -> Optional[float]:
        end = time.monotonic() + wait_s     # the metric line is flushed just after READY
        while True:
            v = self.log.worker_load_ms()
            if v is not None or time.monotonic() > end:
                return v
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ worker processes
    def max_request_size(self) -> int:
        """Bytes of one request body the running server accepts (config.properties, else TorchServe's default)."""
        return int(read_properties(self.workdir / "config.properties").get("max_request_size",
                                                                            TS_DEFAULT_MAX_REQUEST_SIZE))

    def worker_pids(self) -> dict[str, Optional[int]]:
        return {w["id"]: w.get("pid") for w in self.api.describe_model().get("workers", [])}

    def worker_peak_rss_mb(self) -> dict[str, Optional[float]]:
        """Peak resident memory of each worker process so far (Linux VmHWM; else the current RSS), MB."""
        return {wid: process_peak_rss_mb(pid) if pid else None for wid, pid in self.worker_pids().items()}


def stop_all(servers: list["TorchServe"], check: bool = False) -> None:
    """Stop several servers at once: each is asked (`request_stop`) before any is waited for, so
    their JVMs' shutdowns overlap instead of adding up."""
    for ts in servers:
        ts.request_stop()
    for ts in servers:
        ts.stop(check=check)
