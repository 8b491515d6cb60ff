"""The report's sections after the decision: the offline figures and the variants, and what the pipeline produced.

Each function returns the blocks of one section of the page (pipeline/publish/report_render.py),
from the report's inputs and, for the offline figures, from the summary already decided
(pipeline/publish/report_summary.py): a section words figures, it decides none. The decision itself,
the page's first screen, is pipeline/publish/report_decision.py's. A section whose
input is absent says which file is missing and which stage writes it.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.publish.report_inputs import (ReportInputs, model_bytes, phase_medians, serving_batch_rows, steady_points,
                                            winner)
from pipeline.publish.report_plots import PLOTS
from pipeline.publish.report_render import (Block, Code, Heading, Image, Para, Table, batches_text, fmt, fmt_bytes,
                                            plain)


def offline_blocks(inputs: ReportInputs, summary: dict) -> list[Block]:
    """The served variant's offline figures (the benchmark's, at the served rows per call) and
    selection's offline reasoning; the decision itself is the first screen (report_decision.py)."""
    sel = inputs.selection
    off = summary.get("offline") or {}
    b: list[Block] = [Heading("Offline figures of the served variant (benchmark)")]
    if sel is None:
        return b + [Para("`artifacts/selection.json` is missing (run `dvc repro select`).")]
    predicted = off.get("slo_met_predicted")
    b.append(Para(f"Selection's offline choice (objective: {sel.get('objective', '–')}; predicted latency SLO "
                  f"{inputs.latency_slo_ms:g} ms p99: {'met' if predicted else 'NOT met' if predicted is False else '–'}): "
                  f"{sel.get('message') or '–'}. These are the benchmark's figures, one process, synthetic feeds: "
                  f"the served ones are in the decision above."))
    b.append(Table(["offline figure (benchmark)", "value"], [
        ["rows per model call", _with_unit(off.get("batch_rows"), "rows")],
        ["p99 per model call at that batch", _with_unit(off.get("p99_ms"), "ms")],
        ["throughput at that batch, one process", _with_unit(off.get("throughput_sps"), "samples/s")],
        ["cold load, median total", _with_unit(off.get("cold_load_ms"), "ms")]]))
    return b


def _with_unit(v, unit: str) -> str:
    return "–" if v is None else f"{fmt(v)} {unit}"


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
    return [Heading("Variants (offline benchmark)"),
            Para("Every variant listed in params, with its verification, its offline measurements and why it "
                 "won or lost. p99 and throughput are the benchmark's, at the variant's best-throughput batch."),
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
    return [Heading("Accuracy against speed (task-gated variants, offline)", 3),
            Para(f"Accuracy on the golden set (conversion.json `verification.task_gate`) beside throughput "
                 f"relative to `{base}` (fp32) at the same batch size. Ops kept fp32 = the sensitivity "
                 f"fallback's choice."),
            Table(["variant", "output", "conversion", "accuracy", "ops kept fp32", "batch",
                   "throughput (samples/s)", f"{base} (samples/s)", f"× {base}"], rows)]


def plot_blocks(images: dict[str, Path]) -> list[Block]:
    """The plots drawn (report_plots.PLOTS order), each under its title."""
    b: list[Block] = [Heading("Plots (offline benchmark; the last one served)")]
    for key, title, _ in PLOTS:
        if key in images:
            b.append(Heading(title, 3))
            b.append(Image(images[key], title))
    if not images:
        b.append(Para("No plots: no benchmark or serve-check results found."))
    return b


SERVE_CHECK_ROWS = (("READY (s)", "ready_s", fmt), ("WorkerLoadTime (ms)", "worker_load_ms", fmt),
                    ("first request (ms)", "first_request_ms", fmt), ("requests sent", "requests_sent", fmt),
                    ("requests answered 2xx", "requests_ok", fmt), ("5xx answers", "errors_5xx", fmt),
                    ("p50 (ms)", "p50_ms", fmt), ("p99 (ms)", "p99_ms", fmt),
                    ("throughput (req/s)", "throughput_rps", fmt),
                    ("batches formed (count of size)", "batch_sizes_seen", batches_text))


def serve_check_blocks(inputs: ReportInputs) -> list[Block]:
    """The archived winner in TorchServe against the naive baseline: figures, parity, bad inputs."""
    b: list[Block] = [Heading("Serve check in TorchServe (served)")]
    sc = inputs.serve_check
    if not sc:
        return b + [Para("**Serve check not run**: `metrics/serve_check.json` is missing (run `dvc repro serve_check`; "
                         "it needs Java 17 and TorchServe). The figures below come from the benchmark only.")]
    base = sc.get("baseline") or {}
    ratios = sc.get("ratios") or {}
    b.append(Para("The first load of each (the baseline's from the references stage; the decision above gives the "
                  "served figures)."))
    b.append(Table(["figure", f"winner ({winner(inputs)})", "baseline"],
                   [[label, conv(sc.get(k)), conv(base.get(k))] for label, k, conv in SERVE_CHECK_ROWS]))
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


def derivation_inputs_text(inputs) -> str:
    """A derivation's inputs in words: its own figures; the offline value it started from; the served
    choice by name (its candidates are the Served operating point section's); curves and steps counted."""
    if not isinstance(inputs, dict):
        return fmt(inputs)
    parts = []
    for k, v in inputs.items():
        if k == "served" and isinstance(v, dict):
            if v.get("chosen") is not None:
                parts.append(f"served: chose {v.get('chosen')} ({fmt(v.get('served_throughput_rps'))} req/s, p99 "
                             f"{fmt(v.get('served_p99_ms'))} ms; candidates in Served operating point)")
            else:
                parts.append(f"served: {len(v.get('candidates') or [])} candidates (Served operating point)")
        elif k == "offline" and isinstance(v, dict):
            parts.append(f"offline value {fmt(v.get('value'))} by {v.get('formula', '–')}"
                         + (f" from {plain(_scalars(v.get('inputs')))}" if _scalars(v.get("inputs")) else ""))
        elif k == "curve" and isinstance(v, dict):
            parts.append(f"curve: {len(v)} batch sizes (Variants, plots)")
        elif k == "steps" and isinstance(v, list):
            parts.append("steps: " + " → ".join(str(x) for x in v))
        elif isinstance(v, dict):
            parts.append(f"{k}: {plain(_scalars(v)) or '…'}")
        else:
            parts.append(f"{k} {fmt(v)}")
    return "; ".join(parts)


def _scalars(d) -> dict:
    return {k: v for k, v in (d or {}).items() if not isinstance(v, (dict, list))} if isinstance(d, dict) else {}


def configuration_blocks(inputs: ReportInputs) -> list[Block]:
    """The generated serving configuration: each value with its formula and inputs, then the files."""
    b: list[Block] = [Heading("Generated configuration and how each value was derived")]
    if inputs.derivation:
        drows = []
        for key, d in inputs.derivation.items():
            if isinstance(d, dict):
                drows.append([key, d.get("value"), d.get("formula", "–"), derivation_inputs_text(d.get("inputs")),
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
