"""The report's decision as plain data: metrics/summary.json, and the SLO verdict the page states.

`summary_metrics` is computed once per report: it is written as metrics/summary.json (the handful
of figures `dvc exp show` / `dvc metrics diff` compare between experiments: winner, p99,
throughput, cold load, serve-check figures) and handed to the page, which only words it. The SLO
verdict (`served_verdict`) is the tune stage's served one when it ran, overturned when the serve
check measured the archived winner missing the SLO at the same load; otherwise selection's offline
prediction.
"""
from __future__ import annotations

from typing import Any, Optional

from pipeline.publish.report_inputs import (ReportInputs, phase_medians, serving_batch_rows, serving_batch_size,
                                            steady_points, winner)


def summary_metrics(inputs: ReportInputs) -> dict:
    """Flat figures for `dvc exp show` / `dvc metrics diff`: one row per experiment tells the story."""
    w = winner(inputs)
    sel = inputs.selection or {}
    mc = inputs.model_config or {}
    out: dict[str, Any] = {"winner": w, "objective": sel.get("objective"), "slo_met": sel.get("slo_met"),
                           "latency_slo_ms": inputs.latency_slo_ms}
    out["batch_size"] = serving_batch_size(inputs)          # TorchServe's batchSize: requests
    bs = serving_batch_rows(inputs)                         # rows per model call: the benchmark's batch
    out["batch_rows"] = bs
    out["max_batch_delay_ms"] = mc.get("maxBatchDelay")
    out["workers"] = mc.get("maxWorkers", mc.get("minWorkers"))
    bench = inputs.benchmarks.get(w) if w else None
    p99 = thr = None
    if bench:
        p99s, thrs = dict(steady_points(bench, "p99_ms")), dict(steady_points(bench, "throughput_sps"))
        if bs is None and thrs:
            bs = max(thrs, key=thrs.get)  # no config yet: the winner's best measured batch
        p99, thr = p99s.get(bs), thrs.get(bs)
        out["cold_load_ms"] = phase_medians(bench).get("total")
    else:
        out["cold_load_ms"] = None
    out["p99_ms"] = p99
    out["throughput_sps"] = thr
    sc = inputs.serve_check
    out["serve_check"] = _serve_check_figures(sc)
    out.update(served_verdict(inputs))
    if inputs.stages:
        out["pipeline_wall_s"] = round(sum(r.get("wall_s") or 0.0 for r in inputs.stages), 1)
    if sc:
        out["serve_check"]["ratio_ready_floor"] = (sc.get("ready_vs_floor") or {}).get("ratio")
    return out


def _serve_check_figures(sc: Optional[dict]) -> dict:
    """The serve check's headline figures (its ratio_ready_floor is appended last, after the verdict)."""
    if not sc:
        return {"ran": False}
    ratios = sc.get("ratios") or {}
    return {"parity_ok": sc.get("parity_ok"), "ready_s": sc.get("ready_s"),
            "p99_ms": sc.get("p99_ms"), "throughput_rps": sc.get("throughput_rps"),
            "errors_5xx": sc.get("errors_5xx"),
            "ratio_load": ratios.get("load"), "ratio_throughput": ratios.get("throughput"),
            "ratio_p99": ratios.get("p99"), **_rerank_figures(sc.get("rerank_load"))}


def _rerank_figures(rl: Optional[dict]) -> dict:
    """Task rerank: the rerank load's rows/s, the model's offline rows/s at its batches, their ratio."""
    if not rl:
        return {}
    return {"rerank_rows_per_s": rl.get("served_rows_per_s"), "rerank_offline_rows_per_s": rl.get("offline_rows_per_s"),
            "rerank_vs_offline": rl.get("served_vs_offline")}


def served_verdict(inputs: ReportInputs) -> dict:
    """summary.json's SLO verdict: the tune stage's served one (selection's offline prediction kept
    beside it), plus the served figures and the ratios to the hand-tuned reference."""
    t = inputs.tuning or {}
    sel = inputs.selection or {}
    out: dict[str, Any] = {"slo_met_predicted": sel.get("slo_met")}
    if t and t.get("enabled", True) and "served_p99_ms" in t:
        out.update(slo_met=t.get("slo_met"), slo_basis="served", served_p99_ms=t.get("served_p99_ms"),
                   served_throughput_rps=t.get("served_throughput_rps"), replicas=t.get("replicas"),
                   tuning_s=t.get("duration_s"), tuned_replaced_offline=t.get("replaced_offline"))
    else:
        out["slo_basis"] = "predicted"
    refs = (inputs.serve_check or {}).get("references") or {}
    confirm = _serve_check_confirmation(t, refs)
    if confirm is not None:
        out["serve_check_confirms_slo"] = confirm["within_slo"]
        if out.get("slo_met") and not confirm["within_slo"]:
            # A verdict must hold in the server the model ships in: serve_check's interleaved rounds
            # at the same load measured the archived model missing the SLO, so it is not met.
            out.update(slo_met=False, slo_basis="served (serve_check)", served_p99_ms=confirm["p99_ms"])
    rh = refs.get("ratios_handtuned") or {}
    if rh:
        out["vs_handtuned"] = {"throughput": rh.get("throughput"), "throughput_within_slo": rh.get("throughput_within_slo"),
                               "p99": rh.get("p99"), "ready": rh.get("ready"), "rounds": refs.get("rounds")}
    return out


def _serve_check_confirmation(tuning: dict, refs: dict) -> Optional[dict]:
    """serve_check's median p99 of the archived winner, when it was measured at the load the tune
    stage certified (same requests in flight); None when it was not."""
    winner = (refs.get("setups") or {}).get("winner") or {}
    expected = tuning.get("expected_concurrency")
    if winner.get("p99_ms") is None or expected is None or refs.get("concurrency") != expected:
        return None
    return {"within_slo": bool(winner.get("within_slo")), "p99_ms": winner.get("p99_ms")}
