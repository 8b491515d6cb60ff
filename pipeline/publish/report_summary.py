"""The report's decision as plain data: metrics/summary.json, and the SLO verdict the page states.

`summary_metrics` is computed once per report: it is written as metrics/summary.json (the figures
`dvc exp show` / `dvc metrics diff` compare between experiments) and handed to the page, which only
words it (pipeline/publish/report_decision.py). Its top level is the decision as served:

- `winner`, `deploy` (the .mar's repo-relative path, size, sha256, store form);
- the served figures of the archived winner in TorchServe, from the serve check: `throughput_rps`,
  `p50_ms`, `p99_ms`, `ready_s`, with `served_source` (which measurement) and `load` (the concurrent
  clients it was measured with, the expected concurrency, whether they agree);
- `slo_met` / `slo_basis` / `latency_slo_ms` / `objective`;
- `config`: batch size, rows per call, delay, workers, threads per worker, startup and response timeouts;
- `runner_up`: the next variant and why it lost.

Offline figures (the benchmark's p99 and samples/s at the served batch, its cold load, selection's
predicted verdict) are under `offline`; the tune stage's own served figures under `tuning`; the serve
check's other figures (parity, ratios to the baseline) under `serve_check`.

The SLO verdict (`served_verdict`) is the tune stage's served one when it ran, overturned when the
serve check measured the archived winner missing the SLO at the same load; the serve check's alone
when the tune stage did not run; otherwise selection's offline prediction.
"""
from __future__ import annotations

from typing import Any, Optional

from pipeline.publish.report_inputs import (ReportInputs, as_number, expected_concurrency, phase_medians,
                                            serve_check_load, serving_config, steady_points, tuning_record, winner)


def summary_metrics(inputs: ReportInputs) -> dict:
    """The decision as served at the top; offline, tuning and serve-check details under their own keys."""
    w = winner(inputs)
    sel = inputs.selection or {}
    out: dict[str, Any] = {"winner": w, "objective": sel.get("objective"), "latency_slo_ms": inputs.latency_slo_ms,
                           "deploy": deploy_artifact(inputs)}
    out.update(served_figures(inputs))
    out["load"] = load_figures(inputs)
    out.update(served_verdict(inputs))
    out["config"] = serving_config(inputs)
    out["runner_up"] = runner_up(inputs)
    out["offline"] = offline_figures(inputs, out["config"])
    out["serve_check"] = _serve_check_figures(inputs.serve_check)
    if inputs.stages:
        out["pipeline_wall_s"] = round(sum(r.get("wall_s") or 0.0 for r in inputs.stages), 1)
    return out


def deploy_artifact(inputs: ReportInputs) -> dict:
    """What to deploy: the archive stage's .mar, by its path relative to the repo root."""
    path = f"artifacts/model_store/{inputs.model_name}.mar"
    form = (inputs.derivation or {}).get("store_form")
    form = form.get("value") if isinstance(form, dict) else (inputs.serve_check or {}).get("store_form")
    mar = inputs.mar or {}
    return {"artifact": mar.get("path", path), "present": bool(mar), "bytes": mar.get("bytes"),
            "sha256": mar.get("sha256"), "model_version": mar.get("model_version"), "store_form": form}


def served_figures(inputs: ReportInputs) -> dict:
    """The archived winner in TorchServe, from the serve check: the medians of its interleaved rounds
    (references.setups.winner) when it ran them, else its single load; None without a serve check."""
    sc = inputs.serve_check or {}
    setup = ((sc.get("references") or {}).get("setups") or {}).get("winner") or {}
    if setup.get("throughput_rps") is not None:
        rounds = len(setup.get("rounds") or [])
        src = (f"median of {rounds} interleaved rounds against the references" if rounds > 1
               else "one load, beside the server's ceilings")
        fig = setup
    elif sc.get("throughput_rps") is not None:
        src, fig = "one load", sc
    else:
        return {"throughput_rps": None, "p50_ms": None, "p99_ms": None, "ready_s": None, "served_source": None}
    return {"throughput_rps": fig.get("throughput_rps"), "p50_ms": fig.get("p50_ms"), "p99_ms": fig.get("p99_ms"),
            "ready_s": fig.get("ready_s", sc.get("ready_s")), "served_source": src}


def load_figures(inputs: ReportInputs) -> dict:
    """The load the served figures were measured under: concurrent clients as the serve check's record
    names them (None: it does not say), against serve.expected_concurrency as recorded by tune/select."""
    measured, expected = serve_check_load(inputs), expected_concurrency(inputs)
    return {"concurrency": measured, "expected_concurrency": expected,
            "is_expected": None if measured is None or expected is None else measured == expected}


def offline_figures(inputs: ReportInputs, config: dict) -> dict:
    """The benchmark's figures for the served variant at the served rows per call (else its best batch):
    p99 per model call, samples/s, cold load; and selection's predicted SLO verdict."""
    bench = inputs.benchmarks.get(winner(inputs) or "")
    bs = config.get("batch_rows")
    p99 = thr = cold = None
    if bench:
        p99s, thrs = dict(steady_points(bench, "p99_ms")), dict(steady_points(bench, "throughput_sps"))
        if bs is None and thrs:
            bs = max(thrs, key=thrs.get)  # no config yet: the winner's best measured batch
        p99, thr = p99s.get(bs), thrs.get(bs)
        cold = phase_medians(bench).get("total")
    return {"batch_rows": bs, "p99_ms": p99, "throughput_sps": thr, "cold_load_ms": cold,
            "slo_met_predicted": (inputs.selection or {}).get("slo_met")}


