"""The report stage on synthetic stage outputs that follow docs/artifacts.md."""
from __future__ import annotations

import base64
import html
import json
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from pipeline.core.params import REPO_ROOT
from pipeline.publish.report import build_blocks
from pipeline.publish.report_inputs import ReportInputs, collect_inputs
from pipeline.publish.report_render import render_markdown
from pipeline.publish.report_summary import served_verdict, summary_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VARIANTS = ["eager", "onnx", "fp16"]
# matplotlib's default colour cycle: the first and second curve drawn (benchmarks in params order).
FIRST_CURVE, SECOND_CURVE = "#1f77b4", "#ff7f0e"
LOAD_PHASE_COLOURS = ("#9e9e9e", "#4e79a7", "#f28e2b", "#59a14f", "#e15759")   # import … first_call
WINNER_BAR, BASELINE_BAR = "#4e79a7", "#bab0ac"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a whole PNG: signature, IHDR first, IEND last."""
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def pixels(png: Path, colour: str, tol: float = 0.02):
    """Mask of the pixels drawn in `colour` (#rrggbb), within `tol` per channel."""
    import matplotlib.image as mpimg
    import numpy as np
    rgb = mpimg.imread(png)[..., :3]
    want = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return np.abs(rgb - want).max(axis=-1) < tol


def slo_line_span(png: Path) -> float:
    """The widest row of red (the dashed SLO line, anti-aliased) as a share of the image's width."""
    import matplotlib.image as mpimg
    rgb = mpimg.imread(png)[..., :3]
    red = (rgb[..., 0] > 0.9) & (rgb[..., 1] < 0.3) & (rgb[..., 2] < 0.3)
    return red.sum(axis=1).max() / rgb.shape[1]


def _bench(variant: str, scale: float, status: str = "ok") -> dict:
    steady = {}
    for bs in (1, 2, 4, 8):
        p99 = scale * (4 + 3 * bs)
        steady[str(bs)] = {"batch_size": bs, "p50_ms": p99 * 0.8, "p90_ms": p99 * 0.9, "p99_ms": p99,
                           "mean_ms": p99 * 0.8, "stdev_ms": 0.1, "cv": 0.02,
                           "throughput_sps": 1000 * bs / (p99 * 0.8), "iters": 50, "peak_rss_mb": 300.0,
                           "peak_gpu_mb": None, "noisy": False}
    return {"variant": variant, "status": status, "reason": None, "device": "cpu", "threads": 1,
            "artifact_bytes": 1234567,
            "cold_load": {"runs": 5, "raw_read_ms": 12.0, "load_floor_ratio": 20.0,
                          "phases_ms": {"import": {"median": 110 * scale, "max": 130},
                                        "read": {"median": 15.0, "max": 18},
                                        "deserialize": {"median": 60 * scale, "max": 70},
                                        "to_device": {"median": 1.0, "max": 2},
                                        "first_call": {"median": 20.0, "max": 25},
                                        "total": {"median": 206 * scale, "max": 240}}},
            "steady": steady, "stopped_early": None, "peak_rss_mb": 320.0, "noisy": False}


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def make_outputs(root: Path, serve_check: bool = True) -> None:
    """A plausible finished pipeline for model `tiny`: onnx wins, fp16 rejected."""
    params = {"model": {"name": "tiny", "source": "torchscript", "checkpoint": "m.pt", "task": "tensor",
                        "input_shape": [4]},
              "variants": VARIANTS, "serve": {"latency_slo_ms": 40}}
    _write(root / "params.yaml", yaml.safe_dump(params))
    a, m = root / "artifacts", root / "metrics"
    _write(a / "env.json", {"device": "cpu", "cpu": {"model": "Test CPU", "physical_cores": 2, "logical_cores": 2,
                                                     "isa": {"avx2": True, "avx512f": False}},
                            "memory_mb": 24000, "gpu": None, "disk_read_mb_s": 900.0,
                            "versions": {"torch": "2.13.0", "onnxruntime": "1.31.1"}})
    for v in VARIANTS:
        rejected = v == "fp16"
        _write(a / "variants" / v / "conversion.json", {
            "variant": v, "status": "rejected" if rejected else "converted",
            "reason": "max abs error 0.3 > atol 0.02 at batch 8" if rejected else None,
            "conversion_s": 0.5, "artifact_bytes": 1000, "dtype": "float16" if rejected else "float32",
            "tolerance": {"atol": 1e-4, "rtol": 1e-3, "min_cosine": 0.99999},
            "verification": {"batch_sizes": [1, 8], "outputs": [
                {"name": "out", "max_abs": 0.3 if rejected else 1e-6, "max_rel": 1e-5, "min_cosine": 0.99999,
                 "topk_agreement": None}], "worst": None}})
    _write(m / "benchmark" / "eager.json", _bench("eager", 1.0))
    _write(m / "benchmark" / "onnx.json", _bench("onnx", 0.6))
    _write(m / "benchmark" / "fp16.json", {"variant": "fp16", "status": "skipped",
                                            "reason": "conversion rejected", "steady": {}})
    _write(a / "selection.json", {
        "winner": "onnx", "objective": "throughput", "slo_met": True, "message": "onnx: highest throughput within SLO",
        "criteria": {"expected_concurrency": 16},
        "variants": {"onnx": {"status": "winner", "reasons": [], "figures": {"throughput_sps": 500.0, "batch_size": 4}},
                     "eager": {"status": "eligible", "reasons": ["throughput 40% below onnx"],
                               "figures": {"throughput_sps": 300.0, "batch_size": 4}},
                     "fp16": {"status": "rejected", "reasons": ["verification failed: max abs 0.3 > 0.02"],
                              "figures": {}}}})
    _write(a / "serve" / "model-config.yaml", yaml.safe_dump({
        "minWorkers": 2, "maxWorkers": 2, "batchSize": 4, "maxBatchDelay": 5, "responseTimeout": 5,
        "startupTimeout": 30, "handler": {"threads": 3, "device": "cpu"}}, sort_keys=False))
    _write(a / "serve" / "derivation.json", {
        "batchSize": {"value": 4, "formula": "largest batch with p99 + delay <= SLO", "inputs": {"p99_ms": 9.6},
                      "overridden": False},
        "startupTimeout": {"value": 30, "formula": "max(floor, worst_load*safety+margin)",
                           "inputs": {"worst_load_s": 0.15}, "overridden": False}})
    # Written on another machine: its absolute paths must not reach the page.
    _write(a / "serve" / "config.properties", "inference_address=http://127.0.0.1:8080\nload_models=tiny=tiny.mar\n"
                                              "model_store=/home/ci/run-7/artifacts/model_store\n")
    _write(a / "serve" / "start_command.txt", "torchserve --start --ncs --model-store /home/ci/run-7/artifacts/model_store "
                                             "--models tiny=tiny.mar --ts-config /home/ci/run-7/artifacts/serve/config.properties\n")
    mar = a / "model_store" / "tiny.mar"
    mar.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(mar, "w") as z:
        z.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": "tiny", "modelVersion": "1.0"}}))
        z.writestr("model.onnx", b"\0" * 100)
    if serve_check:
        _write(m / "serve_check.json", {
            "ready_s": 2.5, "worker_load_ms": 1500, "first_request_ms": 20, "parity_ok": True,
            "max_abs_error": 2e-7, "requests_sent": 320, "requests_ok": 320, "errors_5xx": 0, "p50_ms": 30,
            "p99_ms": 90, "throughput_rps": 240.0, "batch_sizes_seen": [1, 4],
            "bad_inputs": [{"case": "invalid_json", "status": 400}, {"case": "empty_body", "status": 400}],
            "baseline": {"ready_s": 5.7, "p99_ms": 3500, "throughput_rps": 11.0},
            "ratios": {"load": 0.44, "throughput": 21.8, "p99": 0.026}, "token_authorization": True,
            "winner": {"mar": "/tmp/scratch-1/artifacts/model_store/tiny.mar"},
            "references": {"concurrency": 16, "load": {"clients": 16}, "rounds": 2, "setups": {
                "winner": {"throughput_rps": 251.5, "p50_ms": 29.5, "p99_ms": 36.75, "ready_s": 2.625,
                           "within_slo": True, "rounds": [{"throughput_rps": 250.0}, {"throughput_rps": 253.0}]},
                "baseline": {"throughput_rps": 11.0, "p99_ms": 3500.0, "ready_s": 5.7, "within_slo": False,
                             "rounds": [{"throughput_rps": 11.0}]}},
                "ratios_handtuned": {"throughput": 1.25, "p99": 0.8}}})


def first_section(md: str) -> str:
    """The page's first section: from its first `## ` heading to the next one."""
    body = md.split("\n## ", 2)
    assert len(body) >= 2, md[:500]
    return "## " + body[1]


def outside_code(md: str) -> str:
    """The page without its fenced code blocks (a file shown as it is may hold braces)."""
    return re.sub(r"```.*?```", "", md, flags=re.S)


def run_stage(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "stages.report", "--root", str(root)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_report_stage_renders_md_html_and_summary(tmp_path):
    make_outputs(tmp_path)
    r = run_stage(tmp_path)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "reports" / "report.md").read_text()
    page = (tmp_path / "reports" / "report.html").read_text()

    # Every image the markdown references exists, is a whole PNG of its figure's size (figsize × 100 dpi)
    # and shows what it should; all four plots are there.
    refs = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert sorted(Path(r).name for r in refs) == ["cold_load.png", "latency.png", "serve_check.png", "throughput.png"]
    img = {Path(r).stem: tmp_path / "reports" / r for r in refs}
    assert {k: png_size(p.read_bytes()) for k, p in img.items()} == {
        "latency": (700, 420), "throughput": (700, 420),
        "cold_load": (800, 330),        # 2 variants with a cold load (fp16 was skipped): 0.55 in per bar + 2.2 in
        "serve_check": (1000, 360)}     # 3 figures side by side: 3 in each + 1 in
    for curves in ("latency", "throughput"):   # eager and onnx drawn, fp16 (skipped) not; the winner thick
        eager, onnx = (int(pixels(img[curves], c).sum()) for c in (FIRST_CURVE, SECOND_CURVE))
        assert onnx > 1.5 * eager > 0 and not pixels(img[curves], "#2ca02c").any(), (curves, eager, onnx)
    assert slo_line_span(img["latency"]) > 0.5 and slo_line_span(img["throughput"]) == 0
    assert all(pixels(img["cold_load"], c).sum() > 100 for c in LOAD_PHASE_COLOURS)
    assert pixels(img["serve_check"], WINNER_BAR).sum() > 1000 and pixels(img["serve_check"], BASELINE_BAR).sum() > 1000

    # The HTML opens offline: no external reference at all, every image inlined and decodable.
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", page)
    assert "<script" not in page
    srcs = re.findall(r'<img [^>]*src="([^"]+)"', page)
    assert len(srcs) == 4 and all(src.startswith("data:image/png;base64,") for src in srcs)
    inlined = [base64.b64decode(src.split(",", 1)[1]) for src in srcs]
    assert inlined == [img[Path(r).stem].read_bytes() for r in refs]    # the same PNGs, in the same order

    # Decision, every variant with its status and reasons, derivation, start command, environment.
    page_text = html.unescape(re.sub(r"<[^>]+>", "", page))
    md_text = md.replace("**", "").replace("`", "")
    for text in ("Deploy artifacts/model_store/tiny.mar: variant onnx", "verification failed: max abs 0.3 > 0.02", "throughput 40% below onnx",
                 "largest batch with p99 + delay <= SLO", "torchserve --start --ncs", "Test CPU",
                 "Authorization: Bearer", "invalid_json", "sha256"):
        assert text in page_text and text in md_text, text
    assert "<strong>onnx</strong>" in page
    assert "| fp16 | rejected | skipped | rejected |" in md

    summary = json.loads((tmp_path / "metrics" / "summary.json").read_text())
    onnx = _bench("onnx", 0.6)["steady"]["4"]
    # At the top: the decision as served (the serve check's medians at its named load), what and how to deploy.
    assert summary["winner"] == "onnx" and summary["slo_met"] is True
    assert summary["slo_basis"] == "served (serve_check)"       # no tune stage: the serve check's verdict
    assert (summary["throughput_rps"], summary["p50_ms"], summary["p99_ms"], summary["ready_s"]) == (
        251.5, 29.5, 36.75, 2.625)
    assert summary["load"] == {"concurrency": 16, "expected_concurrency": 16, "is_expected": True}
    assert summary["deploy"]["artifact"] == "artifacts/model_store/tiny.mar" and len(summary["deploy"]["sha256"]) == 64
    assert {k: summary["config"][k] for k in ("batch_size", "max_batch_delay_ms", "workers", "threads_per_worker",
                                              "startup_timeout_s", "response_timeout_s")} == {
        "batch_size": 4, "max_batch_delay_ms": 5, "workers": 2, "threads_per_worker": 3, "startup_timeout_s": 30,
        "response_timeout_s": 5}
    assert summary["runner_up"]["variant"] == "eager" and summary["runner_up"]["relative"] == pytest.approx(-0.4)
    # Offline figures under their own key.
    assert summary["offline"]["p99_ms"] == pytest.approx(onnx["p99_ms"])
    assert summary["offline"]["throughput_sps"] == pytest.approx(onnx["throughput_sps"])
    assert summary["offline"]["cold_load_ms"] == pytest.approx(206 * 0.6)
    assert "throughput_sps" not in summary and "cold_load_ms" not in summary
    assert summary["serve_check"]["ratio_throughput"] == 21.8 and summary["serve_check"]["parity_ok"] is True
    assert "wrote" in r.stderr and "report.html" in r.stderr   # the stage says where it wrote


def test_report_without_serve_check_says_so(tmp_path):
    make_outputs(tmp_path, serve_check=False)
    (tmp_path / "metrics" / "benchmark" / "eager.json").unlink()     # and one benchmark missing too
    r = run_stage(tmp_path)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "reports" / "report.md").read_text()
    assert "Serve check not run" in md
    assert "metrics/serve_check.json" in md and "metrics/benchmark/eager.json" in md   # named as missing
    assert not (tmp_path / "reports" / "img" / "serve_check.png").exists()
    latency = tmp_path / "reports" / "img" / "latency.png"
    assert png_size(latency.read_bytes()) == (700, 420)
    # one curve left (onnx, the first drawn now), with the SLO line; eager's is not drawn from nothing
    assert pixels(latency, FIRST_CURVE).sum() > 500 and not pixels(latency, SECOND_CURVE).any()
    assert slo_line_span(latency) > 0.5
    summary = json.loads((tmp_path / "metrics" / "summary.json").read_text())
    assert summary["serve_check"] == {"ran": False} and summary["winner"] == "onnx"
    assert summary["throughput_rps"] is None and summary["slo_basis"] == "predicted"
    assert summary["load"]["concurrency"] is None
    first = first_section(md)
    assert "load unknown" in first and "Serve check not run" not in first and "not run" in first


