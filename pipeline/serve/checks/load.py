"""The load generator: a bounded number of requests from keep-alive clients against a running
TorchServe, with the latencies, throughput and the batch sizes TorchServe actually formed.

The clients are `concurrency` keep-alive HTTP/1.1 connections driven by one event loop (non-blocking
sockets, requests serialised once): each connection has one request in flight, as a production client
holding a connection does. A thread per connection over http.client costs the host more per request
than a do-nothing handler does, so the load would measure its own client, not the server.

Batch sizes come from TorchServe itself: every batch the backend runs logs one PredictionTime
metric carrying all of its request ids, and every response carries its `x-request-id`, so the
load's own requests are matched to the batches that served them.
"""
from __future__ import annotations

import errno
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from pipeline.serve.checks.http_cases import HttpCase
from pipeline.serve.server.interface import Server
from pipeline.serve.server.torchserve_http import HOST, Response

# One request's outcome: (index, HTTP status or None when lost, ms, x-request-id, error text).
_Record = tuple[int, Optional[int], float, Optional[str], Optional[str]]

LOAD_KIND = "closed loop: one request in flight per keep-alive HTTP/1.1 connection, one event-loop client"


@dataclass
class LoadResult:
    requests_planned: int
    requests_sent: int
    requests_answered: int
    requests_ok: int
    errors_4xx: int
    errors_5xx: int
    lost: int                       # sent but never answered (connection error / timeout)
    p50_ms: Optional[float]
    p99_ms: Optional[float]
    mean_ms: Optional[float]
    throughput_rps: Optional[float]
    wall_s: float
    concurrency: int
    stopped_by_time_cap: bool
    batch_sizes_seen: dict = field(default_factory=dict)   # {"<size>": number of batches}
    mean_batch_size: Optional[float] = None
    failures: list = field(default_factory=list)            # first few non-200 / lost, for the log
    load: str = LOAD_KIND                                   # which load these figures are of
    client_cpu_s: Optional[float] = None                    # CPU the load generator's own thread used


