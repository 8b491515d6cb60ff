"""The speed the host allows: the server's own ceiling, the model alone, and the bound they make.

The ceiling is a do-nothing handler served exactly as the model is (the same config.properties, the
model's own model-config.yaml: batch size, max batch delay, workers; the same name, so the same URL)
under the same load, answering every request with a canned answer of the served answer's size (an
embedding is ~8 KB of JSON): carrying the answer's bytes through the worker's socket, the frontend and
the connection is the server's work, not the model's. The empty-answer ceiling is measured beside it
(`ceiling_empty`) to show what carrying the bytes costs. The model alone is the benchmark's steady-state rate at the served batch size,
one process per worker. When the server's per-request work and the model's share the same cores,
their costs add, so the served rate cannot pass

    bound = 1 / (1 / ceiling + 1 / model_alone)

and `served / bound` says how much of the host the handler's own per-request path loses on top.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Optional

from pipeline.core.numbers import rounded
from pipeline.serve.server.server_floor import NOOP_HANDLER
from pipeline.serve.serve_check import ServerSpec

CEILING = "ceiling"
CEILING_EMPTY = "ceiling_empty"

# Answers every request with the bytes of answer.json, as JSON, like the serving handler does.
CANNED_HANDLER = '''
import os


class CannedHandler:
    """Loads nothing, answers every request with the same bytes: a served answer's size, none of its work."""

    def initialize(self, context):
        with open(os.path.join(context.system_properties.get("model_dir"), "answer.json"), "rb") as f:
            self.answer = f.read()
        self.initialized = True

    def handle(self, data, context):
        for i in range(len(data)):
            context.set_response_content_type(i, "application/json")
        return [self.answer for _ in data]
'''


def ceiling_spec(name: str, model_config: Path, config: Optional[Path], env: Optional[dict] = None,
                 workdir: Optional[Path] = None, answer: Optional[bytes] = None) -> ServerSpec:
    """A .mar named `name` whose handler does nothing, packed with the served model-config.yaml; with
    `answer`, it answers every request with those bytes, else with an empty object."""
    from pipeline.serve.mar import package
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="server-ceiling-"))
    src, store = root / "src", root / "store"
    src.mkdir(parents=True, exist_ok=True)
    handler = src / ("canned_handler.py" if answer is not None else "noop_handler.py")
    handler.write_text(CANNED_HANDLER if answer is not None else NOOP_HANDLER)
    package(name, handler, {"answer.json": answer} if answer is not None else {}, store, config_file=model_config)
    return ServerSpec(name, store, config, env=env)


def served_size_answer(expected: list) -> bytes:
    """A served-size answer: the golden answer of median size, serialised as the handler serialises
    (handlers/encode.py; float lists as float32, as the model's outputs are)."""
    import numpy as np

    from handlers.encode import json_bytes

    def as_served(x):
        if isinstance(x, dict):
            return {k: as_served(v) for k, v in x.items()}
        if isinstance(x, list) and x and all(isinstance(v, float) for v in x):
            return np.asarray(x, dtype=np.float32)
        if isinstance(x, list):
            return [as_served(v) for v in x]
        return x
    answers = sorted((json_bytes(as_served(e)) for e in expected if e is not None), key=len)
    return answers[len(answers) // 2] if answers else b"{}"


def served_variant(model_store: Path, name: str) -> Optional[str]:
    """The variant the archive packed (variant.json of its unpacked folder, else of the .mar), None
    when neither holds one."""
    import zipfile
    try:
        folder = model_store / name / "variant.json"
        if folder.is_file():
            return json.loads(folder.read_text()).get("variant")
        with zipfile.ZipFile(model_store / f"{name}.mar") as mar:
            return json.loads(mar.read("variant.json")).get("variant")
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None


def model_alone_rps(benchmark: dict, batch_size: int, workers: int, rows_per_request: float = 1.0) -> Optional[dict]:
    """The benchmark's steady samples/s at `batch_size` (one process, the serving threads), times the
    workers that each run one such process; None when that batch size was not measured.
    `batch_size` is the served model call in rows (derivation `batch_rows`) and the curve is rows/s:
    with several rows per request (rerank) the value is requests/s = rows/s ÷ rows_per_request, the
    unit the served rate and the ceiling are in (pipeline/decide/rows.py)."""
    point = (benchmark.get("steady") or {}).get(str(batch_size))
    if not point or not point.get("throughput_sps"):
        return None
    per_process = float(point["throughput_sps"])
    out = {"value": per_process * workers / rows_per_request, "per_process_sps": per_process, "batch_size": batch_size,
           "workers": workers, "threads_per_process": benchmark.get("threads"),
           "formula": "workers x the benchmark's steady samples/s at the served batch size"}
    if rows_per_request != 1.0:
        out.update(rows_per_request=rows_per_request, rows_per_s=per_process * workers,
                   formula="workers x the benchmark's steady rows/s at the served rows per model call (batch_rows) "
                           "/ rows per request: requests/s")
    return out


def served_bound(served_rps: Optional[float], ceiling_rps: Optional[float], model: Optional[dict]) -> dict:
    """The bound, its inputs, and what the served rate reaches of it."""
    alone = model["value"] if model else None
    bound = 1.0 / (1.0 / ceiling_rps + 1.0 / alone) if ceiling_rps and alone else None
    return {"served_rps": rounded(served_rps, 2), "ceiling_rps": rounded(ceiling_rps, 2),
            "model_alone_rps": rounded(alone, 2), "model_alone": model,
            "bound_rps": rounded(bound, 2), "formula": "1 / (1 / ceiling + 1 / model_alone)",
            "served_vs_bound": rounded(served_rps / bound, 3) if served_rps and bound else None}
