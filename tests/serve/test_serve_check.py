"""pipeline/serve/{serve_check,http_cases,parity,bad_input,load}.py and stages/serve_check.py.

Pure logic first (response comparison, bad-input cases, inputs), then the checks against a real
TorchServe serving the tiny double model of tests/serve/test_torchserve.py, and the stage end to end
(winner + baseline, metrics/serve_check.json) on a tiny .mar with hand-written golden cases.
"""
from __future__ import annotations

import json
import shutil
import time
import zipfile

import numpy as np
import pytest

from pipeline.decide.properties import write_config_properties
from pipeline.serve.checks.bad_input import bad_input_cases, check_bad_inputs
from pipeline.serve.checks.http_cases import HttpCase, load_http_cases, tolerance_from_mar
from pipeline.serve.checks.load import ResponseParser, request_bytes, run_load
from pipeline.serve.checks.parity import check_parity, compare_response
from pipeline.serve.server.torchserve import TorchServe
from tests.serve.test_torchserve import DERIVED, DOUBLE_HANDLER, assert_nothing_left, build_mar

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")

# The stage tests' warm-up cap: the default 10 s (stretched while the JVM's compilers are busy) is
# the real pipeline's; the warm-up itself is tested on its own below.
WARMUP_S = 1.0

CASES = [HttpCase(f"c{i}", "application/json", json.dumps(x).encode(), [2 * v for v in x])
         for i, x in enumerate([[1, 2, 3], [0.5, -1.25, 4], [10, 20, 30], [-3, 0, 3], [7, 7, 7], [1e-3, 2, 5]])]


# --------------------------------------------------------------------------- logic
def test_compare_numbers_nested_and_types():
    assert compare_response([1.0, [2.0]], [1.0, [2.0]], 1e-6, 0)[0]
    ok, err, msg = compare_response([1.0, [2.01]], [1.0, [2.0]], 1e-3, 0)
    assert not ok and err == pytest.approx(0.01) and "response[1][0]" in msg
    assert compare_response([1.0, [2.01]], [1.0, [2.0]], 0, 0.01)[0]          # relative tolerance
    assert not compare_response({"embedding": [1, 2]}, {"embedding": [1, 2, 3]}, 1, 1)[0]
    assert not compare_response({"embedding": "x"}, {"embedding": [1.0]}, 1, 1)[0]
    assert not compare_response({"a": 1}, {"b": 1}, 1, 1)[0]
    assert not compare_response([float("nan")], [1.0], 1, 1)[0]


def test_compare_labels_tolerates_swapped_near_ties_not_a_new_winner():
    exp = [{"label": "c", "score": 0.6}, {"label": "a", "score": 0.2000}, {"label": "b", "score": 0.1999}]
    swapped = [exp[0], exp[2], exp[1]]
    assert compare_response(swapped, exp, 1e-3, 0)[0]
    assert compare_response([swapped, exp], [exp, exp], 1e-3, 0)[0]          # a list input: one answer each
    new_winner = [exp[1], exp[0], exp[2]]
    ok, _, msg = compare_response(new_winner, exp, 1, 1)
    assert not ok and "top-1" in msg
    off = json.loads(json.dumps(exp))
    off[0]["score"] = 0.5
    assert not compare_response(off, exp, 1e-3, 0)[0]
    assert not compare_response(exp[:2], exp, 1, 1)[0]                       # as many labels as expected


def test_token_answers_without_aggregation_are_compared_in_text_order_not_as_a_ranking():
    tokens = [{"entity": "B-PER", "score": 0.67, "index": 1, "word": "before", "start": 0, "end": 6},
              {"entity": "B-ORG", "score": 0.97, "index": 2, "word": "bird", "start": 7, "end": 11}]
    assert compare_response([dict(t) for t in tokens], tokens, 1e-4, 1e-3)[0]
    moved = [dict(tokens[0], end=5), tokens[1]]
    assert not compare_response(moved, tokens, 1e-4, 1e-3)[0]
    ranked = [{"index": 1, "score": 0.9}, {"index": 0, "score": 0.2}]
    ok, _, msg = compare_response([{"index": 0, "score": 0.2}, {"index": 1, "score": 0.9}], ranked, 1e-4, 1e-3)
    assert not ok and "ranked before" in msg                 # a rerank answer is judged by its order


def test_embedding_parity_records_cosine_and_fails_unit_references_served_off_unit():
    from pipeline.serve.checks.parity import _with_embedding_figures
    unit = np.array([0.6, 0.8])
    ok = _with_embedding_figures({"ok": True, "failures": []}, [({"embedding": list(unit * (1 + 5e-6))},
                                                                   {"embedding": list(unit)})])
    assert ok["ok"] and ok["embedding"]["unit_reference"] and ok["embedding"]["max_norm_error"] < 1e-5
    assert ok["embedding"]["min_cosine"] == 1.0
    off = _with_embedding_figures({"ok": True, "failures": []}, [({"embedding": list(unit * 1.0024)},
                                                                    {"embedding": list(unit)})])
    assert not off["ok"] and "not unit vectors" in off["failures"][0]["error"]
    # A model without Normalize: its vectors' norms are whatever they are.
    free = _with_embedding_figures({"ok": True, "failures": []}, [({"embedding": [3.0, 4.0]}, {"embedding": [3.0, 4.0]})])
    assert free["ok"] and not free["embedding"]["unit_reference"]
    assert _with_embedding_figures({"ok": True, "failures": []}, [([{"label": "a", "score": 1.0}],) * 2]) == \
        {"ok": True, "failures": []}


