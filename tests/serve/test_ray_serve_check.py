"""The winner proven on Ray Serve by the checks TorchServe gets (pipeline/serve/ray_serve_check.py): a tiny
embedder built by the pipeline's steps, its golden HTTP cases, READY, parity, bad input beside valid requests
and the measured load on a real `serve run` (loopback, always stopped) and on a real TorchServe, in one run,
compared side by side. No figure is asserted as a speed: only that both were measured and the ratios are theirs."""
from __future__ import annotations

import shutil

import pytest

from pipeline.serve.ray_serve_check import compare_servers, ratios, server_summary

pytestmark = [pytest.mark.ray_serve, pytest.mark.torchserve,
              pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")]


def test_summary_and_ratios_from_records():
    flat = {"ready": True, "ready_s": 2.0, "p99_ms": 50.0, "throughput_rps": 400.0, "settings": {"workers": 2},
            "handler_profile": {"handle_us": 4000.0, "model_us": 3500.0}}
    line = server_summary(flat, slo_ms=40.0)
    assert line["slo_met"] is False and line["worker_busy_share"] == 0.8 and line["model_us_per_request"] == 3500.0
    assert server_summary({**flat, "p99_ms": 30.0}, slo_ms=40.0)["slo_met"] is True
    assert ratios({"throughput_rps": 300.0, "p99_ms": 60.0, "ready_s": 5.0}, flat) == {
        "throughput": 0.75, "p99": 1.2, "ready": 2.5}


def test_ray_serve_proven_beside_torchserve(tmp_path, text_params):
    from pipeline.model.golden import HTTP_CASES_JSON
    from pipeline.serve.checks.http_cases import load_http_cases
    from pipeline.serve.ray_serve_check import check_ray_serve
    from pipeline.serve.serve_check import ServerSpec, _flat, check_server
    from pipeline.serve.variant_server import ray_serve_of, serve_variant
    served = serve_variant(text_params, tmp_path, settings={"batch_size": 4, "max_batch_delay_ms": 20, "workers": 2})
    rs = ray_serve_of(served, text_params, tmp_path)        # writes tmp_path/ray-serve/serve_config.yaml
    cases = load_http_cases(tmp_path / "artifacts" / "golden" / HTTP_CASES_JSON)
    name = text_params.model.name
    checks = dict(task="text-embedding", atol=1e-4, rtol=1e-3, gate=None, requests=120, concurrency=8,
                  time_cap_s=30, warmup_s=1.0)
    ts = check_server(ServerSpec(name, served.mar.parent, None), cases, server=served.ts, **checks)
    ray = check_ray_serve(name, rs.source, cases, **checks)
    assert ray["server"] == "ray-serve" and ray["ready"], ray.get("error")
    assert ray["parity"]["ok"], ray["parity"]
    bad = ray["bad_inputs"]
    assert bad["ok"] and bad["worker_stayed_up"] and not bad["valid_alongside_failed"], bad
    assert {c["id"]: c["status"] for c in bad["cases"]}["over_size_limit"] == 413
    load = ray["load"]
    assert load["requests_ok"] == load["requests_sent"] == 120 and not load["errors_5xx"] and not load["lost"]
    assert sum(load["batch_sizes_seen"].values()) > 0 and max(int(k) for k in load["batch_sizes_seen"]) > 1
    assert ray["settings"]["workers"] == 2 and ray["worker_peak_rss_mb"] > 0 and ray["handler_load_ms"]["total"] > 0
    record = {**_flat(ts), "failures": []}
    section = compare_servers(record, ray, slo_ms=1000.0, concurrency=8)
    assert record["ok"], record["failures"]
    r = section["ray_vs_torchserve"]
    assert r["throughput"] == round(ray["load"]["throughput_rps"] / ts["load"]["throughput_rps"], 3)
    assert section["ray-serve"]["ready_s"] > 0 and section["torchserve"]["ready_s"] > 0
