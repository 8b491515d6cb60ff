"""The report's sections about the decision and the variants, and what the pipeline produced.

Each function returns the blocks of one section of the page (pipeline/publish/report_render.py),
from the report's inputs and, for the decision, from the summary already decided
(pipeline/publish/report_summary.py): a section words figures, it decides none. A section whose
input is absent says which file is missing and which stage writes it.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.publish.report_inputs import (ReportInputs, model_bytes, phase_medians, serving_batch_rows, steady_points,
                                            winner)
from pipeline.publish.report_plots import PLOTS
from pipeline.publish.report_render import Block, Code, Heading, Image, Para, Table, fmt, fmt_bytes


def decision_blocks(inputs: ReportInputs, summary: dict) -> list[Block]:
    """The winner, the SLO verdict (summary's) and the figures it is served with."""
    sel = inputs.selection
    b: list[Block] = [Heading("Decision")]
    if sel is None:
        return b + [Para("**No decision yet**: `artifacts/selection.json` is missing (run `dvc repro select`).")]
    slo = ("met" if summary.get("slo_met") else "**NOT met**") + (
        " in TorchServe under the expected load" if summary.get("slo_basis") == "served" else " (offline prediction)")
    b.append(Para(f"Winner: **{winner(inputs)}** (objective: {sel.get('objective', '–')}; "
                  f"latency SLO {inputs.latency_slo_ms:g} ms p99: {slo})."))
    if sel.get("message"):
        b.append(Para(str(sel["message"])))
    rows = summary.get("batch_rows")
    multi = rows is not None and rows != summary["batch_size"]
    b.append(Table(["serving figure", "value"], [
        ["batch size" + (" (requests, TorchServe's batchSize)" if multi else ""), summary["batch_size"]],
        *([["rows per model call (handler.batch_rows)", rows]] if multi else []),
        ["max batch delay (ms)", summary["max_batch_delay_ms"]],
        ["workers", summary["workers"]], ["p99 at that batch, benchmark (ms)", summary["p99_ms"]],
        ["throughput at that batch, benchmark (samples/s)", summary["throughput_sps"]],
        ["cold load, median total (ms)", summary["cold_load_ms"]]]))
    return b


def variants_blocks(inputs: ReportInputs) -> list[Block]:
    """One row per variant in params: conversion, benchmark and selection status, its best batch, why."""
    rows = []
    sel_variants = (inputs.selection or {}).get("variants") or {}
    for v in inputs.variants:
        conv = inputs.conversions.get(v) or {}
        bench = inputs.benchmarks.get(v) or {}
        s = sel_variants.get(v) or {}
        thr = dict(steady_points(bench, "throughput_sps"))
        best_bs = max(thr, key=thr.get) if thr else None
        p99 = dict(steady_points(bench, "p99_ms")).get(best_bs) if best_bs else None
        reasons = list(s.get("reasons") or [])
        if not reasons:
            for src in (conv, bench):
                if src.get("reason") and src.get("status") not in ("converted", "ok"):
                    reasons.append(str(src["reason"]))
        rows.append([v, conv.get("status", "not converted"), bench.get("status", "not benchmarked"),
                     s.get("status", "–"), best_bs, p99, thr.get(best_bs) if best_bs else None,
                     phase_medians(bench).get("total"), fmt_bytes(conv.get("artifact_bytes", bench.get("artifact_bytes"))),
                     "; ".join(reasons) or "–"])
    return [Heading("Variants"),
            Para("Every variant listed in params, with its verification, its measurements and why it "
                 "won or lost. p99 and throughput are taken at the variant's best-throughput batch."),
            Table(["variant", "conversion", "benchmark", "selection", "best batch", "p99 (ms)",
                   "throughput (samples/s)", "cold load (ms)", "size", "reasons"], rows)]


def verification_blocks(inputs: ReportInputs) -> list[Block]:
    """Each converted variant's outputs against the eager fp32 reference, with its tolerance."""
    vrows = []
    for v in inputs.variants:
        conv = inputs.conversions.get(v)
        if not conv:
            continue
        tol = conv.get("tolerance") or {}
        for o in ((conv.get("verification") or {}).get("outputs") or []):
            vrows.append([v, o.get("name"), o.get("max_abs"), o.get("max_rel"), o.get("min_cosine"),
                          o.get("topk_agreement"), f"atol {fmt(tol.get('atol'))}, rtol {fmt(tol.get('rtol'))}, "
                          f"cos ≥ {fmt(tol.get('min_cosine'))}"])
    b: list[Block] = [Heading("Verification against the eager fp32 reference")]
    if vrows:
        b.append(Table(["variant", "output", "max abs", "max rel", "min cosine", "top-k agreement", "tolerance"], vrows))
    else:
        b.append(Para("No verification records (`artifacts/variants/<v>/conversion.json`) found."))
    return b


def _gate_text(f: dict) -> str:
    if f.get("kind") == "text-embedding":
        return (f"min cosine {fmt(f.get('min_cosine'))}, mean {fmt(f.get('mean_cosine'))}, "
                f"recall@{f.get('k')} {fmt(f.get('recall_at_k'))}")
    return f"top-1 agreement {fmt(f.get('top1_agreement'))}, top-{f.get('k')} overlap {fmt(f.get('topk_overlap'))}"


def accuracy_trade_blocks(inputs: ReportInputs) -> list[Block]:
    """Variants judged by a task gate (int8): their accuracy figures on the golden set beside their
    throughput against the fp32 `onnx` variant (else `eager`) at the served batch size (else the
    largest both measured), so the trade is visible."""
    base = "onnx" if (inputs.benchmarks.get("onnx") or {}).get("steady") else "eager"
    ref = dict(steady_points(inputs.benchmarks.get(base) or {}, "throughput_sps"))
    rows = []
    for v in inputs.variants:
        conv = inputs.conversions.get(v) or {}
        gate = (conv.get("verification") or {}).get("task_gate")
        if not gate:
            continue
        q = conv.get("quantization") or {}
        thr = dict(steady_points(inputs.benchmarks.get(v) or {}, "throughput_sps"))
        common = sorted(set(thr) & set(ref))
        bs = serving_batch_rows(inputs) if serving_batch_rows(inputs) in common else (common[-1] if common else None)
        ratio = thr[bs] / ref[bs] if bs is not None and ref.get(bs) else None
        kept = q.get("fp32_ops")
        for name, f in gate.items():
            rows.append([v, name, conv.get("status"), _gate_text(f),
                         f"{len(kept)} of {q.get('quantizable_ops')}" if kept is not None else "–",
                         bs, thr.get(bs) if bs else None, ref.get(bs) if bs else None, ratio])
    if not rows:
        return []
    return [Heading("Accuracy against speed (task-gated variants)", 3),
            Para(f"Accuracy on the golden set (conversion.json `verification.task_gate`) beside throughput "
                 f"relative to `{base}` (fp32) at the same batch size. Ops kept fp32 = the sensitivity "
                 f"fallback's choice."),
            Table(["variant", "output", "conversion", "accuracy", "ops kept fp32", "batch",
                   "throughput (samples/s)", f"{base} (samples/s)", f"× {base}"], rows)]


def plot_blocks(images: dict[str, Path]) -> list[Block]:
    """The plots drawn (report_plots.PLOTS order), each under its title."""
    b: list[Block] = [Heading("Plots")]
    for key, title, _ in PLOTS:
        if key in images:
            b.append(Heading(title, 3))
            b.append(Image(images[key], title))
    if not images:
        b.append(Para("No plots: no benchmark or serve-check results found."))
    return b


def serve_check_blocks(inputs: ReportInputs) -> list[Block]:
    """The archived winner in TorchServe against the naive baseline: figures, parity, bad inputs."""
    b: list[Block] = [Heading("Serve check in TorchServe")]
    sc = inputs.serve_check
    if not sc:
        return b + [Para("**Serve check not run**: `metrics/serve_check.json` is missing (run `dvc repro serve_check`; "
                         "it needs Java 17 and TorchServe). The figures above come from the benchmark only.")]
    base = sc.get("baseline") or {}
    ratios = sc.get("ratios") or {}
    keys = ["ready_s", "worker_load_ms", "first_request_ms", "requests_sent", "requests_ok", "errors_5xx",
            "p50_ms", "p99_ms", "throughput_rps", "batch_sizes_seen"]
    b.append(Table(["figure", f"winner ({winner(inputs)})", "baseline"], [[k, sc.get(k), base.get(k)] for k in keys]))
    emb = sc.get("parity_embedding") or {}
    emb_text = (f"; embeddings: lowest cosine {fmt(emb.get('min_cosine'))}, largest |norm − 1| "
                f"{fmt(emb.get('max_norm_error'))}" + (" (the model's own are unit)" if emb.get("unit_reference") else "")
                if emb else "")
    b.append(Para(f"Parity over HTTP with the reference outputs: **{fmt(sc.get('parity_ok'))}** "
                  f"(max abs error {fmt(sc.get('max_abs_error'))}{emb_text}). Ratios winner / baseline: "
                  f"cold load {fmt(ratios.get('load'))}, throughput {fmt(ratios.get('throughput'))}, "
                  f"p99 {fmt(ratios.get('p99'))}."))
    bad = sc.get("bad_inputs")
    if isinstance(bad, list) and bad:
        b.append(Table(["bad input", "status"], [[c.get("case", c.get("id", c.get("name"))), c.get("status")]
                                                for c in bad if isinstance(c, dict)]))
    elif isinstance(bad, dict) and bad:
        b.append(Table(["bad input", "status"], [[k, v] for k, v in bad.items()]))
    return b


def stage_cost_blocks(inputs: ReportInputs) -> list[Block]:
    """Wall time and peak memory of every stage run recorded in metrics/stages."""
    if not inputs.stages:
        return []
    size = model_bytes(inputs)
    rows = []
    for r in inputs.stages:
        peak = r.get("peak_rss_mb") or {}
        top = max((v for v in (peak.get("stage"), peak.get("children")) if isinstance(v, (int, float))), default=None)
        copies = f"{top * 2**20 / size:.1f}" if top is not None and size else "–"
        rows.append([r.get("stage") + (f"@{r['item']}" if r.get("item") else ""), r.get("wall_s"),
                     peak.get("stage"), peak.get("children"), copies, r.get("exit_code"), r.get("started_at")])
    total = sum(r.get("wall_s") or 0.0 for r in inputs.stages)
    return [Heading("Pipeline cost per stage"),
            Para(f"Wall time and peak resident memory of each stage's last run ({total:.0f} s together; the "
                 f"report and kserve stages record theirs after this page is written). `copies`: the larger "
                 f"peak over the model's size ({fmt_bytes(size)})."),
            Table(["stage", "wall (s)", "peak RSS stage (MB)", "peak RSS children (MB)", "copies of the model",
                   "exit", "started"], rows)]


def configuration_blocks(inputs: ReportInputs) -> list[Block]:
    """The generated serving configuration: each value with its formula and inputs, then the files."""
    b: list[Block] = [Heading("Generated configuration and how each value was derived")]
    if inputs.derivation:
        drows = []
        for key, d in inputs.derivation.items():
            if isinstance(d, dict):
                drows.append([key, d.get("value"), d.get("formula", "–"), d.get("inputs"),
                              d.get("overridden", False)])
            else:
                drows.append([key, d, "–", "–", "–"])
        b.append(Table(["setting", "value", "formula", "inputs", "overridden in params"], drows))
    else:
        b.append(Para("`artifacts/serve/derivation.json` is missing (run `dvc repro configure`)."))
    if inputs.model_config is not None:
        b.append(Para("`model-config.yaml` (packed in the .mar; its timeouts win over every other setting):"))
        b.append(Code(yaml.safe_dump(inputs.model_config, sort_keys=False), "yaml"))
    if inputs.config_properties:
        b.append(Para("`artifacts/serve/config.properties`:"))
        b.append(Code(inputs.config_properties, "properties"))
    return b


def start_command_blocks(inputs: ReportInputs) -> list[Block]:
    """How to start the server, and the archive it serves."""
    b: list[Block] = [Heading("Start command")]
    if inputs.start_command:
        b.append(Code(inputs.start_command, "bash"))
        b.append(Para("Token authorization is on: TorchServe writes `key_file.json` into its working directory; "
                      "send `Authorization: Bearer <inference key>` with every request."))
    else:
        b.append(Para("`artifacts/serve/start_command.txt` is missing (run `dvc repro configure`)."))
    if inputs.mar:
        b.append(Para(f"Archive `{inputs.mar['path']}`: {fmt_bytes(inputs.mar['bytes'])}, "
                      f"sha256 `{inputs.mar['sha256']}`."))
    return b


def environment_blocks(inputs: ReportInputs) -> list[Block]:
    """The host the figures were measured on (artifacts/env.json)."""
    env = inputs.env
    if not env:
        return [Heading("Environment"), Para("`artifacts/env.json` is missing (run `dvc repro probe`).")]
    cpu = env.get("cpu") or {}
    isa = cpu.get("isa") or {}
    gpu = env.get("gpu")
    erows = [["device", env.get("device")], ["CPU", cpu.get("model")],
             ["cores (physical / logical)", f"{fmt(cpu.get('physical_cores'))} / {fmt(cpu.get('logical_cores'))}"],
             ["ISA", ", ".join(k for k, v in isa.items() if v) or "–"],
             *([["ISA listed but off in the OS", ", ".join(cpu["isa_disabled_by_os"])]]
               if cpu.get("isa_disabled_by_os") else []),
             ["memory (MB)", env.get("memory_mb")],
             ["GPU", "none" if not gpu else f"{gpu.get('name')} ({fmt(gpu.get('memory_mb'))} MB, "
                                            f"driver {fmt(gpu.get('driver'))}, CUDA {fmt(gpu.get('cuda'))})"],
             ["disk read (MB/s)", env.get("disk_read_mb_s")]]
    erows += [[f"version: {k}", v] for k, v in (env.get("versions") or {}).items()]
    return [Heading("Environment"), Table(["", ""], erows)]


def missing_blocks(inputs: ReportInputs) -> list[Block]:
    """The inputs that were absent, named, so a partial page says why it is partial."""
    if not inputs.missing:
        return []
    return [Heading("Inputs not found"),
            Para("These outputs of earlier stages were absent when the report was written: "
                 + ", ".join(f"`{m}`" for m in inputs.missing) + ".")]