def test_response_parser_lengths_chunks_and_split_reads():
    p = ResponseParser()
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nx-request-id: abc\r\n\r\n"
    stream = head + b"hello" + b"HTTP/1.1 413 Request Entity Too Large\r\ncontent-length: 2\r\nconnection: close\r\n\r\nno"
    # Byte by byte: nothing is complete before its last body byte.
    done = [p.feed(stream[i:i + 1]) for i in range(len(head) + 5)]
    assert done.index(True) == len(head) + 4 and not any(done[:-1])
    status, headers, body = p.take(keep_body=True)
    assert (status, headers["x-request-id"], body) == (200, "abc", b"hello")
    assert p.feed(stream[len(head) + 5:])                       # the next response, in one read
    assert p.take(keep_body=False)[:2] == (413, {"content-length": "2", "connection": "close"})
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    assert not p.feed(chunked[:-3]) and p.feed(chunked[-3:])
    assert p.take(keep_body=True)[0] == 200 and p.buf == bytearray()
    with pytest.raises(ValueError, match="not an HTTP response"):
        ResponseParser().feed(b"SSH-2.0-OpenSSH\r\n\r\n")


def test_request_bytes_carry_token_type_and_exact_length():
    case = HttpCase("c", "application/json", b'{"a": "\xc3\xa9"}')
    wire = request_bytes("/predictions/m", "tok", case)
    head, body = wire.split(b"\r\n\r\n", 1)
    assert body == case.body and head.startswith(b"POST /predictions/m HTTP/1.1\r\n")
    assert f"Content-Length: {len(case.body)}".encode() in head and b"Authorization: Bearer tok" in head
    assert b"Content-Type: application/json" in head
    assert b"Authorization" not in request_bytes("/p", None, HttpCase("n", None, b"")).split(b"\r\n\r\n")[0]


def test_bad_input_cases_per_task():
    tensor_cases = [HttpCase("t", "application/json", json.dumps(np.zeros((2, 3)).tolist()).encode())]
    bad = {b.id: b for b in bad_input_cases("tensor", tensor_cases, 100)}
    assert {"empty_body", "over_size_limit", "invalid_json", "wrong_content_type", "wrong_shape",
            "wrong_dtype"} <= set(bad)
    assert len(bad["over_size_limit"].body) == 101 and bad["empty_body"].body == b""
    assert np.asarray(json.loads(bad["wrong_shape"].body)).shape != (2, 3)
    assert np.asarray(json.loads(bad["wrong_dtype"].body)).shape == (2, 3)
    with pytest.raises(ValueError):
        json.loads(bad["invalid_json"].body)
    image = {b.id: b for b in bad_input_cases("image-classification", [HttpCase("i", "image/png", b"png")], 10)}
    assert {"undecodable_image", "wrong_content_type", "invalid_json", "truncated_image", "not_base64",
            "bad_parameter", "decompression_bomb"} <= set(image)
    text = {b.id for b in bad_input_cases("text-embedding", [HttpCase("s", "application/json", b"{}")], 10)}
    assert {"wrong_type", "wrong_content_type", "invalid_json"} <= text
    with pytest.raises(ValueError, match="unknown task"):
        bad_input_cases("audio", tensor_cases, 10)


def test_load_http_cases_and_tolerance_from_mar(tmp_path):
    (tmp_path / "bodies").mkdir()
    (tmp_path / "bodies" / "a.png").write_bytes(b"\x89PNG")
    (tmp_path / "http_cases.json").write_text(json.dumps([
        {"id": "s", "content_type": "text/plain", "body": "hello", "expected": {"embedding": [1]}},
        {"id": "f", "content_type": "image/png", "body_file": "bodies/a.png", "expected": None},
        {"id": "j", "content_type": "application/json", "body": {"input": [1]}, "expected": [2]}]))
    cases = load_http_cases(tmp_path / "http_cases.json")
    assert [c.body for c in cases] == [b"hello", b"\x89PNG", b'{"input": [1]}']
    with pytest.raises(FileNotFoundError, match="prepare stage"):
        load_http_cases(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps([{"id": "x"}]))
    with pytest.raises(ValueError, match="neither `body` nor `body_file`"):
        load_http_cases(tmp_path / "bad.json")

    mar = tmp_path / "m.mar"
    with zipfile.ZipFile(mar, "w") as z:
        z.writestr("provenance.json", json.dumps({"verification": {"tolerance": {"atol": 0.02, "rtol": 0.05}}}))
    assert tolerance_from_mar(mar) == {"atol": 0.02, "rtol": 0.05}
    with zipfile.ZipFile(tmp_path / "plain.mar", "w") as z:
        z.writestr("MAR-INF/MANIFEST.json", "{}")
    assert tolerance_from_mar(tmp_path / "plain.mar") is None


# --------------------------------------------------------------------------- real TorchServe
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sc_served")
    store = root / "store"
    derived = {**DERIVED, "max_batch_delay_ms": 50, "startup_timeout_s": 30, "job_queue_size": 1000}
    build_mar(store, "double", {"handler": {"length": 3}}, derivation=derived)
    config = write_config_properties(root / "config.properties", derived, model_name="double", model_store=store)
    ts = TorchServe(config, store, "double", workdir=root / "server")
    with ts:
        yield ts
    assert_nothing_left(ts)