def test_report_on_empty_tree_still_renders(tmp_path):
    make_outputs(tmp_path)
    for sub in ("artifacts", "metrics"):
        import shutil
        shutil.rmtree(tmp_path / sub)
    r = run_stage(tmp_path)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "reports" / "report.md").read_text()
    assert "No decision yet" in md and "No plots" in md
    assert not list((tmp_path / "reports").glob("img/*.png"))


def test_corrupt_input_is_a_clear_error(tmp_path):
    make_outputs(tmp_path)
    (tmp_path / "artifacts" / "selection.json").write_text("{not json")
    r = run_stage(tmp_path)
    assert r.returncode == 2
    assert "selection.json" in r.stderr and "not valid JSON" in r.stderr and "dvc repro" in r.stderr


def test_summary_falls_back_to_best_batch_without_config(tmp_path):
    make_outputs(tmp_path, serve_check=False)
    (tmp_path / "artifacts" / "serve" / "model-config.yaml").unlink()
    (tmp_path / "artifacts" / "serve" / "derivation.json").unlink()
    inputs = collect_inputs(tmp_path, "tiny", 40.0, VARIANTS)
    s = summary_metrics(inputs)
    steady = _bench("onnx", 0.6)["steady"]
    best = max(steady.values(), key=lambda r: r["throughput_sps"])
    assert s["config"]["batch_size"] is None and s["offline"]["throughput_sps"] == pytest.approx(best["throughput_sps"])
    assert inputs.mar["model_version"] == "1.0" and len(inputs.mar["sha256"]) == 64


