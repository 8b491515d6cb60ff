"""What one TorchServe's log files say: the failure tail, WorkerLoadTime, and the batches the Python
backend really formed (from its PredictionTime metric lines). Lifecycle: pipeline/serve/server/torchserve.py."""
from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional

_PHASE = re.compile(r"([A-Za-z_][\w]*)=([0-9.]+)ms")
_FIGURE = re.compile(r"([A-Za-z_][\w]*)=([0-9.]+)")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def read_from(path: Path, offset: int) -> tuple[str, int]:
    """The whole lines appended to `path` since `offset`, and the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return "", offset
    # Only whole lines: keep a partial last line for the next read.
    cut = data.rfind(b"\n") + 1
    return data[:cut].decode("utf-8", "replace"), offset + cut


def tail(path: Path, n: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"({path.name}: not written)"
    return "\n".join(lines[-n:])


class ServerLogs:
    """The logs/ folder of one server (its working dir's), read for one model."""

    def __init__(self, logs: Path, model_name: str):
        self.logs = Path(logs)
        self.model_name = model_name

    def log_tail(self, n: int = 40) -> str:
        """The worker log's last lines and the frontend's last warnings/errors (stack frames and
        the frontend's doubled lines left out)."""
        try:
            ts_lines = (self.logs / "ts_log.log").read_text(errors="replace").splitlines()
        except FileNotFoundError:
            ts_lines = []
        warnings: list[str] = []
        for line in ts_lines:
            if ("[WARN" in line or "[ERROR" in line) and (not warnings or warnings[-1] != line):
                warnings.append(line)
        return (f"== {self.logs / 'model_log.log'} ==\n{tail(self.logs / 'model_log.log', n)}\n"
                f"== {self.logs / 'ts_log.log'} (warnings/errors) ==\n" + "\n".join(warnings[-(n // 2):]))

    def wait_for_python_error(self, timeout_s: float = 10.0) -> bool:
        """Wait until the worker log holds a Python traceback, at most `timeout_s`. The frontend logs
        a worker's death (ts_log.log) before its log appender has written the worker's last stderr
        lines (model_log.log): read at once, the tail could end before the error it exists to show."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                if "Traceback (most recent call last)" in (self.logs / "model_log.log").read_text(errors="replace"):
                    return True
            except FileNotFoundError:
                pass
            if time.monotonic() >= end:
                return False
            time.sleep(0.1)

    def model_log_text(self) -> Optional[str]:
        """What the handler logged in every worker (model_log.log); None before it exists."""
        try:
            return (self.logs / "model_log.log").read_text(errors="replace")
        except FileNotFoundError:
            return None

    def worker_load_ms(self) -> Optional[float]:
        """TorchServe's WorkerLoadTime for this model (max over its workers), from ts_metrics.log."""
        pat = re.compile(r"WorkerLoadTime\.Milliseconds:([0-9.]+)\|#WorkerName:W-\d+-(.+?)_[^_|,]*,")
        values = []
        try:
            text = (self.logs / "ts_metrics.log").read_text(errors="replace")
        except FileNotFoundError:
            return None
        for m in pat.finditer(text):
            if m.group(2) == self.model_name:
                values.append(float(m.group(1)))
        return max(values) if values else None

    def handler_load_ms(self) -> Optional[dict]:
        """The phases of the slowest worker's `[load]` line (handlers/serving.py: runtime read /
        deserialize, adapter, warm-up, total in ms), from model_log.log; None before any."""
        text = self.model_log_text()
        if text is None:
            return None
        loads = [dict((k, float(v)) for k, v in _PHASE.findall(line.split("[load]", 1)[1].rsplit(": ", 1)[-1]))
                 for line in text.splitlines() if "[load] variant=" in line]
        loads = [d for d in loads if "total" in d]
        return max(loads, key=lambda d: d["total"]) if loads else None

    def handler_profile(self) -> Optional[dict]:
        """Where a request's time went inside the workers (handlers/profile.py): every `[profile]`
        line in model_log.log pooled, each phase in microseconds per request weighted by the
        requests of its line; None before any line."""
        text = self.model_log_text()
        if text is None:
            return None
        rows = [dict((k, float(v)) for k, v in _FIGURE.findall(line.split("[profile]", 1)[1]))
                for line in text.splitlines() if "[profile] requests=" in line]
        rows = [r for r in rows if r.get("requests")]
        if not rows:
            return None
        total = sum(r["requests"] for r in rows)
        out = {"requests": int(total), "batches": int(sum(r.get("batches", 0) for r in rows)), "lines": len(rows)}
        for key in sorted({k for r in rows for k in r if k.endswith("_us")}):
            out[key] = round(sum(r.get(key, 0.0) * r["requests"] for r in rows) / total, 1)
        return out

    def batches(self) -> list[frozenset]:
        """Every batch the Python backend ran, as the set of TorchServe request ids in it: one
        PredictionTime metric per batch carries all of its ids (model_metrics.log in metrics_mode
        log; the frontend's ts_log.log echoes the raw [METRICS] line in every mode)."""
        seen: dict[frozenset, None] = {}
        for name in ("model_metrics.log", "ts_log.log"):
            try:
                text = (self.logs / name).read_text(errors="replace")
            except FileNotFoundError:
                continue
            for line in text.splitlines():
                if "PredictionTime" in line:
                    ids = frozenset(_UUID.findall(line))
                    if ids:
                        seen.setdefault(ids)
        return list(seen)

    def batch_sizes_for(self, request_ids: Iterable[str], wait_s: float = 5.0) -> Counter:
        """Histogram {batch size: number of batches} over the batches that contain these requests."""
        wanted = {r for r in request_ids if r}
        end = time.monotonic() + wait_s
        while True:
            hits = [b for b in self.batches() if b & wanted]
            covered = set().union(*hits) if hits else set()
            if wanted <= covered or time.monotonic() > end:
                return Counter(len(b) for b in hits)
            time.sleep(0.1)