def request_bytes(path: str, token: Optional[str], case: HttpCase) -> bytes:
    """One POST as it goes on the wire."""
    head = [f"POST {path} HTTP/1.1", f"Host: {HOST}", f"Content-Length: {len(case.body)}"]
    if token:
        head.append(f"Authorization: Bearer {token}")
    if case.content_type is not None:
        head.append(f"Content-Type: {case.content_type}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + case.body


class ResponseParser:
    """Incremental HTTP/1.1 response reader: Content-Length and chunked bodies."""

    def __init__(self):
        self.buf = bytearray()
        self.reset()

    def reset(self) -> None:
        self.status: Optional[int] = None
        self.headers: dict[str, str] = {}
        self.body_start = -1
        self.length: Optional[int] = None
        self.chunked = False

    def feed(self, data: bytes) -> bool:
        """True once a whole response is buffered (then `take()` it)."""
        self.buf += data
        if self.body_start < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/"):
                raise ValueError(f"not an HTTP response: {lines[0][:80]!r}")
            self.status = int(parts[1])
            for line in lines[1:]:
                k, _, v = line.partition(":")
                self.headers[k.strip().lower()] = v.strip()
            self.body_start = end + 4
            self.chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
            self.length = None if self.chunked else int(self.headers.get("content-length", "0"))
        if self.chunked:
            return self._chunked_end() is not None
        return len(self.buf) - self.body_start >= self.length

    def _chunked_end(self) -> Optional[int]:
        pos = self.body_start
        while True:
            eol = self.buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size = int(bytes(self.buf[pos:eol]).split(b";")[0], 16)
            if size == 0:
                trailer_end = self.buf.find(b"\r\n\r\n", eol)
                if trailer_end >= 0:
                    return trailer_end + 4
                return eol + 4 if self.buf[eol + 2:eol + 4] == b"\r\n" else None
            pos = eol + 2 + size + 2
            if pos > len(self.buf):
                return None

    def take(self, keep_body: bool) -> tuple[int, dict, bytes]:
        """The complete response's status, headers and (when asked, as sent: chunk framing kept)
        body; keeps any bytes past it."""
        end = self._chunked_end() if self.chunked else self.body_start + self.length
        status, headers = self.status, self.headers
        body = bytes(self.buf[self.body_start:end]) if keep_body else b""
        del self.buf[:end]
        self.reset()
        return status, headers, body


class _Conn:
    __slots__ = ("sock", "parser", "index", "t0", "out", "sent")

    def __init__(self):
        self.sock: Optional[socket.socket] = None
        self.parser = ResponseParser()
        self.index: Optional[int] = None
        self.t0 = 0.0
        self.out = b""
        self.sent = 0


def run_load(ts: Server, cases: list[HttpCase], requests: int, concurrency: int,
             time_cap_s: float, request_timeout_s: Optional[float] = None) -> LoadResult:
    """A fixed number of requests from `concurrency` keep-alive clients, cycling through the
    cases; no new request after `time_cap_s`, and no request waits longer than that (or than
    `request_timeout_s` when given: a short timed window must not count slow answers as lost)."""
    wire = [request_bytes(ts.api.predictions_path(), ts.api.inference_key(), c) for c in cases]
    timeout = request_timeout_s or time_cap_s
    concurrency = max(1, concurrency)
    sel = selectors.DefaultSelector()
    conns = [_Conn() for _ in range(concurrency)]
    records: list[_Record] = []
    next_index = 0
    capped = False
    in_flight = 0
    cpu0 = time.thread_time()
    t0 = time.perf_counter()
    deadline = t0 + time_cap_s

    def connect(c: _Conn) -> None:
        c.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sock.setblocking(False)
        err = c.sock.connect_ex((HOST, ts.api.inference_port))
        if err not in (0, errno.EINPROGRESS):
            raise OSError(err, f"cannot connect to {HOST}:{ts.api.inference_port}: {errno.errorcode.get(err, err)}")
        c.parser = ResponseParser()
        sel.register(c.sock, selectors.EVENT_WRITE, c)

    def drop(c: _Conn) -> None:
        if c.sock is not None:
            sel.unregister(c.sock)
            c.sock.close()
            c.sock = None

    def finish(c: _Conn, rec: _Record) -> None:
        nonlocal in_flight
        records.append(rec)
        c.index = None
        in_flight -= 1

    def start(c: _Conn) -> bool:
        """Send the next request on `c`; False when there is none left to send."""
        nonlocal next_index, capped, in_flight
        now = time.perf_counter()
        if next_index >= requests:
            return False
        if now > deadline:
            capped = True
            return False
        c.index = next_index
        next_index += 1
        in_flight += 1
        if c.sock is None:
            connect(c)
        else:
            sel.modify(c.sock, selectors.EVENT_WRITE, c)
        c.out, c.sent, c.t0 = wire[c.index % len(wire)], 0, time.perf_counter()
        return True

    def lost(c: _Conn, why: str) -> None:
        i = c.index
        drop(c)
        finish(c, (i, None, 0.0, None, why))

    try:
        for c in conns:
            if not start(c):
                break
        while in_flight:
            events = sel.select(timeout=0.05)
            now = time.perf_counter()
            for key, mask in events:
                c: _Conn = key.data
                if c.index is None:     # an idle connection the server closed or spoke on
                    drop(c)
                    continue
                try:
                    if mask & selectors.EVENT_WRITE:
                        c.sent += c.sock.send(c.out[c.sent:])
                        if c.sent >= len(c.out):
                            sel.modify(c.sock, selectors.EVENT_READ, c)
                        continue
                    data = c.sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:
                    # A reset after a complete send may still carry an answer (413 before the body
                    # was read); anything else is a lost request.
                    lost(c, f"{type(e).__name__}: {e}")
                    start(c)
                    continue
                if not data:
                    lost(c, "RemoteDisconnected: the server closed the connection without an answer")
                    start(c)
                    continue
                try:
                    if not c.parser.feed(data):
                        continue
                    status, headers, body = c.parser.take(keep_body=c.parser.status != 200)
                except ValueError as e:
                    lost(c, f"BadResponse: {e}")
                    start(c)
                    continue
                ms = (time.perf_counter() - c.t0) * 1000.0
                err = None if status == 200 else Response(status, body, ms).error_text()
                finish(c, (c.index, status, ms, headers.get("x-request-id"), err))
                if headers.get("connection", "").lower() == "close":
                    drop(c)     # TorchServe closes the connection after every 4xx
                start(c)
            for c in conns:
                if c.index is not None and now - c.t0 > timeout:
                    lost(c, f"TimeoutError: no answer within {timeout:.0f} s")
                    start(c)
    finally:
        for c in conns:
            drop(c)
        sel.close()
    wall = time.perf_counter() - t0
    result = _result(ts, records, requests=requests, concurrency=concurrency, wall=wall, capped=capped)
    result.client_cpu_s = round(time.thread_time() - cpu0, 3)
    return result


def _result(ts: Server, records: list[_Record], *, requests: int, concurrency: int, wall: float,
            capped: bool) -> LoadResult:
    """The figures of the load's records, with the batches TorchServe formed for its answered requests."""
    answered = [r for r in records if r[1] is not None]
    ok = [r for r in answered if r[1] == 200]
    lat = np.asarray([r[2] for r in ok], dtype=np.float64)
    sizes = ts.log.batch_sizes_for(r[3] for r in ok)
    n_batches = sum(sizes.values())
    return LoadResult(
        requests_planned=requests, requests_sent=len(records), requests_answered=len(answered),
        requests_ok=len(ok), errors_4xx=sum(1 for r in answered if 400 <= r[1] < 500),
        errors_5xx=sum(1 for r in answered if r[1] >= 500), lost=len(records) - len(answered),
        p50_ms=_pct(lat, 50), p99_ms=_pct(lat, 99), mean_ms=float(lat.mean()) if lat.size else None,
        throughput_rps=len(ok) / wall if wall > 0 else None, wall_s=wall, concurrency=concurrency,
        stopped_by_time_cap=capped,
        batch_sizes_seen={str(k): v for k, v in sorted(sizes.items())},
        mean_batch_size=(sum(k * v for k, v in sizes.items()) / n_batches) if n_batches else None,
        failures=[{"i": r[0], "status": r[1], "error": r[4]} for r in records if r[1] != 200][:5])


def _pct(a: np.ndarray, q: float) -> Optional[float]:
    return float(np.percentile(a, q)) if a.size else None