def _served_inputs(winner_p99: float, concurrency: int = 16):
    tuning = {"enabled": True, "slo_met": True, "served_p99_ms": 80.0, "served_throughput_rps": 300.0,
              "expected_concurrency": 16}
    refs = {"concurrency": concurrency, "setups": {"winner": {"p99_ms": winner_p99, "within_slo": winner_p99 <= 100}}}
    return ReportInputs(model_name="tiny", latency_slo_ms=100.0, variants=VARIANTS, selection={"slo_met": True, "winner": "onnx"},
                        tuning=tuning, serve_check={"references": refs})


def test_served_slo_verdict_must_hold_in_serve_check_too():
    ok = served_verdict(_served_inputs(90.0))
    assert ok["slo_met"] is True and ok["serve_check_confirms_slo"] is True and ok["slo_basis"] == "served"
    # the archived winner missed the SLO in serve_check's rounds at the same load: not met
    miss = served_verdict(_served_inputs(140.0))
    assert miss["slo_met"] is False and miss["slo_basis"] == "served (serve_check)"
    assert miss["tuning"]["served_p99_ms"] == 80.0                  # the tune stage's own figure, kept beside
    # measured at another load: it neither confirms nor overturns the tune stage's verdict
    other = served_verdict(_served_inputs(140.0, concurrency=32))
    assert other["slo_met"] is True and "serve_check_confirms_slo" not in other