@pytest.mark.torchserve
@needs_java
def test_parity_passes_and_a_wrong_reference_fails(served):
    good = check_parity(served, CASES, atol=1e-6, rtol=0, concurrency=4)
    assert good["ok"] and good["max_abs_error"] == 0 and not good["failures"]
    wrong = CASES[:2] + [HttpCase("off", "application/json", b"[1, 2, 3]", [2, 4, 6.5])]
    bad = check_parity(served, wrong, atol=1e-6, rtol=0, concurrency=4)
    assert not bad["ok"] and bad["max_abs_error"] == pytest.approx(0.5)
    assert {f["id"] for f in bad["failures"]} == {"off"}       # one by one and concurrently
    assert len(bad["failures"]) == 2


@pytest.mark.torchserve
@needs_java
def test_bad_inputs_sent_with_valid_ones(served):
    bad = bad_input_cases("tensor", CASES, max_request_size=4096)
    res = check_bad_inputs(served, bad, CASES, atol=1e-6, rtol=0)
    statuses = {c["id"]: c["status"] for c in res["cases"]}
    assert all(400 <= s < 500 for s in statuses.values()), statuses
    assert statuses["over_size_limit"] == 413
    assert res["worker_stayed_up"] and not res["valid_alongside_failed"] and res["ok"]
    assert res["valid_alongside"] == len(bad)
    assert res["mixed_batches"] >= 1          # a bad request shared a batch with valid ones


@pytest.mark.torchserve
@needs_java
def test_bounded_load_answers_everything_and_sees_batches(served):
    t0 = time.perf_counter()
    r = run_load(served, CASES, requests=48, concurrency=6, time_cap_s=120)
    elapsed = time.perf_counter() - t0
    assert r.requests_sent == r.requests_answered == r.requests_ok == 48
    assert r.lost == 0 and r.errors_5xx == 0 and not r.stopped_by_time_cap
    assert r.p50_ms <= r.p99_ms and r.throughput_rps == pytest.approx(r.requests_ok / r.wall_s)
    # Each client sends its requests one after another: the load lasts at least the latencies of a
    # client's share (their mean × 48 / 6 clients), and no longer than the call that ran it.
    assert r.mean_ms * 48 / 6 / 1000 <= r.wall_s <= elapsed
    sizes = {int(k): v for k, v in r.batch_sizes_seen.items()}
    assert sum(k * v for k, v in sizes.items()) == 48 and max(sizes) <= 4
    assert r.mean_batch_size > 1       # 6 clients against a 50 ms batch window


@pytest.mark.torchserve
@needs_java
def test_load_counts_4xx_and_goes_on_after_the_server_closes_the_connection(served):
    """TorchServe answers a bad request 4xx and closes the connection: the client reconnects and the
    requests after it are answered, none counted lost."""
    mixed = CASES[:2] + [HttpCase("bad", "application/json", b"not json")]
    r = run_load(served, mixed, requests=30, concurrency=3, time_cap_s=120)
    assert r.requests_sent == r.requests_answered == 30 and r.lost == 0 and r.errors_5xx == 0
    assert r.errors_4xx == 10 and r.requests_ok == 20
    assert all(400 <= f["status"] < 500 and f["error"] for f in r.failures)
    assert 20 <= sum(int(k) * v for k, v in r.batch_sizes_seen.items()) <= 30   # bad ones share batches
    assert r.client_cpu_s is not None and 0 <= r.client_cpu_s <= r.wall_s


@pytest.mark.torchserve
@needs_java
def test_warmup_runs_windows_until_three_agree_or_the_cap(served):
    from pipeline.serve.serve_check import WARMUP_SETTLED, WARMUP_SETTLED_WINDOWS, _warmup
    w = _warmup(served, CASES, 2, 4.0)
    rates = w["windows_rps"]
    assert rates and w["lost"] == 0 and w["errors_5xx"] == 0
    if w["settled"]:
        last = rates[-WARMUP_SETTLED_WINDOWS:]
        assert len(last) == 3 and max(last) / min(last) - 1 <= WARMUP_SETTLED + 0.002   # rounding
    else:       # stopped before a window that would have ended past the cap
        assert w["seconds"] + w["longest_window_s"] > 4.0
    # The frontend's JIT compilers are found and read on a real JVM (it has compiled by now).
    from pipeline.serve.server.jvm_jit import compiler_cpu_s
    assert all(x is not None and x >= 0 for x in w["jit_compiler_cores"])
    assert compiler_cpu_s(served.java_pid) > 0
    # No window settles at a zero cap: one window, then it stops (a busy compiler extends the cap,
    # not the zero).
    assert len(_warmup(served, CASES, 2, 0.0)["windows_rps"]) == 1


@pytest.mark.torchserve
@needs_java
def test_load_stops_at_the_time_cap(served):
    r = run_load(served, CASES, requests=10 ** 6, concurrency=2, time_cap_s=1.0)
    assert r.stopped_by_time_cap and 0 < r.requests_sent < 10 ** 6 and r.wall_s >= 1.0
    assert r.requests_sent == r.requests_answered == r.requests_ok


