"""The report's side-by-side of the servers the winner was proven in (metrics/serve_check.json `servers`,
pipeline/serve/ray_serve_check.py): TorchServe and Ray Serve under the same checks and load, in one run.
Without a Ray Serve check, one line saying its artifacts are written and how to prove them."""
from __future__ import annotations

from pipeline.publish.report_inputs import ReportInputs
from pipeline.publish.report_render import Block, Heading, Para, Table, batches_text, fmt

ROWS = (("READY (s)", "ready_s"), ("first request (ms)", "first_request_ms"), ("HTTP parity", "parity_ok"),
        ("p50 / p99 (ms)", None), ("throughput (req/s)", "throughput_rps"),
        ("requests ok / sent", None), ("5xx / lost", None), ("batches formed (count of size)", None),
        ("handler µs / request (its model part)", None), ("worker busy share (handler time / wall)", "worker_busy_share"),
        ("worker peak RSS (MB)", "worker_peak_rss_mb"), ("p99 ≤ SLO", "slo_met"))


def _cell(line: dict, label: str, key) -> str:
    if key:
        return fmt(line.get(key))
    if label.startswith("p50"):
        return f"{fmt(line.get('p50_ms'))} / {fmt(line.get('p99_ms'))}"
    if label.startswith("requests"):
        return f"{fmt(line.get('requests_ok'))} / {fmt(line.get('requests_sent'))}"
    if label.startswith("5xx"):
        return f"{fmt(line.get('errors_5xx'))} / {fmt(line.get('requests_lost'))}"
    if label.startswith("batches"):
        return batches_text(line.get("batch_sizes_seen"))
    return f"{fmt(line.get('handler_us_per_request'))} ({fmt(line.get('model_us_per_request'))})"


def servers_blocks(inputs: ReportInputs) -> list[Block]:
    sc = inputs.serve_check or {}
    servers = sc.get("servers")
    head = Heading("Servers: TorchServe and Ray Serve", 3)
    if not servers:
        return [head, Para("Ray Serve: `artifacts/ray-serve/serve_config.yaml` (`serve run` it from the repository "
                           "root) and `rayservice.yaml` (KubeRay) are written from the same settings, but were not "
                           "proven in this run: add ray-serve to `servers` to serve them under the same "
                           "checks and load (docs/ray-serve.md).")]
    ts, ray, r = servers.get("torchserve") or {}, servers.get("ray-serve") or {}, servers.get("ray_vs_torchserve") or {}
    rows = [[label, _cell(ts, label, key), _cell(ray, label, key)] for label, key in ROWS]
    text = (f"The same .mar's folder form, the same handler code and settings, the same golden cases, bad inputs "
            f"and load ({fmt(servers.get('concurrency'))} keep-alive clients), one after the other on this host. "
            f"Ray Serve / TorchServe: throughput ×{fmt(r.get('throughput'))}, p99 ×{fmt(r.get('p99'))}, "
            f"READY ×{fmt(r.get('ready'))}. The handler's own time per request is the same code in both; what a "
            f"worker's wall holds besides it is the server's request path and the waits for a batch to fill.")
    error = (servers.get("ray_serve_detail") or {}).get("error")
    return [head, Para(text), Table(["figure", "TorchServe", "Ray Serve"], rows)] + (
        [Para(f"Ray Serve error: {error[:400]}")] if error else [])