def test_the_page_words_the_verdict_it_is_given():
    """The SLO verdict is decided once, in summary_metrics; the page only words it, so the page and
    summary.json cannot disagree."""
    inputs = _served_inputs(140.0)          # tuned: met; serve_check at the same load: missed
    summary = summary_metrics(inputs)
    assert summary["slo_met"] is False and summary["offline"]["slo_met_predicted"] is True
    md = render_markdown(build_blocks(inputs, summary, {}), Path("."))
    assert "Latency SLO 100 ms p99: **NOT met** measured in TorchServe by the serve check, 16 concurrent clients" in md
    served = {**summary, "slo_met": True, "slo_basis": "served"}
    md = render_markdown(build_blocks(inputs, served, {}), Path("."))
    assert "Latency SLO 100 ms p99: **met** in TorchServe under the expected load" in md


def test_page_shows_served_against_the_bound_and_the_held_back_int8():
    inputs = _served_inputs(90.0)
    bound = {"served_rps": 398.4, "ceiling_rps": 694.17, "model_alone_rps": 1355.96, "bound_rps": 459.12,
             "served_vs_bound": 0.868, "formula": "1 / (1 / ceiling + 1 / model_alone)",
             "model_alone": {"workers": 2, "per_process_sps": 677.98, "batch_size": 8},
             "ceiling_answer_bytes": 4101, "ceiling_empty_rps": 801.5}
    inputs.serve_check["references"]["bound"] = bound
    inputs.serve_check["references"]["setups"]["winner"].update({"throughput_rps": 398.4, "ready_s": 2.7})
    inputs.serve_check["handler_profile"] = {"requests": 491, "batches": 180, "decode_us": 99.9, "collate_us": 13.4,
                                             "model_us": 4225.1, "respond_us": 54.2, "handle_us": 4408.9}
    inputs.selection["quantized_alternative"] = {
        "variant": "onnx-int8-dynamic", "opt_in": "serve.allow_quantized: true",
        "figures": {"throughput_sps": 520.5, "batch_size": 8, "request_p99_ms": 24.7,
                    "task_gate": {"embedding": {"min_cosine": 0.998, "recall_at_k": 0.9651}}}}
    md = render_markdown(build_blocks(inputs, summary_metrics(inputs), {}), Path("."))
    assert "Served 398.4 req/s of a bound of 459.1 = **0.868**" in md and "(694.2 req/s; 801.5 with empty" in md
    assert "answering 4101 bytes per request" in md and "the benchmark's 678 samples/s at batch 8" in md
    # The model alone measured in the run: said so, the benchmark's figure beside it.
    bound["model_alone"] = {"workers": 2, "batch_size": 8, "value": 1555.1, "measured": {"ok": True}}
    bound["model_alone_benchmark"] = {"value": 1355.96}
    md = render_markdown(build_blocks(inputs, summary_metrics(inputs), {}), Path("."))
    assert "run alone in this run, 2 worker process(es) at once on the served requests in server batches of 8" in md
    assert "another hour: 1356" in md
    assert "| model | 4225 |" in md and "| respond | 54.2 |" in md and "491 requests in 180 batches" in md
    assert "`onnx-int8-dynamic` would give 520.5 samples/s" in md and "set `serve.allow_quantized: true`" in md
    assert "recall_at_k 0.9651" in md
    # A float variant held back because it changes the task's answers says so, not "quantized".
    inputs.selection["quantized_alternative"] = {
        "variant": "bf16", "opt_in": "serve.allow_quantized: true",
        "figures": {"throughput_sps": 610.0, "batch_size": 8, "request_p99_ms": 20.1,
                    "answers": {"exact": False, "reason": "3 of 13 queries' texts come in another order than eager's"}}}
    md = render_markdown(build_blocks(inputs, summary_metrics(inputs), {}), Path("."))
    assert "Held back, offline: a variant that changes the answers" in md
    assert "within its float tolerance, but 3 of 13 queries' texts come in another order" in md
    # Without the figures, no such sections.
    bare = render_markdown(build_blocks(_served_inputs(90.0), summary_metrics(_served_inputs(90.0)), {}), Path("."))
    assert "host's bound" not in bare and "Held back" not in bare