# --------------------------------------------------------------------------- the stage, end to end
@pytest.mark.torchserve
@needs_java
def test_stage_end_to_end_winner_vs_baseline(tmp_path, monkeypatch):
    """Issue 6 Done-when 3: the stage on a tiny model in real TorchServe (own handler, hand-written
    golden cases), winner and baseline in one run, metrics/serve_check.json written."""
    import stages.serve_check as stage

    store, serve, baseline, golden = (tmp_path / d for d in ("model_store", "serve", "baseline", "golden"))
    derived = {**DERIVED, "max_batch_delay_ms": 20, "startup_timeout_s": 30, "job_queue_size": 1000}
    build_mar(store, "double", {"handler": {"length": 3}}, derivation=derived)
    write_config_properties(serve / "config.properties", derived, model_name="double", model_store=store)
    # The baseline: same handler, no model-config settings, TorchServe defaults; its recipe, as the
    # archive stage writes it (the stage packs the .mar in its scratch dir while it serves it).
    double_recipe(baseline, "double", {"handler": {"length": 3}}, "load_models=double=double.mar\n")
    golden.mkdir()
    (golden / "http_cases.json").write_text(json.dumps(
        [{"id": c.id, "content_type": c.content_type, "body": c.body.decode(), "expected": c.expected}
         for c in CASES]))
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({
        "model": {"name": "double", "source": "state_dict", "checkpoint": "unused.pt",
                  "factory": "unused.py:build", "task": "tensor", "input_shape": [3]},
        "serve_check": {"requests": 40, "concurrency": 4, "time_cap_s": 60, "rounds": 2, "decided_band": 0,
                        "warmup_s": WARMUP_S}}))
    out = tmp_path / "metrics" / "serve_check.json"
    monkeypatch.setenv("PIPELINE_PARAMS", str(params))
    references = run_references_stage(tmp_path, monkeypatch, baseline, golden)
    for name, value in (("MODEL_STORE", store), ("SERVE_DIR", serve), ("GOLDEN_DIR", golden),
                        ("SERVE_CHECK_JSON", out), ("REFERENCES_JSON", references)):
        monkeypatch.setattr(stage, name, value)

    assert stage.main([]) == 0
    rec = json.loads(out.read_text())
    # The baseline's .mar existed only while it was served.
    assert not (tmp_path / "scratch").exists() and not list(baseline.rglob("*.mar"))
    assert rec["reference_archives"]["removed"] and rec["reference_archives"]["baseline"]["mar_bytes"] > 0
    for key in ("ready_s", "worker_load_ms", "first_request_ms", "parity_ok", "max_abs_error", "requests_sent",
                "requests_ok", "errors_5xx", "p50_ms", "p99_ms", "throughput_rps", "batch_sizes_seen",
                "bad_inputs", "baseline", "ratios"):
        assert key in rec, key
    assert rec["ok"] and rec["parity_ok"] and rec["failures"] == []
    assert rec["token_authorization"] is True
    assert rec["requests_sent"] == rec["requests_ok"] == 40 and rec["errors_5xx"] == 0
    assert all(400 <= s < 500 for s in rec["bad_inputs"].values())
    assert rec["settings"]["batchSize"] == 4 and rec["baseline"]["settings"]["batchSize"] == 1
    assert rec["baseline"]["requests_ok"] == 40
    assert_ratios_are_the_recorded_quotients(rec)
    # The baseline in two rounds of the references stage, the winner once here (no reference is
    # compared in this run's rounds); no hand-tuned reference for this model.
    refs = rec["references"]
    assert set(refs["setups"]) == {"winner", "baseline"} and refs["ratios_handtuned"] is None
    assert [r["round"] for r in refs["setups"]["winner"]["rounds"]] == [1]
    assert [r["round"] for r in refs["setups"]["baseline"]["rounds"]] == [1, 2]
    assert refs["measured"]["interleaved_with_winner"] is False and refs["measured"]["references"]
    assert all(r["ok"] for s in refs["setups"].values() for r in s["rounds"])
    # Each round says how long it warmed and what the compilers took during its measured load.
    assert all(r["warmup_s"] is not None and r["load_jit_compiler_cores"] >= 0
               for s in refs["setups"].values() for r in s["rounds"])
    winner, base = refs["setups"]["winner"], refs["setups"]["baseline"]
    assert refs["ratios_baseline"]["throughput"] == round(winner["throughput_rps"] / base["throughput_rps"], 4)
    assert refs["ratios_baseline"]["p99"] == round(winner["p99_ms"] / base["p99_ms"], 4)
    assert refs["ratios_baseline"]["ready"] == round(winner["ready_s"] / base["ready_s"], 4)
    assert not refs["handtuned_setup"]["available"]
    # Both servers gone.
    from pipeline.serve.server.processes import processes_of
    for detail in (rec["winner"], rec["baseline_detail"]):
        assert processes_of(__import__("pathlib").Path(detail["server_dir"])) == []


@pytest.mark.torchserve
@needs_java
def test_stage_fails_when_the_model_never_becomes_ready(tmp_path, monkeypatch):
    import stages.serve_check as stage

    store, serve, golden = tmp_path / "model_store", tmp_path / "serve", tmp_path / "golden"
    build_mar(store, "double", {"minWorkers": 1, "maxWorkers": 1, "startupTimeout": 30, "responseTimeout": 5,
                                "handler": {"fail_on_load": True}})
    out = serve_check_inputs(tmp_path, monkeypatch, "double", store, serve, golden)
    assert stage.main([]) == 1
    rec = json.loads(out.read_text())
    assert not rec["ok"] and not rec["ready"]
    assert "never became READY" in rec["failures"][0] and "missing_dependency_for_test" in rec["failures"][0]


