"""Run the model in a real Ray Serve (`serve run <config>`, as a user does), know when it is READY, always stop it.

One `RayServe` = one `serve run` process with a Ray of its own: `ray.init()` in that process starts a
local cluster on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every Ray address at 127.0.0.1),
which dies with it. The given Serve config (artifacts/ray-serve/serve_config.yaml) is copied with the
HTTP port set to a free loopback port; everything else is served as written. READY is the first 200
from the application's `/health` (a replica has loaded and warmed up the model), every replica READY
when each has logged its `[replica] pid=` line; a process that exits first is reported with its log's
tail. Stop: SIGINT (serve run shuts Serve and its Ray down), then SIGKILL to the whole process group.

The checks (pipeline/serve/serve_check.py, parity.py, bad_input.py, load.py) take it where they take a
TorchServe: `api` (client, predict, predictions_path, inference_port, inference_key, describe_model),
`log` (batches formed, the handler's load phases and per-request profile, from the replicas' logs in
this server's own Ray temp dir), `readiness`, `worker_pids`, `worker_peak_rss_mb`, `max_request_size`.

    with RayServe(Path("artifacts/ray-serve/serve_config.yaml"), workdir, "minilm") as rs:
        rs.api.predict(b"a text", "text/plain")          # the same calls as a TorchServe's `ts.api`
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil
import yaml

from pipeline.core.params import REPO_ROOT
from pipeline.serve.server.processes import free_ports, process_peak_rss_mb
from pipeline.serve.server.torchserve import Readiness
from pipeline.serve.server.torchserve_http import Client, Response, TorchServeError
from pipeline.serve.server.torchserve_logs import ServerLogs

_REPLICA = re.compile(r"\[replica\] pid=(\d+) ready")
_BATCH = re.compile(r"\[batch\] size=\d+ ids=(\S*)")

SERVE_BIN = Path(sys.executable).with_name("serve")
# `serve run` shuts Serve and its Ray down on SIGINT in ~5 s; past this the process group is killed (nothing
# of a check server is needed after its figures are taken).
SIGINT_WAIT_S = 20.0


class RayServeError(TorchServeError):
    """Ray Serve did not start the model, or could not be stopped; the message carries the log's tail."""


class RayServeApi:
    """The HTTP API of a running Ray Serve application: the calls `TorchServe.api` offers the checks."""

    def __init__(self, port: int, model_name: str, logs: "RayServeLogs"):
        self.inference_port, self.model_name, self._logs = port, model_name, logs

    def inference_key(self) -> Optional[str]:
        return None         # Ray Serve's HTTP proxy has no token authorization; it listens on loopback here

    def describe_model(self, model: Optional[str] = None) -> dict:
        """TorchServe's describe shape: one worker per replica that has loaded, READY while its process lives."""
        return {"workers": [{"id": f"replica-{pid}", "pid": pid, "status": "READY" if psutil.pid_exists(pid) else "DEAD"}
                            for pid in self._logs.replica_pids()]}

    def client(self, timeout_s: float = 120.0, retry_stale: bool = True) -> Client:
        return Client(self.inference_port, None, timeout_s, retry_stale)

    def predictions_path(self, model: Optional[str] = None) -> str:
        return f"/predictions/{model or self.model_name}"

    def request(self, method: str, path: str, body: bytes | None = None, content_type: Optional[str] = None,
                timeout_s: float = 120.0) -> Response:
        c = self.client(timeout_s)
        try:
            return c.request(method, path, body, content_type)
        finally:
            c.close()

    def predict(self, body: bytes, content_type: Optional[str], model: Optional[str] = None,
                timeout_s: float = 120.0) -> Response:
        return self.request("POST", self.predictions_path(model), body, content_type, timeout_s)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.inference_port}"


class RayServeLogs(ServerLogs):
    """The replicas' logs (Ray's logs/serve/replica_<app>_model_*.log) of one RayServe's own Ray temp dir."""

    def __init__(self, ray_tmp: Path, model_name: str):
        super().__init__(ray_tmp, model_name)
        self._read: dict[Path, bytearray] = {}      # each replica log's bytes read so far

    def replica_logs(self) -> list[Path]:
        # session_latest links to the session's folder: read through it, every line would count twice.
        return sorted(p for p in self.logs.glob("ray/session_*/logs/serve/replica_*.log")
                      if "session_latest" not in p.parts)

    def _log_bytes(self, path: Path) -> bytes:
        """The log's bytes: only what was appended since the last call is read (the readiness poll and
        the checks ask again and again while the logs grow with every batch)."""
        seen = self._read.setdefault(path, bytearray())
        try:
            with path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < len(seen):       # rotated or rewritten: read it afresh
                    seen.clear()
                f.seek(len(seen))
                seen += f.read()
        except FileNotFoundError:
            pass
        return bytes(seen)

    def model_log_text(self) -> Optional[str]:
        paths = self.replica_logs()
        return "\n".join(self._log_bytes(p).decode(errors="replace") for p in paths) if paths else None

    def replica_pids(self) -> list[int]:
        """Every replica process that has loaded the model, in the order they did (a replaced one stays listed)."""
        return list(dict.fromkeys(int(pid) for pid in _REPLICA.findall(self.model_log_text() or "")))

    def worker_load_ms(self) -> Optional[float]:
        phases = self.handler_load_ms()
        return phases.get("total") if phases else None

    def batches(self) -> list[frozenset]:
        return [frozenset(ids.split(",")) for ids in _BATCH.findall(self.model_log_text() or "") if ids]

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(f"== {p} ==\n" + "\n".join(self._log_bytes(p).decode(errors="replace").splitlines()[-n:])
                         for p in self.replica_logs()) or "(no replica log)"


