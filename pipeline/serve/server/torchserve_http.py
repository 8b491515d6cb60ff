"""TorchServe's HTTP side: the keep-alive `Client` and `ServerApi`, the management and inference
calls of one running server (token keys from its own key_file.json; TorchServe 0.12 keeps token
authorization on by default). Process lifecycle lives in pipeline/serve/server/torchserve.py."""
from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HOST = "127.0.0.1"


class TorchServeError(RuntimeError):
    """TorchServe could not be started, queried or stopped; the message says what and where."""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    ms: float                       # client-side latency, send → full body read
    request_id: Optional[str] = None  # TorchServe's x-request-id: ties the request to its batch in the logs

    def json(self):
        return json.loads(self.body.decode("utf-8"))

    def error_text(self) -> str:
        """The error a non-200 answer carries (its `error` / `message` field, else the body), briefly."""
        try:
            doc = self.json()
            return str(doc.get("error") or doc.get("message") or doc)[:200] if isinstance(doc, dict) else str(doc)[:200]
        except (ValueError, UnicodeDecodeError):
            return self.body[:200].decode("utf-8", "replace")


class Client:
    """One keep-alive HTTP connection (use one per thread). Reconnects after the server closes
    (TorchServe closes the connection after every 4xx)."""

    def __init__(self, port: int, token: Optional[str], timeout_s: float = 120.0, retry_stale: bool = True):
        self.port, self.token, self.timeout_s = port, token, timeout_s
        # Resend once when a kept-alive connection turns out closed; off under load, where a
        # dropped request must count as lost, not be silently sent again.
        self.retry_stale = retry_stale
        self._conn: Optional[http.client.HTTPConnection] = None

    def request(self, method: str, path: str, body: bytes | None = None,
                content_type: Optional[str] = None, headers: Optional[dict] = None) -> Response:
        hdrs = dict(headers or {})
        if self.token:
            hdrs["Authorization"] = f"Bearer {self.token}"
        if content_type is not None:
            hdrs["Content-Type"] = content_type
        if body is not None:
            hdrs["Content-Length"] = str(len(body))
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(HOST, self.port, timeout=self.timeout_s)
            t0 = time.perf_counter()
            try:
                try:
                    self._conn.request(method, path, body=body, headers=hdrs)
                except (BrokenPipeError, ConnectionResetError):
                    # The server may answer (413) and close before it has read a too-large body.
                    pass
                resp = self._conn.getresponse()
                data = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                    http.client.BadStatusLine):
                self.close()
                if attempt == 0 and self.retry_stale and (body is None or len(body) < (1 << 20)):
                    continue    # stale keep-alive connection: retry once on a fresh one
                raise
            ms = (time.perf_counter() - t0) * 1000.0
            if resp.will_close:
                self.close()
            return Response(resp.status, data, ms, resp.getheader("x-request-id"))
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class ServerApi:
    """The HTTP API of one running server: `workdir` holds its config.properties and key_file.json."""

    def __init__(self, workdir: Path, inference_port: int, management_port: int, model_name: str):
        self.workdir = Path(workdir)
        self.inference_port, self.management_port = inference_port, management_port
        self.model_name = model_name
        self._keys: Optional[dict] = None

    def _auth_disabled(self) -> bool:
        cfg = self.workdir / "config.properties"
        return cfg.exists() and read_properties(cfg).get("disable_token_authorization", "").lower() == "true"

    def _key(self, kind: str) -> Optional[str]:
        if self._keys is None:
            path = self.workdir / "key_file.json"
            if not path.exists():
                return None
            try:
                self._keys = json.loads(path.read_text())
            except json.JSONDecodeError:
                return None     # being written
        return (self._keys.get(kind) or {}).get("key")

    def management_key(self) -> Optional[str]:
        return self._key("management")

    def inference_key(self) -> Optional[str]:
        return self._key("inference")

    def management(self, method: str, path: str, timeout_s: float = 30.0) -> Response:
        c = Client(self.management_port, self.management_key(), timeout_s)
        try:
            return c.request(method, path)
        finally:
            c.close()

    def client(self, timeout_s: float = 120.0, retry_stale: bool = True) -> Client:
        """A keep-alive inference client (one per thread)."""
        return Client(self.inference_port, self.inference_key(), timeout_s, retry_stale)

    def predict(self, body: bytes, content_type: Optional[str], model: Optional[str] = None,
                timeout_s: float = 120.0) -> Response:
        c = self.client(timeout_s)
        try:
            return c.request("POST", self.predictions_path(model), body, content_type)
        finally:
            c.close()

    def predictions_path(self, model: Optional[str] = None) -> str:
        return f"/predictions/{model or self.model_name}"

    def describe_model(self, model: Optional[str] = None) -> dict:
        """GET /models/<name> (the first version's description)."""
        r = self.management("GET", f"/models/{model or self.model_name}")
        if r.status != 200:
            raise TorchServeError(f"GET /models/{model or self.model_name} → {r.status}: {r.body[:300]!r}")
        return r.json()[0]

    def ready(self) -> bool:
        """Keys readable (or auth off): management calls can be made."""
        return self.management_key() is not None or self._auth_disabled()


def read_properties(path: Path) -> dict[str, str]:
    """Last-wins key=value view of a config.properties, as TorchServe's CLI reads it (no escapes;
    enough for the plain keys we look up here, such as max_request_size)."""
    props: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#!" or "=" not in line:
            continue
        key, _, value = line.partition("=")
        props[key.strip()] = value.strip()
    return props