@pytest.mark.torchserve
@needs_java
def test_stage_end_to_end_on_real_handlers_and_archive(tmp_path, monkeypatch, tensor_params):
    """Issue 6 Done-when 3 with the real parts: the committed tensor example archived by
    pipeline/serve/archive.py (handlers/ torch handler + naive baseline handler), golden cases from
    pipeline/model/golden.py, config from pipeline/decide/properties.py, checked by the stage."""
    import stages.serve_check as stage
    from pipeline.serve.archive import build_archive
    from pipeline.serve.reference.reference_archives import write_baseline
    from pipeline.model.checkpoint import load_model
    from pipeline.model.golden import write_golden
    from tests.serve.test_archive import build_stage_inputs

    art = tmp_path / "artifacts"
    inputs = build_stage_inputs(art, tensor_params)
    store, baseline, golden = art / "model_store", art / "baseline", art / "golden"
    build_archive(tensor_params, export_dir=store, **inputs)
    write_baseline(tensor_params, variants_dir=inputs["variants_dir"], baseline_dir=baseline)
    write_golden(tensor_params, load_model(tensor_params), golden)
    derived = {**DERIVED, "max_batch_delay_ms": 5, "startup_timeout_s": 60, "response_timeout_s": 30,
               "job_queue_size": 1000, "max_request_size": 200000, "max_request_bytes": 200000}
    write_config_properties(inputs["serve_dir"] / "config.properties", derived, model_name="signalnet",
                            model_store=store)
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({
        "model": {"name": "signalnet", "source": "state_dict", "checkpoint": "examples/tensor/weights.safetensors",
                  "factory": "examples/tensor/model.py:build", "task": "tensor", "input_shape": [16, 32]},
        "serve_check": {"requests": 32, "concurrency": 4, "time_cap_s": 60, "rounds": 1, "warmup_s": WARMUP_S}}))
    out = tmp_path / "serve_check.json"
    monkeypatch.setenv("PIPELINE_PARAMS", str(params))
    references = run_references_stage(tmp_path, monkeypatch, baseline, golden)
    for name, value in (("MODEL_STORE", store), ("SERVE_DIR", inputs["serve_dir"]), ("GOLDEN_DIR", golden),
                        ("SERVE_CHECK_JSON", out), ("REFERENCES_JSON", references)):
        monkeypatch.setattr(stage, name, value)

    rc = stage.main([])
    rec = json.loads(out.read_text())
    assert rc == 0, rec["failures"]
    assert rec["parity_ok"] and rec["max_abs_error"] <= 1e-4
    assert rec["requests_sent"] == rec["requests_ok"] == 32 and rec["errors_5xx"] == 0
    assert {"wrong_shape", "wrong_dtype", "invalid_json", "empty_body", "over_size_limit"} <= set(rec["bad_inputs"])
    assert all(400 <= s < 500 for s in rec["bad_inputs"].values()), rec["bad_inputs"]
    assert rec["baseline"]["ready"] and rec["baseline"]["requests_ok"] == 32
    assert_ratios_are_the_recorded_quotients(rec)


def run_references_stage(tmp_path, monkeypatch, baseline, golden, handtuned=None):
    """The references stage on the recipes in `baseline` (and `handtuned`), its paths pointed at them;
    the record's path, which serve_check reads."""
    import stages.references as refs_stage
    out = tmp_path / "metrics" / "references.json"
    for name, value in (("BASELINE_DIR", baseline), ("GOLDEN_DIR", golden), ("REFERENCES_JSON", out),
                        ("HANDTUNED_DIR", handtuned or tmp_path / "handtuned"), ("SCRATCH_DIR", tmp_path / "scratch")):
        monkeypatch.setattr(refs_stage, name, value)
    assert refs_stage.main([]) == 0
    return out


def double_recipe(folder, name: str, model_config: dict, properties: str) -> None:
    """The recipe of the double model's .mar (tests/serve/test_torchserve.py) in `folder`."""
    import yaml
    from pipeline.serve.archive import Packing
    from pipeline.serve.reference.reference_archives import write_recipe
    src = folder.parent / f"src-{folder.name}"
    src.mkdir(parents=True)
    (src / "double_handler.py").write_text(DOUBLE_HANDLER)
    (src / "model-config.yaml").write_text(yaml.safe_dump(model_config, sort_keys=False))
    write_recipe(folder, Packing(name, src / "double_handler.py", {}, config_file=src / "model-config.yaml"),
                 config_properties=properties)


def assert_ratios_are_the_recorded_quotients(rec: dict) -> None:
    """serve_check's ratios are the winner's recorded figures over the baseline's, each measured."""
    base = rec["baseline"]
    assert rec["ratios"] == {"load": pytest.approx(rec["ready_s"] / base["ready_s"]),
                             "throughput": pytest.approx(rec["throughput_rps"] / base["throughput_rps"]),
                             "p99": pytest.approx(rec["p99_ms"] / base["p99_ms"])}