def test_first_screen_is_the_served_decision(tmp_path):
    """The page opens on what to deploy, the serve check's figures at a named load, the configuration
    with threads, the runner-up and a start command with repo-relative paths; offline figures come later."""
    make_outputs(tmp_path)
    r = run_stage(tmp_path)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "reports" / "report.md").read_text()
    page = (tmp_path / "reports" / "report.html").read_text()
    first = first_section(md)
    assert first.startswith("## Decision: what to deploy")
    assert md.index("## Decision") < min(md.index(h) for h in ("## Serve check", "## Variants", "## Offline"))
    # What to deploy, where: the .mar's repo-relative path, its sha256.
    assert "`artifacts/model_store/tiny.mar`" in first and "sha256" in first
    # The serve check's medians (not its first load, not the benchmark's), at the load its record names.
    assert "16 concurrent clients = serve.expected_concurrency" in first
    assert "| throughput | 251.5 req/s |" in first and "| latency p50 / p99 | 29.5 ms / 36.75 ms |" in first
    assert "| READY after start (all workers loaded) | 2.625 s |" in first and "| p99 ≤ SLO 40 ms | yes |" in first
    # the first load's req/s (240) is further down; a sha256 may hold those digits, but only between hex digits
    assert not re.search(r"(?<![0-9a-f.])240(\.0)?(?![0-9a-f])", first), first
    # The configuration, threads per worker included, each with its unit.
    for row in ("| batch size (TorchServe batchSize) | 4 requests |", "| max batch delay (maxBatchDelay) | 5 ms |",
                "| workers (minWorkers = maxWorkers) | 2 processes |", "| threads per worker (handler.threads) | 3 threads |",
                "| startup timeout (startupTimeout) | 30 s |", "| response timeout (responseTimeout) | 5 s |"):
        assert row in first, row
    assert "Runner-up: **eager**" in first and "40% less throughput than onnx" in first
    # A start command that works from the repo root: relative paths, the threads, no other machine's path.
    assert ("OMP_NUM_THREADS=3 MKL_NUM_THREADS=3 TOKENIZERS_PARALLELISM=false torchserve --start --ncs "
            "--model-store artifacts/model_store --models tiny=tiny.mar --ts-config artifacts/serve/config.properties"
            ) in first
    # Offline figures only after the decision, labelled offline.
    assert "samples/s" not in first and "benchmark (ms)" not in first
    offline_at = md.index("## Offline figures of the served variant (benchmark)")
    assert md.index("## Variants (offline benchmark)") > offline_at > md.index("## Decision")
    assert md.index("samples/s") > md.index("## Decision") + len(first)
    # Nowhere on the page: a raw dict or list, an absolute machine path.
    for text in (outside_code(md), html.unescape(re.sub(r"<pre>.*?</pre>", "", page, flags=re.S))):
        assert not re.search(r"\{['\"]|\[\[|\['|\{\d", text), re.search(r".{60}(\{['\"]|\['|\[\[).{60}", text)
    for text in (md, page):
        assert not re.search(r"/(home|tmp|work)/", text), re.search(r".{60}/(home|tmp|work)/.{60}", text)
    assert "model_store=artifacts/model_store" in md            # config.properties shown with the path made relative
    # The HTML's first screen is the same decision.
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    start = text.index("Decision: what to deploy")
    assert start < text.index("Serve check in TorchServe") and "251.5 req/s" in text[start:text.index("Serve check in")]
    assert "3 threads" in text[start:text.index("Serve check in")]