def runner_up(inputs: ReportInputs) -> Optional[dict]:
    """The best variant selection did not choose among those it could have served (status eligible),
    by the objective's figure, and why it lost: its figure against the winner's at their points."""
    sel = inputs.selection or {}
    w = winner(inputs)
    variants = sel.get("variants") or {}
    mine = (variants.get(w) or {}).get("figures") or {}
    latency = sel.get("objective") == "latency"
    key = "request_p99_ms" if latency else "throughput_sps"
    rivals = [(v, s.get("figures") or {}) for v, s in variants.items()
              if v != w and s.get("status") == "eligible" and as_number((s.get("figures") or {}).get(key)) is not None]
    if not rivals:
        return None
    v, fig = (min if latency else max)(rivals, key=lambda r: r[1][key])
    out = {"variant": v, "figure": key, "value": fig.get(key), "winner_value": mine.get(key),
           "batch_size": fig.get("batch_size"), "basis": "offline benchmark (selection)"}
    ours = as_number(mine.get(key))
    if ours:
        out["relative"] = round(fig[key] / ours - 1, 4)
    return out


def _serve_check_figures(sc: Optional[dict]) -> dict:
    """The serve check's other figures: parity over HTTP, 5xx, the ratios to the naive baseline."""
    if not sc:
        return {"ran": False}
    ratios = sc.get("ratios") or {}
    return {"ran": True, "parity_ok": sc.get("parity_ok"), "errors_5xx": sc.get("errors_5xx"),
            "ratio_load": ratios.get("load"), "ratio_throughput": ratios.get("throughput"),
            "ratio_p99": ratios.get("p99"), **_rerank_figures(sc.get("rerank_load")),
            "ratio_ready_floor": (sc.get("ready_vs_floor") or {}).get("ratio")}


def _rerank_figures(rl: Optional[dict]) -> dict:
    """Task rerank: the rerank load's rows/s, the model's offline rows/s at its batches, their ratio."""
    if not rl:
        return {}
    return {"rerank_rows_per_s": rl.get("served_rows_per_s"), "rerank_offline_rows_per_s": rl.get("offline_rows_per_s"),
            "rerank_vs_offline": rl.get("served_vs_offline")}


def served_verdict(inputs: ReportInputs) -> dict:
    """summary.json's SLO verdict (`slo_met`, `slo_basis`): the tune stage's served one, overturned by
    the serve check measuring the archived winner missing it at the same load; the serve check's alone
    without a tune stage; else selection's offline prediction. The tune stage's own served figures go
    under `tuning`, the ratios to the hand-tuned reference under `vs_handtuned`."""
    t = tuning_record(inputs)
    sel = inputs.selection or {}
    out: dict[str, Any] = {"slo_met": sel.get("slo_met"), "slo_basis": "predicted"}
    tuned = bool(t) and t.get("enabled", True) and "served_p99_ms" in t
    if tuned:
        out.update(slo_met=t.get("slo_met"), slo_basis="served")
        out["tuning"] = {"slo_met": t.get("slo_met"), "served_p99_ms": t.get("served_p99_ms"),
                         "served_throughput_rps": t.get("served_throughput_rps"), "replicas": t.get("replicas"),
                         "tuning_s": t.get("duration_s"), "replaced_offline": t.get("replaced_offline"),
                         "expected_concurrency": expected_concurrency(inputs)}
    refs = (inputs.serve_check or {}).get("references") or {}
    confirm = _serve_check_confirmation(inputs, refs)
    if confirm is not None:
        out["serve_check_confirms_slo"] = confirm["within_slo"]
        if not tuned or (out.get("slo_met") and not confirm["within_slo"]):
            # A verdict must hold in the server the model ships in: serve_check's interleaved rounds
            # at the same load measured the archived model missing the SLO, so it is not met.
            out.update(slo_met=confirm["within_slo"], slo_basis="served (serve_check)")
    rh = refs.get("ratios_handtuned") or {}
    if rh:
        out["vs_handtuned"] = {"throughput": rh.get("throughput"), "throughput_within_slo": rh.get("throughput_within_slo"),
                               "p99": rh.get("p99"), "ready": rh.get("ready"), "rounds": refs.get("rounds")}
    return out


def _serve_check_confirmation(inputs: ReportInputs, refs: dict) -> Optional[dict]:
    """serve_check's median p99 of the archived winner, when it was measured at the expected load
    (the concurrency the tune stage certified, else selection's); None when it was not."""
    winner_setup = (refs.get("setups") or {}).get("winner") or {}
    expected = expected_concurrency(inputs)
    if winner_setup.get("p99_ms") is None or expected is None or refs.get("concurrency") != expected:
        return None
    return {"within_slo": bool(winner_setup.get("within_slo")), "p99_ms": winner_setup.get("p99_ms")}