class RayServe:
    java_pid = None           # no JVM: the warm-up's JIT criteria read nothing and pass

    def __init__(self, config: Path, workdir: Path, model_name: str, *, start_timeout_s: float = 300.0):
        self.source, self.workdir, self.model_name = Path(config), Path(workdir), model_name
        self.start_timeout_s = start_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None
        self.readiness: Optional[Readiness] = None
        self.api: Optional[RayServeApi] = None
        self.log_path = self.workdir / "serve_run.log"
        # Ray's sockets live under its temp dir, whose path must stay short (AF_UNIX: 107 bytes).
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp" if os.path.isdir("/tmp") else None))
        self.log = RayServeLogs(self.ray_tmp, model_name)
        self.config = yaml.safe_load(self.source.read_text())

    @property
    def ready_s(self) -> Optional[float]:
        return self.readiness.ready_s if self.readiness else None

    @property
    def replicas(self) -> int:
        deployments = self.config["applications"][0].get("deployments") or [{}]
        return int(deployments[0].get("num_replicas") or 1)

    def settings(self) -> dict:
        """The served settings in TorchServe's names (the checks' records compare the two servers by them)."""
        deployment = (self.config["applications"][0].get("deployments") or [{}])[0]
        batching = deployment.get("user_config") or {}
        return {"batchSize": batching.get("max_batch_size"),
                "maxBatchDelay": round(1000 * float(batching.get("batch_wait_timeout_s") or 0)),
                "minWorkers": self.replicas, "maxWorkers": self.replicas,
                "responseTimeout": (self.config.get("http_options") or {}).get("request_timeout_s"),
                "startupTimeout": None}

    def write_config(self, port: int) -> Path:
        config = yaml.safe_load(yaml.safe_dump(self.config))
        config.setdefault("http_options", {}).update({"host": "127.0.0.1", "port": port})
        path = self.workdir / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def max_request_size(self) -> int:
        """The handler's limit on one body (model-config.yaml handler.max_request_bytes): Ray's proxy has none."""
        folder = Path(self.config["applications"][0]["args"]["model_dir"])
        folder = folder if folder.is_absolute() else REPO_ROOT / folder
        handler = (yaml.safe_load((folder / "model-config.yaml").read_text()) or {}).get("handler") or {}
        return int(handler.get("max_request_bytes") or 6553500)

    def worker_pids(self) -> dict[str, Optional[int]]:
        return {w["id"]: w["pid"] for w in self.api.describe_model()["workers"]}

    def worker_peak_rss_mb(self) -> dict[str, Optional[float]]:
        return {wid: process_peak_rss_mb(pid) for wid, pid in self.worker_pids().items()}

    def start(self) -> "RayServe":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_ports(1)[0]
        config = self.write_config(self.port)
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_TMPDIR": str(self.ray_tmp)}
        env.pop("RAY_ADDRESS", None)           # a Ray of its own, never someone else's cluster
        t0 = time.perf_counter()
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen([str(SERVE_BIN), "run", str(config)], cwd=REPO_ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self.api = RayServeApi(self.port, self.model_name, self.log)
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, t0: float) -> None:
        ready_s = None
        while True:
            if self.proc.poll() is not None:
                raise RayServeError(f"`serve run` exited with {self.proc.returncode} before the model was READY\n"
                                    f"--- {self.log_path} ---\n{self.log_tail()}")
            waited = time.perf_counter() - t0
            if waited > self.start_timeout_s:
                raise RayServeError(f"the model was not READY on Ray Serve after {waited:.0f} s\n"
                                    f"--- {self.log_path} ---\n{self.log_tail()}")
            if ready_s is None:
                try:
                    if self.api.request("GET", "/health", timeout_s=5).status == 200:
                        ready_s = time.perf_counter() - t0
                except OSError:
                    pass
            if ready_s is not None and len(self.log.replica_pids()) >= self.replicas:
                self.readiness = Readiness(ready_s=ready_s, all_ready_s=time.perf_counter() - t0,
                                           worker_load_ms=self.log.worker_load_ms(),
                                           description={**self.settings(),
                                                        "workers": self.api.describe_model()["workers"]})
                return
            time.sleep(0.1)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(SIGINT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        try:                                  # whatever Ray left in the session: the raylet, workers
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(30)
        self.proc = None

    def cleanup(self) -> None:
        """Remove this server's Ray temp dir (its logs), after stop."""
        if self.proc is None:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def __enter__(self) -> "RayServe":
        return self.start()

    def __exit__(self, kind, *exc) -> None:
        self.stop()
        if kind is None:          # kept after a failure: the replicas' logs say why
            self.cleanup()
