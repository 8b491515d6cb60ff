"""The report: one page that explains the decision, readable offline.

Reads only the outputs of earlier stages (docs/artifacts.md), tolerating any of them being absent
(a stage not run yet, an optional field missing): the page then says what is missing instead of
failing. Renders the same content twice from one list of blocks:

- `reports/report.md`, images as files under `reports/img/`;
- `reports/report.html`, self-contained: the same PNGs inlined as base64 data URIs, no CDN, no JS.

It also writes `metrics/summary.json`, the handful of figures `dvc exp show` / `dvc metrics diff`
compare between experiments (winner, p99, throughput, cold load, serve-check figures).
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from pipeline.publish.kserve import mar_model_version
from pipeline.measure.stats import LOAD_AFTER_IMPORTS
from pipeline.core.stage_record import read_records

log = logging.getLogger(__name__)

# Phases of a cold load in the order they happen (metrics/benchmark/<v>.json cold_load.phases_ms).
LOAD_PHASES = ("import", "read", "deserialize", "to_device", "first_call")
PHASE_COLOURS = {"import": "#9e9e9e", "read": "#4e79a7", "deserialize": "#f28e2b",
                 "to_device": "#59a14f", "first_call": "#e15759"}


# --------------------------------------------------------------------------- inputs
@dataclass
class ReportInputs:
    """Everything the report reads, as plain data; None / empty where a file is absent."""
    model_name: str
    latency_slo_ms: float
    variants: list[str]                                   # params order; eager first by convention
    env: Optional[dict] = None
    conversions: dict[str, dict] = field(default_factory=dict)
    benchmarks: dict[str, dict] = field(default_factory=dict)
    selection: Optional[dict] = None
    derivation: Optional[dict] = None
    model_config: Optional[dict] = None                   # artifacts/serve/model-config.yaml
    config_properties: Optional[str] = None
    start_command: Optional[str] = None
    serve_check: Optional[dict] = None
    tuning: Optional[dict] = None                         # artifacts/serve/tuning.json (the tune stage)
    mar: Optional[dict] = None                            # {"path", "bytes", "sha256"}
    stages: list = field(default_factory=list)            # metrics/stages records (pipeline/core/stage_record.py)
    missing: list[str] = field(default_factory=list)      # inputs that were not there (for the page)


def _read_json(path: Path, missing: list[str], root: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        missing.append(_rel(path, root))
        return None
    except json.JSONDecodeError as e:
        # A corrupt input is a real failure of an earlier stage: say which file and why.
        raise ValueError(f"{path}: not valid JSON ({e}); re-run the stage that writes it "
                         f"(`dvc repro -f <stage>`)") from None


def _read_text(path: Path, missing: list[str], root: Path) -> Optional[str]:
    try:
        return path.read_text()
    except FileNotFoundError:
        missing.append(_rel(path, root))
        return None


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def collect_inputs(root: Path, model_name: str, latency_slo_ms: float, variants: list[str]) -> ReportInputs:
    """Read every earlier stage's outputs below `root` (the repo root, or a test's tmp dir)."""
    a, m = root / "artifacts", root / "metrics"
    missing: list[str] = []
    inputs = ReportInputs(model_name=model_name, latency_slo_ms=latency_slo_ms, variants=list(variants),
                          missing=missing)
    inputs.env = _read_json(a / "env.json", missing, root)
    for v in variants:
        conv = _read_json(a / "variants" / v / "conversion.json", missing, root)
        if conv is not None:
            inputs.conversions[v] = conv
        bench = _read_json(m / "benchmark" / f"{v}.json", missing, root)
        if bench is not None:
            inputs.benchmarks[v] = bench
    inputs.selection = _read_json(a / "selection.json", missing, root)
    inputs.derivation = _read_json(a / "serve" / "derivation.json", missing, root)
    mc = _read_text(a / "serve" / "model-config.yaml", missing, root)
    inputs.model_config = yaml.safe_load(mc) if mc else None
    inputs.config_properties = _read_text(a / "serve" / "config.properties", missing, root)
    cmd = _read_text(a / "serve" / "start_command.txt", missing, root)
    inputs.start_command = cmd.strip() if cmd else None
    inputs.serve_check = _read_json(m / "serve_check.json", missing, root)
    inputs.tuning = _read_json(a / "serve" / "tuning.json", missing, root)
    inputs.stages = read_records(m / "stages")
    mar = a / "model_store" / f"{model_name}.mar"
    if mar.is_file():
        inputs.mar = {"path": _rel(mar, root), "bytes": mar.stat().st_size, "sha256": sha256_file(mar),
                      "model_version": mar_model_version(mar)}
    else:
        missing.append(_rel(mar, root))
    return inputs


# --------------------------------------------------------------------------- figures
def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def steady_points(bench: dict, key: str) -> list[tuple[int, float]]:
    """[(batch_size, value)] sorted by batch size, for one steady-state figure (p99_ms, throughput_sps…)."""
    pts = []
    for bs, row in (bench.get("steady") or {}).items():
        if not isinstance(row, dict):
            continue
        val = _num(row.get(key))
        try:
            b = int(row.get("batch_size", bs))
        except (TypeError, ValueError):
            continue
        if val is not None:
            pts.append((b, val))
    return sorted(pts)


def phase_medians(bench: dict) -> dict[str, float]:
    phases = ((bench.get("cold_load") or {}).get("phases_ms") or {})
    out = {}
    for name, stats in phases.items():
        med = _num(stats.get("median")) if isinstance(stats, dict) else _num(stats)
        if med is not None:
            out[name] = med
    return out


def winner(inputs: ReportInputs) -> Optional[str]:
    """The variant that is served: the tune stage's (its contest may have replaced selection's)."""
    return (inputs.tuning or {}).get("variant") or (inputs.selection or {}).get("winner")


def serving_batch_size(inputs: ReportInputs) -> Optional[int]:
    """The batchSize the generated config serves with (model-config.yaml wins: it is what TorchServe reads)."""
    mc = inputs.model_config or {}
    if isinstance(mc.get("batchSize"), int):
        return mc["batchSize"]
    for key in ("batchSize", "batch_size"):
        entry = (inputs.derivation or {}).get(key)
        if isinstance(entry, dict) and isinstance(entry.get("value"), int):
            return entry["value"]
    return None


def summary_metrics(inputs: ReportInputs) -> dict:
    """Flat figures for `dvc exp show` / `dvc metrics diff`: one row per experiment tells the story."""
    w = winner(inputs)
    sel = inputs.selection or {}
    mc = inputs.model_config or {}
    out: dict[str, Any] = {"winner": w, "objective": sel.get("objective"), "slo_met": sel.get("slo_met"),
                           "latency_slo_ms": inputs.latency_slo_ms}
    bs = serving_batch_size(inputs)
    out["batch_size"] = bs
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
    if sc:
        ratios = sc.get("ratios") or {}
        out["serve_check"] = {
            "parity_ok": sc.get("parity_ok"), "ready_s": sc.get("ready_s"),
            "p99_ms": sc.get("p99_ms"), "throughput_rps": sc.get("throughput_rps"),
            "errors_5xx": sc.get("errors_5xx"),
            "ratio_load": ratios.get("load"), "ratio_throughput": ratios.get("throughput"),
            "ratio_p99": ratios.get("p99")}
    else:
        out["serve_check"] = {"ran": False}
    out.update(served_verdict(inputs))
    if inputs.stages:
        out["pipeline_wall_s"] = round(sum(r.get("wall_s") or 0.0 for r in inputs.stages), 1)
    if sc and isinstance(out.get("serve_check"), dict):
        out["serve_check"]["ratio_ready_floor"] = (sc.get("ready_vs_floor") or {}).get("ratio")
    return out


def _plt():
    import matplotlib
    matplotlib.use("Agg")  # no display; the PNGs are the product
    import matplotlib.pyplot as plt
    return plt


def _ok_benchmarks(inputs: ReportInputs) -> dict[str, dict]:
    return {v: b for v, b in inputs.benchmarks.items() if b.get("status", "ok") == "ok" and b.get("steady")}


def _batch_axis(ax, inputs: ReportInputs, benches: dict[str, dict]) -> None:
    sizes = sorted({b for bench in benches.values() for b, _ in steady_points(bench, "p99_ms")})
    ax.set_xscale("log", base=2)
    if sizes:
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
    bs = serving_batch_size(inputs)
    if bs:
        ax.axvline(bs, color="grey", ls=":", lw=1.2, label=f"configured batchSize {bs}")
    ax.set_xlabel("batch size")
    ax.grid(alpha=0.3)


def _plot_curves(inputs: ReportInputs, path: Path, metric: str, ylabel: str, title: str,
                 slo_line: bool) -> bool:
    """One line per benchmarked variant over batch size (the winner drawn thick)."""
    benches = _ok_benchmarks(inputs)
    if not benches:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    w = winner(inputs)
    for v, b in benches.items():
        pts = steady_points(b, metric)
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", lw=3 if v == w else 1.4, label=v + (" (winner)" if v == w else ""))
    if slo_line:
        ax.axhline(inputs.latency_slo_ms, color="red", ls="--", lw=1.2, label=f"SLO {inputs.latency_slo_ms:g} ms")
    _batch_axis(ax, inputs, benches)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_latency(inputs: ReportInputs, path: Path) -> bool:
    return _plot_curves(inputs, path, "p99_ms", "p99 latency per batch (ms)", "Latency (p99) vs batch size",
                        slo_line=True)


def plot_throughput(inputs: ReportInputs, path: Path) -> bool:
    return _plot_curves(inputs, path, "throughput_sps", "throughput (samples/s)", "Throughput vs batch size",
                        slo_line=False)


def plot_cold_load(inputs: ReportInputs, path: Path) -> bool:
    rows = []
    for v, b in inputs.benchmarks.items():
        phases = phase_medians(b)
        if any(p in phases for p in LOAD_PHASES):
            rows.append((v, phases, _num((b.get("cold_load") or {}).get("raw_read_ms"))))
    if not rows:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 2.2), dpi=100)
    labels = [r[0] for r in rows]
    y = list(range(len(rows)))
    left = [0.0] * len(rows)
    for phase in LOAD_PHASES:
        widths = [r[1].get(phase, 0.0) for r in rows]
        ax.barh(y, widths, left=left, color=PHASE_COLOURS[phase], label=phase, height=0.6)
        left = [a + b for a, b in zip(left, widths)]
    floors = [(i, r[2]) for i, r in enumerate(rows) if r[2] is not None]
    if floors:
        ax.scatter([f for _, f in floors], [i for i, _ in floors], marker="|", s=400, color="black",
                   zorder=5, label="raw-read floor")
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel("median cold load (ms)")
    ax.set_title("Cold load, phase by phase")
    for i, total in enumerate(left):
        ax.annotate(f"{total:.0f} ms", (total, i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.margins(x=0.12)
    ax.legend(fontsize=8, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


SERVE_FIGURES = (("throughput_rps", "throughput (req/s)"), ("p99_ms", "p99 (ms)"), ("ready_s", "time to READY (s)"))


def plot_serve_check(inputs: ReportInputs, path: Path) -> bool:
    sc = inputs.serve_check
    if not sc:
        return False
    base = sc.get("baseline") or {}
    figs = [(k, label) for k, label in SERVE_FIGURES if _num(sc.get(k)) is not None]
    if not figs:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(figs), figsize=(3 * len(figs) + 1, 3.6), dpi=100, squeeze=False)
    for ax, (key, label) in zip(axes[0], figs):
        names, vals, colours = [winner(inputs) or "winner"], [_num(sc.get(key))], ["#4e79a7"]
        if _num(base.get(key)) is not None:
            names.append("baseline")
            vals.append(_num(base.get(key)))
            colours.append("#bab0ac")
        bars = ax.bar(names, vals, color=colours)
        ax.bar_label(bars, fmt="%.4g", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.margins(y=0.15)
    fig.suptitle("Serve check in TorchServe: winner vs naive baseline")
    return _save(fig, path)


def _save(fig, path: Path) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return True


PLOTS = (("latency", "Latency (p99) vs batch size, with the SLO", plot_latency),
         ("throughput", "Throughput vs batch size", plot_throughput),
         ("cold_load", "Cold load per variant, stacked phases, with the raw-read floor", plot_cold_load),
         ("serve_check", "Serve check vs baseline", plot_serve_check))


# --------------------------------------------------------------------------- document model
@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Para:
    text: str                      # plain text; `code` spans and **bold** are rendered in both formats


@dataclass
class Table:
    header: list[str]
    rows: list[list[Any]]


@dataclass
class Image:
    path: Path                     # the PNG on disk
    alt: str


@dataclass
class Code:
    text: str
    lang: str = ""


Block = Heading | Para | Table | Image | Code


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if 0.99 <= x < 1:          # cosines / agreements: the digits that matter are the nines
            return f"{x:.9f}".rstrip("0").rstrip(".")
        return f"{x:.4g}"
    if isinstance(x, (dict, list)):
        return json.dumps(x, separators=(", ", ": "))
    return str(x)


def _fmt_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "–"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def build_blocks(inputs: ReportInputs, images: dict[str, Path]) -> list[Block]:
    b: list[Block] = [Heading(f"Model optimization report: {inputs.model_name}", 1)]
    sel = inputs.selection
    w = winner(inputs)
    summary = summary_metrics(inputs)

    # Decision first: it is what the reader came for.
    b.append(Heading("Decision"))
    if sel is None:
        b.append(Para("**No decision yet**: `artifacts/selection.json` is missing (run `dvc repro select`)."))
    else:
        slo = ("met" if summary.get("slo_met") else "**NOT met**") + (
            " in TorchServe under the expected load" if summary.get("slo_basis") == "served" else " (offline prediction)")
        b.append(Para(f"Winner: **{w}** (objective: {sel.get('objective', '–')}; "
                      f"latency SLO {inputs.latency_slo_ms:g} ms p99: {slo})."))
        if sel.get("message"):
            b.append(Para(str(sel["message"])))
        b.append(Table(["serving figure", "value"], [
            ["batch size", summary["batch_size"]], ["max batch delay (ms)", summary["max_batch_delay_ms"]],
            ["workers", summary["workers"]], ["p99 at that batch, benchmark (ms)", summary["p99_ms"]],
            ["throughput at that batch, benchmark (samples/s)", summary["throughput_sps"]],
            ["cold load, median total (ms)", summary["cold_load_ms"]]]))

    b += tuning_blocks(inputs)

    b.append(Heading("Variants"))
    b.append(Para("Every variant listed in params, with its verification, its measurements and why it "
                  "won or lost. p99 and throughput are taken at the variant's best-throughput batch."))
    rows = []
    sel_variants = (sel or {}).get("variants") or {}
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
                     phase_medians(bench).get("total"), _fmt_bytes(conv.get("artifact_bytes", bench.get("artifact_bytes"))),
                     "; ".join(reasons) or "–"])
    b.append(Table(["variant", "conversion", "benchmark", "selection", "best batch", "p99 (ms)",
                    "throughput (samples/s)", "cold load (ms)", "size", "reasons"], rows))

    b.append(Heading("Verification against the eager fp32 reference"))
    vrows = []
    for v in inputs.variants:
        conv = inputs.conversions.get(v)
        if not conv:
            continue
        tol = conv.get("tolerance") or {}
        for o in ((conv.get("verification") or {}).get("outputs") or []):
            vrows.append([v, o.get("name"), o.get("max_abs"), o.get("max_rel"), o.get("min_cosine"),
                          o.get("topk_agreement"), f"atol {_fmt(tol.get('atol'))}, rtol {_fmt(tol.get('rtol'))}, "
                          f"cos ≥ {_fmt(tol.get('min_cosine'))}"])
    if vrows:
        b.append(Table(["variant", "output", "max abs", "max rel", "min cosine", "top-k agreement", "tolerance"], vrows))
    else:
        b.append(Para("No verification records (`artifacts/variants/<v>/conversion.json`) found."))
    b += accuracy_trade_blocks(inputs)

    b.append(Heading("Plots"))
    for key, title, _ in PLOTS:
        if key in images:
            b.append(Heading(title, 3))
            b.append(Image(images[key], title))
    if not images:
        b.append(Para("No plots: no benchmark or serve-check results found."))

    b.append(Heading("Serve check in TorchServe"))
    sc = inputs.serve_check
    if not sc:
        b.append(Para("**Serve check not run**: `metrics/serve_check.json` is missing (run `dvc repro serve_check`; "
                      "it needs Java 17 and TorchServe). The figures above come from the benchmark only."))
    else:
        base = sc.get("baseline") or {}
        ratios = sc.get("ratios") or {}
        keys = ["ready_s", "worker_load_ms", "first_request_ms", "requests_sent", "requests_ok", "errors_5xx",
                "p50_ms", "p99_ms", "throughput_rps", "batch_sizes_seen"]
        b.append(Table(["figure", f"winner ({w})", "baseline"], [[k, sc.get(k), base.get(k)] for k in keys]))
        b.append(Para(f"Parity over HTTP with the reference outputs: **{_fmt(sc.get('parity_ok'))}** "
                      f"(max abs error {_fmt(sc.get('max_abs_error'))}). Ratios winner / baseline: "
                      f"cold load {_fmt(ratios.get('load'))}, throughput {_fmt(ratios.get('throughput'))}, "
                      f"p99 {_fmt(ratios.get('p99'))}."))
        bad = sc.get("bad_inputs")
        if isinstance(bad, list) and bad:
            b.append(Table(["bad input", "status"], [[c.get("case", c.get("id", c.get("name"))), c.get("status")]
                                                    for c in bad if isinstance(c, dict)]))
        elif isinstance(bad, dict) and bad:
            b.append(Table(["bad input", "status"], [[k, v] for k, v in bad.items()]))

    b += startup_blocks(inputs)
    b += stage_cost_blocks(inputs)

    b.append(Heading("Generated configuration and how each value was derived"))
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

    b.append(Heading("Start command"))
    if inputs.start_command:
        b.append(Code(inputs.start_command, "bash"))
        b.append(Para("Token authorization is on: TorchServe writes `key_file.json` into its working directory; "
                      "send `Authorization: Bearer <inference key>` with every request."))
    else:
        b.append(Para("`artifacts/serve/start_command.txt` is missing (run `dvc repro configure`)."))
    if inputs.mar:
        b.append(Para(f"Archive `{inputs.mar['path']}`: {_fmt_bytes(inputs.mar['bytes'])}, "
                      f"sha256 `{inputs.mar['sha256']}`."))

    b.append(Heading("Environment"))
    env = inputs.env
    if env:
        cpu = env.get("cpu") or {}
        isa = cpu.get("isa") or {}
        gpu = env.get("gpu")
        erows = [["device", env.get("device")], ["CPU", cpu.get("model")],
                 ["cores (physical / logical)", f"{_fmt(cpu.get('physical_cores'))} / {_fmt(cpu.get('logical_cores'))}"],
                 ["ISA", ", ".join(k for k, v in isa.items() if v) or "–"],
                 *([["ISA listed but off in the OS", ", ".join(cpu["isa_disabled_by_os"])]]
                   if cpu.get("isa_disabled_by_os") else []),
                 ["memory (MB)", env.get("memory_mb")],
                 ["GPU", "none" if not gpu else f"{gpu.get('name')} ({_fmt(gpu.get('memory_mb'))} MB, "
                                                f"driver {_fmt(gpu.get('driver'))}, CUDA {_fmt(gpu.get('cuda'))})"],
                 ["disk read (MB/s)", env.get("disk_read_mb_s")]]
        erows += [[f"version: {k}", v] for k, v in (env.get("versions") or {}).items()]
        b.append(Table(["", ""], erows))
    else:
        b.append(Para("`artifacts/env.json` is missing (run `dvc repro probe`)."))

    if inputs.missing:
        b.append(Heading("Inputs not found"))
        b.append(Para("These outputs of earlier stages were absent when the report was written: "
                      + ", ".join(f"`{m}`" for m in inputs.missing) + "."))
    return b


def _model_bytes(inputs: ReportInputs) -> Optional[int]:
    """The reference model's size: the eager variant's artifact (the checkpoint's weights)."""
    eager = inputs.conversions.get("eager") or inputs.benchmarks.get("eager") or {}
    n = eager.get("artifact_bytes")
    return int(n) if isinstance(n, (int, float)) and n else None


def load_vs_read(cold: dict) -> str:
    """A variant's load after imports against the raw read of its bytes, from the page cache and
    (when measured) from the disk."""
    ph = cold.get("phases_ms") or {}
    load = sum(_num((ph.get(p) or {}).get("median")) or 0.0 for p in LOAD_AFTER_IMPORTS)
    text = (f"page cache: {_fmt(load)} ms vs {_fmt(cold.get('raw_read_ms'))} ms "
            f"({_fmt(cold.get('load_floor_ratio'))}×)")
    disk = cold.get("from_disk") or {}
    if disk.get("measured"):
        text += (f"; from disk: {_fmt(disk.get('load_ms'))} ms vs {_fmt(disk.get('raw_read_ms'))} ms "
                 f"({_fmt(disk.get('load_floor_ratio'))}×)")
    elif disk.get("reason"):
        text += f"; from disk: not measured ({disk['reason']})"
    return text


def startup_blocks(inputs: ReportInputs) -> list[Block]:
    """Start-up of the served model: store form (with READY of both forms), startupTimeout against
    the measured load and a 200 MB/s disk, and memory per worker against the artifact."""
    d = inputs.derivation or {}
    sc = inputs.serve_check or {}
    st, form = d.get("startup_timeout_s"), d.get("store_form")
    if not isinstance(st, dict) and not sc:
        return []
    b: list[Block] = [Heading("Start-up and memory of the served model")]
    rows = []
    if isinstance(form, dict):
        fi = form.get("inputs") or {}
        rows.append(["store form", f"{form.get('value')} (artifact {_fmt(fi.get('artifact_mb'))} MB, folder from "
                                   f"{_fmt(fi.get('folder_store_min_mb'))} MB; unpack avoided ≈ "
                                   f"{_fmt(fi.get('unpack_estimate_s'))} s per start)"])
    forms = sc.get("store_forms") or {}
    for f in ("mar", "folder"):
        if isinstance(forms.get(f), dict):
            r = forms[f]
            rows.append([f"READY from the {f}" + (" (served)" if forms.get("chosen") == f else ""),
                         f"{_fmt(r.get('ready_s'))} s (WorkerLoadTime {_fmt(r.get('worker_load_ms'))} ms)"
                         if r.get("ready") else f"not READY: {str(r.get('error'))[:200]}"])
    if isinstance(st, dict):
        si = st.get("inputs") or {}
        ref = si.get("at_reference_disk") or {}
        disk_ms = si.get("cold_load_from_disk_ms")
        rows += [["startupTimeout (derived)", f"{_fmt(st.get('value'))} s from a worst cold load of "
                  f"{_fmt(si.get('worst_cold_load_ms', si.get('cold_load_max_ms')))} ms (page cache: max "
                  f"{_fmt(si.get('cold_load_max_ms'))}, median {_fmt(si.get('cold_load_median_ms'))} ms"
                  + (f"; from disk: {_fmt(disk_ms)} ms" if disk_ms is not None else "")
                  + f"), read measured at {_fmt(si.get('measured_read_mb_s'))} MB/s"],
                 [f"startupTimeout on a {_fmt(ref.get('read_mb_s'))} MB/s disk",
                  f"{_fmt(ref.get('startup_timeout_s'))} s (+{_fmt(ref.get('disk_read_s'))} s to read the artifact)"]]
        if si.get("target_disk_read_mb_s"):
            rows.append(["serve.target_disk_read_mb_s", f"{_fmt(si['target_disk_read_mb_s'])} MB/s "
                         f"(+{_fmt(si.get('disk_read_s'))} s, included above)"])
    if sc.get("ready_s") is not None and isinstance(st, dict):
        rows.append(["READY in TorchServe vs startupTimeout", f"{_fmt(sc['ready_s'])} s of {_fmt(st.get('value'))} s"])
    vf = sc.get("ready_vs_floor") or {}
    if vf.get("ratio") is not None:
        rows.append(["READY vs server floor + raw read", f"{_fmt(vf['ratio'])}× ({_fmt(vf['ready_s'])} s against a "
                     f"do-nothing model's {_fmt(vf['floor_ready_s'])} s with as many workers "
                     f"({vf.get('floor_workers') or 1}) + {_fmt(vf['raw_read_s'])} s raw read)"])
    served = inputs.benchmarks.get(winner(inputs) or "") or {}
    if served.get("cold_load"):
        rows.append(["load after imports vs raw read of the served artifact", load_vs_read(served["cold_load"])])
    hl = sc.get("handler_load_ms") or {}
    if hl.get("total") is not None:
        floor_ms = ((sc.get("server_floor") or {}).get("worker_load_ms"))
        rows.append(["worker load (WorkerLoadTime) and the handler's part", f"{_fmt(sc.get('worker_load_ms'))} ms"
                     + (f" (a do-nothing model's: {_fmt(floor_ms)} ms)" if floor_ms else "") + "; handler "
                     + ", ".join(f"{k} {_fmt(v)}" for k, v in hl.items()) + " ms"])
    diag = sc.get("startup_diagnosis") or {}
    if diag.get("message"):
        rows.append(["startupTimeout MISSED", diag["message"]])
    workers = d.get("workers") if isinstance(d.get("workers"), dict) else {}
    rss_bench = (workers.get("inputs") or {}).get("peak_rss_mb")
    size = _model_bytes(inputs)
    art = (st or {}).get("inputs", {}).get("artifact_bytes") if isinstance(st, dict) else None
    if rss_bench is not None:
        rows.append(["peak RSS per worker (benchmark → workers)",
                     f"{_fmt(rss_bench)} MB; workers = {_fmt(workers.get('value'))} ({workers.get('formula', '')})"])
    if sc.get("worker_peak_rss_mb") is not None:
        ratio = f", {sc['worker_peak_rss_mb'] * 2**20 / art:.2f}× the served artifact" if art else ""
        rows.append(["peak RSS per worker in TorchServe", f"{_fmt(sc['worker_peak_rss_mb'])} MB{ratio}"])
    if size:
        rows.append(["model size (eager weights)", _fmt_bytes(size)])
    b.append(Table(["", ""], rows))
    return b


def stage_cost_blocks(inputs: ReportInputs) -> list[Block]:
    """Wall time and peak memory of every stage run recorded in metrics/stages."""
    if not inputs.stages:
        return []
    size = _model_bytes(inputs)
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
                 f"peak over the model's size ({_fmt_bytes(size)})."),
            Table(["stage", "wall (s)", "peak RSS stage (MB)", "peak RSS children (MB)", "copies of the model",
                   "exit", "started"], rows)]


