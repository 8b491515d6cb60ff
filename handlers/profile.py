"""Where a request's time goes inside the worker, from the handler's own timers.

Each batch adds its phases (decode: parsing and tokenizing every request; collate: padding them into
one batch; model: the runtime's call; respond: building and serialising the answers) and its size;
every `every_requests` requests (or `every_s` seconds, whichever comes first) the sums since the last
line are logged as one line per worker — often enough that a short load leaves a sample:

    [profile] requests=812 batches=104 decode_us=31.2 collate_us=2.1 model_us=1411.0 respond_us=9.8 handle_us=1458.3

each figure in microseconds per request. The line goes to the worker's log, where the pipeline reads
it under load (pipeline/serve/server/torchserve_logs.py).
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

PHASES = ("decode", "collate", "model", "respond")


class RequestProfile:
    def __init__(self, every_requests: int = 64, every_s: float = 2.0) -> None:
        self.every_requests = every_requests
        self.every_s = every_s
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.sums = dict.fromkeys(PHASES, 0.0)
        self.requests = self.batches = 0
        self.handle_s = 0.0
        self.since = now

    def add(self, **phases: float) -> None:
        for name, seconds in phases.items():
            self.sums[name] += seconds

    def batch(self, requests: int, handle_s: float) -> None:
        self.requests += requests
        self.batches += 1
        self.handle_s += handle_s
        now = time.perf_counter()
        if self.requests >= self.every_requests or now - self.since >= self.every_s:
            log.info("%s", self.line())
            self._reset(now)

    def line(self) -> str:
        n = max(self.requests, 1)
        figures = " ".join(f"{p}_us={1e6 * self.sums[p] / n:.1f}" for p in PHASES)
        return (f"[profile] requests={self.requests} batches={self.batches} {figures} "
                f"handle_us={1e6 * self.handle_s / n:.1f}")