def serve_check_inputs(tmp_path, monkeypatch, name: str, store, serve, golden, derivation: dict | None = None):
    """The serve_check stage's inputs around an already built .mar of a tensor model (one golden
    case, no baseline), its module paths pointed at them; returns where the record will be written."""
    import stages.serve_check as stage
    serve.mkdir()
    (serve / "config.properties").write_text("default_workers_per_model=1\n")
    if derivation is not None:
        (serve / "derivation.json").write_text(json.dumps(derivation))
    golden.mkdir()
    (golden / "http_cases.json").write_text(json.dumps(
        [{"id": "c0", "content_type": "application/json", "body": "[1, 2, 3]", "expected": [2, 4, 6]}]))
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({
        "model": {"name": name, "source": "state_dict", "checkpoint": "unused.pt",
                  "factory": "unused.py:build", "task": "tensor", "input_shape": [3]},
        "serve_check": {"requests": 4, "concurrency": 2, "baseline": False, "handtuned": False,
                        "warmup_s": WARMUP_S}}))
    out = tmp_path / "serve_check.json"
    monkeypatch.setenv("PIPELINE_PARAMS", str(params))
    for attr, value in (("MODEL_STORE", store), ("SERVE_DIR", serve), ("GOLDEN_DIR", golden),
                        ("SERVE_CHECK_JSON", out)):
        monkeypatch.setattr(stage, attr, value)
    return out


def _served(ready_s, rps, p99_ms):
    return {"ready": True, "ready_s": ready_s, "load": {"requests_ok": 40, "throughput_rps": rps, "p99_ms": p99_ms,
                                                       "p50_ms": p99_ms / 2}}


def test_a_reference_is_served_again_only_while_its_comparison_is_undecided():
    """bert-large's run: the naive baseline at 1/22 the throughput and 2.2x the READY, the hand-tuned
    at 1/2.6 and 2.7x: both decided after round 1, so no second round is served (no server is even
    started here); READY within 25% of parity keeps a reference in the next round."""
    from pipeline.serve.reference.reference_rounds import interleaved_rounds, undecided
    first = {"winner": _served(3.9, 42.0, 390.0), "handtuned": _served(10.5, 16.8, 1706.0),
             "baseline": _served(8.8, 1.9, 9260.0)}
    setups = interleaved_rounds({name: None for name in first}, [], task="text-embedding", rounds=2, requests=320,
                                concurrency=16, time_cap_s=30, slo_ms=200, first_round=first, decided_band=0.25)
    assert {n: len(s["rounds"]) for n, s in setups.items()} == {"winner": 1, "handtuned": 1, "baseline": 1}
    per = {"winner": [dict(_served(2.9, 300.0, 80.0), ok=True)],
           "handtuned": [dict(_served(3.1, 200.0, 120.0), ok=True)],     # READY 0.94x: undecided
           "baseline": [dict(_served(6.0, 30.0, 900.0), ok=True)]}
    per = {n: [{"ok": True, "ready_s": r["ready_s"], "throughput_rps": r["load"]["throughput_rps"],
                "p99_ms": r["load"]["p99_ms"]} for r in rs] for n, rs in per.items()}
    assert undecided(per, 0.25) == ["handtuned"]
    assert undecided(per, 0.0) == ["handtuned", "baseline"]
    # The bound's ceiling is served for its own figure: its READY near the winner's (XLM-R: 2.38 s
    # against 2.94) opens no round, and no server is started for it.
    first = {"winner": _served(2.94, 70.0, 300.0), "handtuned": _served(15.8, 19.1, 1245.0),
             "ceiling": _served(2.38, 6862.0, 5.2)}
    setups = interleaved_rounds({name: None for name in first}, [], task="text-embedding", rounds=2, requests=320,
                                concurrency=16, time_cap_s=30, slo_ms=200, first_round=first, decided_band=0.25,
                                uncompared=frozenset({"ceiling"}))
    assert {n: len(s["rounds"]) for n, s in setups.items()} == {"winner": 1, "handtuned": 1, "ceiling": 1}
    per["ceiling"] = [{"ok": True, "ready_s": 2.8, "throughput_rps": 6000.0, "p99_ms": 5.0}]
    assert undecided(per, 0.25) == ["handtuned", "ceiling"]
    assert undecided(per, 0.25, uncompared=frozenset({"ceiling"})) == ["handtuned"]


def test_compare_rerank_allows_swaps_within_the_tolerance_only():
    exp = [{"index": 2, "score": 0.90}, {"index": 0, "score": 0.50}, {"index": 1, "score": 0.49},
           {"index": 3, "score": 0.10}]
    assert compare_response(exp, exp, 0.02, 0)[0]
    near_tie = [exp[0], exp[2], exp[1], exp[3]]                       # 0.50 vs 0.49: within 0.02
    assert compare_response(near_tie, exp, 0.02, 0)[0]
    ok, _, msg = compare_response([exp[1], exp[0], exp[2], exp[3]], exp, 0.02, 0)
    assert not ok and "index 0 ranked before index 2" in msg          # 0.90 vs 0.50: a real reorder
    off = [dict(c) for c in exp]
    off[1]["score"] = 0.60
    ok, _, msg = compare_response(off, exp, 0.02, 0)
    assert not ok and "index=0" in msg
    ok, _, msg = compare_response([exp[0], exp[1], exp[2], {"index": 7, "score": 0.1}], exp, 0.02, 0)
    assert not ok and "indices" in msg