def _gate_text(f: dict) -> str:
    if f.get("kind") == "text-embedding":
        return (f"min cosine {_fmt(f.get('min_cosine'))}, mean {_fmt(f.get('mean_cosine'))}, "
                f"recall@{f.get('k')} {_fmt(f.get('recall_at_k'))}")
    return f"top-1 agreement {_fmt(f.get('top1_agreement'))}, top-{f.get('k')} overlap {_fmt(f.get('topk_overlap'))}"


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
        bs = serving_batch_size(inputs) if serving_batch_size(inputs) in common else (common[-1] if common else None)
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


# --------------------------------------------------------------------------- renderers
def _md_cell(x: Any) -> str:
    return _fmt(x).replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list[Block], md_dir: Path) -> str:
    out = []
    for blk in blocks:
        if isinstance(blk, Heading):
            out.append("#" * blk.level + " " + blk.text)
        elif isinstance(blk, Para):
            out.append(blk.text)
        elif isinstance(blk, Table):
            out.append("| " + " | ".join(_md_cell(h) for h in blk.header) + " |")
            out.append("|" + "---|" * len(blk.header))
            out.extend("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in blk.rows)
        elif isinstance(blk, Image):
            out.append(f"![{blk.alt}]({_rel(blk.path, md_dir)})")
        elif isinstance(blk, Code):
            fence = "````" if "```" in blk.text else "```"
            out.append(f"{fence}{blk.lang}\n{blk.text.rstrip()}\n{fence}")
        out.append("")
    return "\n".join(out)


def _inline_html(text: str) -> str:
    """Escape, then render `code` and **bold** spans (the only inline markup the blocks use)."""
    import re
    s = html.escape(text)
    s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", s)


_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}table{border-collapse:collapse;margin:.8em 0;font-size:.9em}
td,th{border:1px solid #ccc;padding:.25em .5em;vertical-align:top}th{background:#f3f3f3}
pre{background:#f6f8fa;padding:.8em;overflow-x:auto;font-size:.85em}img{max-width:100%;border:1px solid #eee}
code{background:#f6f8fa;padding:0 .2em}h1{border-bottom:2px solid #4e79a7}"""


def data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def render_html(blocks: list[Block], title: str) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"]
    for blk in blocks:
        if isinstance(blk, Heading):
            out.append(f"<h{blk.level}>{html.escape(blk.text)}</h{blk.level}>")
        elif isinstance(blk, Para):
            out.append(f"<p>{_inline_html(blk.text)}</p>")
        elif isinstance(blk, Table):
            out.append("<table><thead><tr>" + "".join(f"<th>{html.escape(_fmt(h))}</th>" for h in blk.header)
                       + "</tr></thead><tbody>")
            out.extend("<tr>" + "".join(f"<td>{_inline_html(_fmt(c))}</td>" for c in row) + "</tr>"
                       for row in blk.rows)
            out.append("</tbody></table>")
        elif isinstance(blk, Image):
            # Inlined: the page must open offline, alone, without its img/ folder.
            out.append(f'<figure><img alt="{html.escape(blk.alt)}" src="{data_uri(blk.path)}"></figure>')
        elif isinstance(blk, Code):
            out.append(f"<pre><code>{html.escape(blk.text.rstrip())}</code></pre>")
    out.append("</body></html>")
    return "\n".join(out)


# --------------------------------------------------------------------------- entry point
@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    html: Path
    images: dict[str, Path]
    summary: Path


def write_report(inputs: ReportInputs, reports_dir: Path, summary_json: Path) -> ReportFiles:
    """Render plots, report.md, report.html and the summary metrics; returns where each went."""
    img_dir = reports_dir / "img"
    if img_dir.exists():
        for old in img_dir.glob("*.png"):   # a plot that no longer applies must not linger
            old.unlink()
    images: dict[str, Path] = {}
    for key, _title, plot in PLOTS:
        path = img_dir / f"{key}.png"
        if plot(inputs, path):
            images[key] = path
            log.info("plot %s → %s", key, path)
        else:
            log.info("plot %s skipped: no data", key)
    blocks = build_blocks(inputs, images)
    reports_dir.mkdir(parents=True, exist_ok=True)
    md = reports_dir / "report.md"
    md.write_text(render_markdown(blocks, reports_dir))
    page = reports_dir / "report.html"
    page.write_text(render_html(blocks, f"{inputs.model_name}: model optimization report"))
    summary_json.parent.mkdir(parents=True, exist_ok=True)
    summary_json.write_text(json.dumps(summary_metrics(inputs), indent=2) + "\n")
    return ReportFiles(markdown=md, html=page, images=images, summary=summary_json)


# --------------------------------------------------------------------------- served operating point
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


def tuning_blocks(inputs: ReportInputs) -> list[Block]:
    """The candidates served by the tune stage: predicted vs served, batches formed, and why the
    served one won; then the winner against the hand-tuned reference and the baseline."""
    t = inputs.tuning
    if not t:
        return [Heading("Served operating point"),
                Para("`artifacts/serve/tuning.json` is missing (run `dvc repro tune`): the SLO verdict above is "
                     "the offline prediction.")]
    b: list[Block] = [Heading("Served operating point (tuned in TorchServe)")]
    if not t.get("enabled", True):
        return b + [Para("Tuning is off (`tune.enabled: false`): the offline choice is served untested.")]
    b.append(Para(f"**{t.get('message')}**"))
    b.append(Para(f"{len(t.get('candidates') or [])} candidates from the offline curve, each served "
                  f"{(t.get('settings') or {}).get('rounds')} times in interleaved rounds with "
                  f"{t.get('expected_concurrency')} requests in flight; tuning took {_fmt(t.get('duration_s'))} s "
                  f"({t.get('server_starts')} server starts, {t.get('registrations', 0)} re-registrations)."))

    def rows(cands):
        out = []
        for c in cands:
            p = c.get("predicted") or {}
            st = c.get("settings") or {}
            out.append([c.get("name"), f"{st.get('batch_size')} / {st.get('max_batch_delay_ms')} ms / "
                        f"{st.get('workers')}×{st.get('threads_per_worker')}",
                        p.get("throughput_rps"), c.get("throughput_rps"), p.get("request_p99_ms"), c.get("p99_ms"),
                        c.get("throughput_spread"), c.get("batches_formed"), c.get("meets_slo")])
        return out
    header = ["candidate", "batch / delay / workers×threads", "predicted req/s", "served req/s", "predicted p99 (ms)",
              "served p99 (ms)", "noise (2 s.e. of the mean)", "batches formed {size: count}", "served p99 ≤ SLO"]
    contest = t.get("variant_contest")
    if contest:
        b.append(Heading("Variant contest", 3))
        b.append(Para(f"Selection could not tell {', '.join(contest.get('contenders') or [])} apart beyond the "
                      f"benchmark's noise, so each was served at its own offline point, in interleaved rounds. "
                      f"Served: **{contest.get('chosen')}**"
                      + (" (it replaced selection's winner)." if contest.get("replaced_selection") else ".")))
        b.append(Table(header, rows(contest.get("candidates") or [])))
        b.append(Para("Why: " + " → ".join(contest.get("decision_steps") or [])))
        b.append(Heading(f"Operating point of {t.get('variant')}", 3))
    b.append(Table(header, rows(t.get("candidates") or [])))
    b.append(Para("Why: " + " → ".join(t.get("decision_steps") or [])))
    fe = t.get("frontend")
    if fe:
        b.append(Heading("Frontend settings", 3))
        b.append(Table(header, rows(fe.get("candidates") or [])))
        b.append(Para("Why: " + " → ".join(fe.get("decision_steps") or [])))
    elif t.get("frontend_skipped"):
        b.append(Para("Frontend settings: " + t["frontend_skipped"] + "."))
    refs = (inputs.serve_check or {}).get("references") or {}
    setups = refs.get("setups") or {}
    if setups:
        b.append(Heading("Against the hand-tuned reference and the naive baseline (serve check)", 3))
        b.append(Para(f"Medians of up to {refs.get('rounds')} interleaved rounds, same host, same load (a reference is "
                      f"served again only while a comparison with it is within {_fmt(100 * (refs.get('decided_band') or 0))}% "
                      f"of parity). Hand-tuned: "
                      f"{(refs.get('handtuned_setup') or {}).get('what') or (refs.get('handtuned_setup') or {}).get('reason')}."))
        b.append(Table(["setup", "READY (s)", "req/s", "p50 (ms)", "p99 (ms)", "p99 ≤ SLO", "rounds (req/s)"],
                       [[n, s_.get("ready_s"), s_.get("throughput_rps"), s_.get("p50_ms"), s_.get("p99_ms"),
                         s_.get("within_slo"), [r.get("throughput_rps") and round(r["throughput_rps"], 1)
                                                for r in s_.get("rounds") or []]]
                        for n, s_ in setups.items()]))
        if refs.get("ratios_handtuned"):
            b.append(Para(f"Winner / hand-tuned: {refs['ratios_handtuned']}."))
    return b
