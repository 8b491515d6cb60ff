"""The report's servers section (pipeline/publish/report_servers.py): both servers' figures side by side and the
ratios from serve_check.json `servers`; without a Ray Serve check, the line naming its artifacts and the param."""
from __future__ import annotations

from pipeline.publish.report_inputs import ReportInputs
from pipeline.publish.report_render import Para, Table
from pipeline.publish.report_servers import servers_blocks


def _inputs(serve_check):
    return ReportInputs(model_name="m", latency_slo_ms=100.0, variants=["eager"], serve_check=serve_check)


def test_side_by_side_table_and_ratios():
    line = {"ready_s": 2.5, "p50_ms": 20.0, "p99_ms": 40.0, "throughput_rps": 500.0, "requests_ok": 100,
            "requests_sent": 100, "errors_5xx": 0, "requests_lost": 0, "batch_sizes_seen": {"8": 12},
            "slo_met": True, "handler_us_per_request": 3000.0, "model_us_per_request": 2800.0}
    ray = {**line, "ready_s": 10.0, "throughput_rps": 150.0, "p99_ms": 160.0, "slo_met": False}
    blocks = servers_blocks(_inputs({"servers": {"torchserve": line, "ray-serve": ray, "concurrency": 16,
                                                  "ray_vs_torchserve": {"throughput": 0.3, "p99": 4.0, "ready": 4.0}}}))
    table = next(b for b in blocks if isinstance(b, Table))
    rows = {r[0]: r[1:] for r in table.rows}
    assert rows["throughput (req/s)"] == ["500", "150"] and rows["p99 ≤ SLO"][1] in ("False", "no", "✗", "false")
    assert rows["p50 / p99 (ms)"][1].endswith("160")
    text = " ".join(b.text for b in blocks if isinstance(b, Para))
    assert "throughput ×0.3" in text and "16 keep-alive clients" in text


def test_without_a_ray_serve_check_it_names_the_artifacts_and_the_param():
    text = " ".join(b.text for b in servers_blocks(_inputs({"ok": True})) if isinstance(b, Para))
    assert "artifacts/ray-serve/serve_config.yaml" in text and "servers" in text