def test_warmup_starts_no_window_that_would_end_past_its_cap(monkeypatch):
    """Issue 30: a window lasts until its requests are answered; a 2 GB naive baseline's took ~6 s
    (16 requests queued behind two workers), and three of them 19 s against a 10 s cap. No window is
    started that would end past the cap by the longest so far; the first always runs."""
    import types

    from pipeline.serve import serve_check as sc
    from pipeline.serve.checks.load import LoadResult
    now = [0.0]
    monkeypatch.setattr(sc, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    lengths = iter([6.0, 3.0, 2.5, 5.9, 1.0])
    rates = iter([3.0, 3.8, 1.7, 2.0, 2.0])

    def window(ts, cases, requests, concurrency, time_cap_s, request_timeout_s):
        now[0] += next(lengths)
        return LoadResult(0, 16, 16, 16, 0, 0, 0, 1.0, 2.0, 1.5, next(rates), 1.0, concurrency, True)
    monkeypatch.setattr(sc, "run_load", window)
    no_jvm = types.SimpleNamespace(java_pid=None)          # no compiler figures: judged on the rates
    w = sc._warmup(no_jvm, [], 16, 10.0)
    assert w["windows_rps"] == [3.0] and w["seconds"] == 6.0 and not w["settled"]     # 6 + 6 > 10
    now[0] = 0.0
    lengths, rates = iter([1.0] * 20), iter([50.0, 54.0, 60.0, 61.0, 60.5, 60.0, 61.0])
    w = sc._warmup(no_jvm, [], 16, 10.0)
    assert w["settled"] and w["windows_rps"][-3:] == [60.0, 61.0, 60.5] and w["seconds"] == 5.0


def test_warmup_waits_for_the_jit_compilers_to_go_quiet(monkeypatch):
    """Issue 29: rates can agree while the frontend's C2 compiler still takes a core; the measured load
    starts once the compilers are quiet over the judged windows, within WARMUP_JIT_EXTENSION x the cap."""
    import types

    from pipeline.serve import serve_check as sc
    from pipeline.serve.server import jvm_jit
    from pipeline.serve.checks.load import LoadResult
    now, compiled = [0.0], [0.0]
    monkeypatch.setattr(sc, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(jvm_jit, "compiler_cpu_s", lambda pid: compiled[0])
    monkeypatch.setattr(jvm_jit, "process_cpu_s", lambda pid: None)     # the frontend's own work unknown
    busy = iter([0.5, 0.5, 0.3, 0.2, 0.1, 0.02, 0.01, 0.01] + [0.0] * 50)

    def window(ts, cases, requests, concurrency, time_cap_s, request_timeout_s):
        now[0] += 1.0
        compiled[0] += next(busy)
        return LoadResult(0, 16, 16, 16, 0, 0, 0, 1.0, 2.0, 1.5, 60.0, 1.0, concurrency, True)
    monkeypatch.setattr(sc, "run_load", window)
    jvm = types.SimpleNamespace(java_pid=1234)
    w = sc._warmup(jvm, [], 16, 5.0)
    # Rates agreed from the third window; the compilers first averaged <= 0.1 of a core over windows
    # 5-7 (0.1, 0.02, 0.01).
    assert w["settled"] and w["jit_quiet"] and w["seconds"] == 7.0
    assert w["jit_compiler_cores"][:3] == [0.5, 0.5, 0.3]
    # A compiler that never goes quiet: the warm-up stops at the extended cap, and says so.
    now[0], busy = 0.0, iter([0.5] * 50)
    w = sc._warmup(jvm, [], 16, 5.0)
    assert not w["jit_quiet"] and w["seconds"] == 5.0 * sc.WARMUP_JIT_EXTENSION
    # Quiet compilers: the cap is the cap.
    now[0], busy = 0.0, iter([0.0] * 50)
    rates_never_agree = iter([10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0])
    monkeypatch.setattr(sc, "run_load", lambda *a, **k: (now.__setitem__(0, now[0] + 1.0), compiled.__setitem__(0, compiled[0] + next(busy)),
                        LoadResult(0, 16, 16, 16, 0, 0, 0, 1.0, 2.0, 1.5, next(rates_never_agree), 1.0, 16, True))[2])
    w = sc._warmup(jvm, [], 16, 5.0)
    assert not w["settled"] and w["jit_quiet"] and w["seconds"] == 5.0


def test_warmup_of_a_busy_frontend_waits_for_quieter_compilers(monkeypatch):
    """Issue 29: where the frontend's own request work takes a notable share of the host (a small
    model at hundreds of requests/s), the compilers must be quieter before the measured load, within
    WARMUP_BUSY_JIT_EXTENSION x the cap; where the model dominates, the looser rule stands."""
    import types

    from pipeline.serve import serve_check as sc
    from pipeline.serve.server import jvm_jit
    from pipeline.serve.checks.load import LoadResult
    now, compiled, process = [0.0], [0.0], [0.0]
    monkeypatch.setattr(sc, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(jvm_jit, "compiler_cpu_s", lambda pid: compiled[0])
    monkeypatch.setattr(jvm_jit, "process_cpu_s", lambda pid: process[0])

    def warm(jit_cores, frontend_cores, cap):
        now[0] = compiled[0] = process[0] = 0.0
        jit_it = iter(jit_cores)

        def window(ts, cases, requests, concurrency, time_cap_s, request_timeout_s):
            now[0] += 1.0
            c = next(jit_it, 0.0)
            compiled[0] += c
            process[0] += c + frontend_cores
            return LoadResult(0, 16, 16, 16, 0, 0, 0, 1.0, 2.0, 1.5, 60.0, 1.0, concurrency, True)
        monkeypatch.setattr(sc, "run_load", window)
        return sc._warmup(types.SimpleNamespace(java_pid=1234), [], 16, cap)

    late_bursts = [0.5, 0.3, 0.2, 0.08, 0.06, 0.07, 0.08, 0.06, 0.07, 0.02, 0.01, 0.02]
    # A busy frontend (0.2 of a core): 0.06-0.08 is not quiet; the measured load waits for windows 10-12.
    w = warm(late_bursts, 0.2, 5.0)
    assert w["frontend_busy"] and w["jit_quiet_cores"] == sc.WARMUP_BUSY_JIT_QUIET_CORES
    assert w["settled"] and w["jit_quiet"] and w["seconds"] == 12.0
    assert w["frontend_cores"][-1] == 0.2
    # The same compilers beside a model that dominates (0.01 of a core of frontend work): 0.1 is quiet,
    # reached at window 6 (0.08, 0.06, 0.07).
    w = warm(late_bursts, 0.01, 5.0)
    assert not w["frontend_busy"] and w["jit_quiet_cores"] == sc.WARMUP_JIT_QUIET_CORES
    assert w["jit_quiet"] and w["seconds"] == 6.0
    # A busy frontend whose compilers never go quiet: stopped at the busy rule's extended cap.
    w = warm([0.5] * 100, 0.2, 5.0)
    assert not w["jit_quiet"] and w["seconds"] == 5.0 * sc.WARMUP_BUSY_JIT_EXTENSION


def test_a_measured_load_beside_a_compiler_burst_is_measured_again(monkeypatch):
    """Issue 29: a load during which the JIT compilers took more than the warm-up's quiet share ran
    beside a late burst, not at the steady state: it is measured once more (once), the first one's
    figures kept; a quiet load, or one with errors, stands."""
    import types

    from pipeline.serve import serve_check as sc
    from pipeline.serve.server import jvm_jit
    from pipeline.serve.checks.load import LoadResult
    compiled, bursts, rates, errors = [0.0], iter([]), iter([]), [0]
    monkeypatch.setattr(jvm_jit, "compiler_cpu_s", lambda pid: compiled[0])

    def load(ts, cases, requests, concurrency, time_cap_s, request_timeout_s):
        compiled[0] += next(bursts) * 5.0
        return LoadResult(3000, 3000, 3000, 3000, 0, errors[0], 0, 20.0, 40.0, 25.0, next(rates), 5.0, concurrency, False)
    monkeypatch.setattr(sc, "run_load", load)
    jvm = types.SimpleNamespace(java_pid=1234)
    bursts, rates = iter([0.09, 0.01]), iter([577.5, 614.8])
    measured, jit, discarded = sc._measured_load(jvm, [], 3000, 16, 10.0, 0.03)
    assert measured.throughput_rps == 614.8 and jit == 0.01
    assert discarded == {"throughput_rps": 577.5, "p99_ms": 40.0, "jit_compiler_cores": 0.09, "quiet_cores": 0.03}
    bursts, rates = iter([0.09, 0.09, 0.09]), iter([570.0, 580.0, 590.0])      # measured again once, not more
    measured, jit, discarded = sc._measured_load(jvm, [], 3000, 16, 10.0, 0.03)
    assert measured.throughput_rps == 580.0 and jit == 0.09 and discarded["throughput_rps"] == 570.0
    bursts, rates = iter([0.02]), iter([600.0])                                 # quiet: it stands
    assert sc._measured_load(jvm, [], 3000, 16, 10.0, 0.03)[1:] == (0.02, None)
    bursts, rates = iter([0.09]), iter([600.0])                                 # the looser rule: quiet
    assert sc._measured_load(jvm, [], 3000, 16, 10.0, 0.1)[2] is None
    errors[0], bursts, rates = 1, iter([0.09]), iter([600.0])                  # a failing load is reported as is
    assert sc._measured_load(jvm, [], 3000, 16, 10.0, 0.03)[2] is None
    monkeypatch.setattr(jvm_jit, "compiler_cpu_s", lambda pid: None)           # no JVM figures: it stands
    errors[0], bursts, rates = 0, iter([0.09]), iter([600.0])
    assert sc._measured_load(types.SimpleNamespace(java_pid=None), [], 3000, 16, 10.0, 0.03)[1:] == (None, None)


def test_compiler_cpu_is_none_without_a_jvm_and_zero_without_compiler_threads():
    import os
    import subprocess
    import sys

    from pipeline.serve.server.jvm_jit import compiler_cpu_s
    assert compiler_cpu_s(None) is None
    assert compiler_cpu_s(os.getpid()) == 0.0                 # a Python process: no HotSpot compilers
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert compiler_cpu_s(gone.pid) is None


def test_process_cpu_counts_a_busy_process_and_is_none_when_it_is_gone():
    import subprocess
    import sys
    import time

    from pipeline.serve.server.jvm_jit import process_cpu_s
    assert process_cpu_s(None) is None
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.5: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while (process_cpu_s(busy.pid) or 0.0) < 0.4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 0.4 <= process_cpu_s(busy.pid) < 5.0          # its half-second of spinning, from /proc
    finally:
        busy.kill()
        busy.wait()
    assert process_cpu_s(busy.pid) is None
