"""The server's own floor: how fast TorchServe 0.12 makes a model READY whose handler does nothing.

No handler can start faster than this (JVM start, worker spawn, the worker's own `import torch`),
and no loader can read a model faster than the raw read of its bytes. So a served model's READY is
judged against floor + raw read of its artifact, both measured on this host in the same run:
`readiness_vs_floor` gives the ratio (issue 13 asks for at most 1.5).
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Optional

from pipeline.torchserve import ModelNotReady, TorchServe, TorchServeError

log = logging.getLogger(__name__)

NOOP_HANDLER = '''
class NoopHandler:
    """Loads nothing, answers every request with an empty object."""

    def initialize(self, context):
        self.initialized = True

    def handle(self, data, context):
        return [{} for _ in data]
'''
NOOP_NAME = "noop"


def measure_server_floor(workdir: Optional[Path] = None) -> dict:
    """READY of a do-nothing model in a fresh TorchServe ({ready, ready_s, worker_load_ms} or the error)."""
    from pipeline.archive import package

    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="server-floor-"))
    store = root / "store"
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    handler = src / "noop_handler.py"
    handler.write_text(NOOP_HANDLER)
    config = src / "model-config.yaml"
    config.write_text("minWorkers: 1\nmaxWorkers: 1\nstartupTimeout: 60\nresponseTimeout: 10\n")
    package(NOOP_NAME, handler, {}, store, config_file=config)
    ts = TorchServe(None, store, NOOP_NAME, models=f"{NOOP_NAME}={NOOP_NAME}.mar", workdir=root / "server")
    try:
        with ts:
            r = ts.readiness
            log.info("server floor: a do-nothing model READY in %.2f s (WorkerLoadTime %s ms)", r.ready_s,
                     r.worker_load_ms)
            return {"ready": True, "ready_s": r.ready_s, "worker_load_ms": r.worker_load_ms}
    except (ModelNotReady, TorchServeError) as e:
        return {"ready": False, "error": str(e)[:500]}


def readiness_vs_floor(ready_s: Optional[float], floor: Optional[dict], raw_read_ms: Optional[float]) -> Optional[dict]:
    """READY / (server floor + raw read of the artifact); None when a figure is missing."""
    if ready_s is None or not floor or not floor.get("ready") or raw_read_ms is None:
        return None
    bound = floor["ready_s"] + raw_read_ms / 1000.0
    return {"floor_ready_s": round(floor["ready_s"], 3), "raw_read_s": round(raw_read_ms / 1000.0, 3),
            "floor_plus_read_s": round(bound, 3), "ready_s": round(ready_s, 3),
            "ratio": round(ready_s / bound, 3) if bound > 0 else None}
