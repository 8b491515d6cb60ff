"""Run the model in a real Ray Serve (`serve run <config>`, as a user does), know when it is READY, always stop it.

One `RayServe` = one `serve run` process with a Ray of its own: `ray.init()` in that process starts a
local cluster on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every Ray address at 127.0.0.1),
which dies with it. The given Serve config (artifacts/ray-serve/serve_config.yaml) is copied with the
HTTP port set to a free loopback port; everything else is served as written. READY is the first 200
from the application's `/health` (the replica has loaded and warmed up the model); a process that
exits first is reported with its log's tail. Stop: SIGINT (serve run shuts Serve and its Ray down),
then SIGKILL to the whole process group.

    with RayServe(Path("artifacts/ray-serve/serve_config.yaml"), workdir, "minilm") as rs:
        rs.api.predict(b"a text", "text/plain")          # the same calls as a TorchServe's `ts.api`
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from pipeline.core.params import REPO_ROOT
from pipeline.serve.torchserve import free_ports
from pipeline.serve.torchserve_http import Client, Response, TorchServeError

SERVE_BIN = Path(sys.executable).with_name("serve")


class RayServeError(TorchServeError):
    """Ray Serve did not start the model, or could not be stopped; the message carries the log's tail."""


class RayServeApi:
    """The HTTP API of a running Ray Serve application: the calls `TorchServe.api` offers the checks."""

    def __init__(self, port: int, model_name: str):
        self.inference_port, self.model_name = port, model_name

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


class RayServe:
    def __init__(self, config: Path, workdir: Path, model_name: str, *, start_timeout_s: float = 300.0):
        self.source, self.workdir, self.model_name = Path(config), Path(workdir), model_name
        self.start_timeout_s = start_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None
        self.ready_s: Optional[float] = None
        self.api: Optional[RayServeApi] = None
        self.log_path = self.workdir / "serve_run.log"

    def write_config(self, port: int) -> Path:
        config = yaml.safe_load(self.source.read_text())
        config.setdefault("http_options", {}).update({"host": "127.0.0.1", "port": port})
        path = self.workdir / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def start(self) -> "RayServe":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_ports(1)[0]
        config = self.write_config(self.port)
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)           # a Ray of its own, never someone else's cluster
        t0 = time.perf_counter()
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen([str(SERVE_BIN), "run", str(config)], cwd=REPO_ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self.api = RayServeApi(self.port, self.model_name)
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, t0: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise RayServeError(f"`serve run` exited with {self.proc.returncode} before the model was READY\n"
                                    f"--- {self.log_path} ---\n{self.log_tail()}")
            waited = time.perf_counter() - t0
            if waited > self.start_timeout_s:
                raise RayServeError(f"the model was not READY on Ray Serve after {waited:.0f} s\n"
                                    f"--- {self.log_path} ---\n{self.log_tail()}")
            try:
                if self.api.request("GET", "/health", timeout_s=5).status == 200:
                    self.ready_s = time.perf_counter() - t0
                    return
            except OSError:
                pass
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
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:                                  # whatever Ray left in the session: the raylet, workers
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(30)
        self.proc = None

    def __enter__(self) -> "RayServe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