def test_first_screen_names_another_load_and_the_tuned_runner_up():
    """The serve check at another load than expected: said so. The tune stage's best other candidate
    and the decision step about it are on the first screen."""
    inputs = _served_inputs(90.0, concurrency=32)
    inputs.tuning.update(chosen_name="offline choice", candidates=[
        {"name": "offline choice", "throughput_rps": 300.0, "p99_ms": 80.0,
         "settings": {"batch_size": 8, "max_batch_delay_ms": 11, "workers": 2, "threads_per_worker": 1}},
        {"name": "batch 4", "throughput_rps": 280.0, "p99_ms": 70.0,
         "settings": {"batch_size": 4, "max_batch_delay_ms": 5, "workers": 2, "threads_per_worker": 1}}],
        decision_steps=["offline choice: served 300 req/s (start)",
                        "batch 4: throughput -6.7% vs offline choice, within the noise band 20%: offline choice stays"])
    inputs.serve_check["references"]["setups"]["winner"].update(throughput_rps=310.0, p50_ms=50.0, ready_s=2.0)
    first = first_section(render_markdown(build_blocks(inputs, summary_metrics(inputs), {}), Path(".")))
    assert "32 concurrent clients, not the expected load (serve.expected_concurrency 16)" in first
    assert "| throughput | 310 req/s |" in first
    assert ("Runner-up operating point, served by the tune stage: batch 4 (batch 4, delay 5 ms, 2 workers × 1 threads), "
            "280 req/s, p99 70 ms: throughput -6.7% vs offline choice, within the noise band 20%: offline choice stays"
            ) in first
