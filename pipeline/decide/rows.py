"""Rows vs requests: one HTTP request may be many model rows (a rerank query with 20 texts is 20 rows).

The units, everywhere the pipeline reasons about batches:
- the benchmark's curve is in ROWS: batch size = rows per model call, throughput_sps = rows/s;
- TorchServe's `batchSize` counts REQUESTS (derivation `batch_size`), and so do
  `serve.expected_concurrency` (requests in flight), the load generator's req/s and p99 per request;
- the handler runs a batch's rows in model calls of at most `batch_rows` rows (derivation
  `batch_rows`, model-config.yaml `handler.batch_rows`).

For a one-row task the two coincide (R = 1): batch_size = batch_rows and every function here gives
what the pipeline always did. For R rows per request, a batch of B rows is filled by floor(B / R)
requests (at least one; at most what the load fills on each worker), their rows take
ceil(requests × R / B) model calls, and a request is answered when all of them are done.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

_EPS = 1e-9


def multi_row(rows_per_request: float) -> bool:
    return rows_per_request > 1 + _EPS


def requests_per_batch(batch_rows: int, rows_per_request: float, fill_requests: Optional[int] = None) -> int:
    """TorchServe's batchSize (requests) whose rows fill a model call of `batch_rows` rows:
    floor(B / R), at least 1, at most `fill_requests` (the requests each worker can hold at once
    under the expected load). One row per request: B itself."""
    if not multi_row(rows_per_request):
        return int(batch_rows)
    n = max(1, int(math.floor(batch_rows / rows_per_request + _EPS)))
    return max(1, min(n, int(fill_requests))) if fill_requests else n


def model_calls(batch_requests: int, rows_per_request: float, batch_rows: int) -> int:
    """Model calls of at most `batch_rows` rows that a TorchServe batch of `batch_requests`
    requests of R rows each takes: ceil(requests × R / B), at least 1."""
    return max(1, int(math.ceil(batch_requests * rows_per_request / max(1, batch_rows) - _EPS)))


def fill_limit_rows(expected_concurrency: int, workers: int, rows_per_request: float = 1.0) -> int:
    """The largest model batch (rows) every worker can fill at once with `expected_concurrency`
    requests in flight: floor(concurrency × R / workers); R = 1 gives concurrency // workers."""
    if not multi_row(rows_per_request):
        return max(1, int(expected_concurrency) // max(1, int(workers)))
    return max(1, int(math.floor(int(expected_concurrency) * rows_per_request / max(1, int(workers)) + _EPS)))


def request_work_ms(batch_p99_ms: float, batch_requests: int, rows_per_request: float, batch_rows: int) -> float:
    """The model time a request waits for once its batch starts: every model call of the batch
    (the handler answers the batch's requests together), each at most the call's p99."""
    return model_calls(batch_requests, rows_per_request, batch_rows) * batch_p99_ms


def fill_wait_ms(batch_requests: int, rows_per_request: float, rows_per_s: float, workers: int) -> float:
    """How long a batch of `batch_requests` takes to fill when the workers run at `rows_per_s` each:
    (requests − 1) × R × 1000 / (workers × rows/s)."""
    return (batch_requests - 1) * rows_per_request * 1000.0 / max(rows_per_s * workers, 1e-9)


# --------------------------------------------------------------------------- the expected load
def rows_of_cases(golden_dir: Path) -> dict:
    """Rows per request of the golden HTTP cases (the load tune and serve_check apply), decoded by
    the task's own adapter: {"rows_per_request": mean, "min", "max", "requests", "source"}. No
    golden set (or no cases): one row per request."""
    golden_dir = Path(golden_dir)
    cases_file, manifest = golden_dir / "http_cases.json", golden_dir / "golden.json"
    one = {"rows_per_request": 1.0, "min": 1, "max": 1, "requests": 0, "source": "no golden HTTP cases: one row"}
    if not cases_file.is_file() or not manifest.is_file():
        return one
    from handlers.tasks import RequestError, make_adapter
    task = json.loads(manifest.read_text()).get("task") or {}
    cases = json.loads(cases_file.read_text())
    if not cases or any("body" not in c for c in cases):
        return one          # bodies in files: images and tensors, one row each
    try:
        adapter = make_adapter(golden_dir, task)
        counts = []
        for c in cases:
            body = c["body"] if isinstance(c["body"], str) else json.dumps(c["body"])
            counts.append(len(adapter.decode_request(body.encode("utf-8"), c.get("content_type")).rows))
    except (OSError, ValueError, RequestError) as e:      # a golden case the adapter refuses: say so
        return {**one, "source": f"the golden cases could not be decoded ({type(e).__name__}: {e}): one row"}
    return {"rows_per_request": round(sum(counts) / len(counts), 3), "min": min(counts), "max": max(counts),
            "requests": len(counts), "source": f"{cases_file.name}, decoded by the {task.get('kind')} adapter"}
