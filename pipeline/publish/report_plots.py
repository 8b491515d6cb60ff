"""The report's plots: PNG files drawn with matplotlib (Agg, no display) from the report's inputs.

Each plot function returns False, drawing nothing, when its inputs are absent; `PLOTS` lists them
in page order with their titles.
"""
from __future__ import annotations

import logging
from pathlib import Path

from pipeline.publish.report_inputs import (ReportInputs, as_number, phase_medians, serving_batch_rows,
                                            serving_batch_size, steady_points, winner)

# Phases of a cold load in the order they happen (metrics/benchmark/<v>.json cold_load.phases_ms).
LOAD_PHASES = ("import", "read", "deserialize", "to_device", "first_call")
PHASE_COLOURS = {"import": "#9e9e9e", "read": "#4e79a7", "deserialize": "#f28e2b",
                 "to_device": "#59a14f", "first_call": "#e15759"}

log = logging.getLogger(__name__)


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
    bs, rows = serving_batch_size(inputs), serving_batch_rows(inputs)
    if rows and rows != bs:       # several rows per request: the curve's batch is rows per model call
        ax.axvline(rows, color="grey", ls=":", lw=1.2, label=f"served {rows} rows per call (batchSize {bs} requests)")
    elif bs:
        ax.axvline(bs, color="grey", ls=":", lw=1.2, label=f"configured batchSize {bs}")
    ax.set_xlabel("batch size (rows per model call)")
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
            rows.append((v, phases, as_number((b.get("cold_load") or {}).get("raw_read_ms"))))
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
    figs = [(k, label) for k, label in SERVE_FIGURES if as_number(sc.get(k)) is not None]
    if not figs:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(figs), figsize=(3 * len(figs) + 1, 3.6), dpi=100, squeeze=False)
    for ax, (key, label) in zip(axes[0], figs):
        names, vals, colours = [winner(inputs) or "winner"], [as_number(sc.get(key))], ["#4e79a7"]
        if as_number(base.get(key)) is not None:
            names.append("baseline")
            vals.append(as_number(base.get(key)))
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


def draw_plots(inputs: ReportInputs, img_dir: Path) -> dict[str, Path]:
    """Every plot that has data, as img_dir/<key>.png; returns {key: path}. Old PNGs are removed
    first: a plot that no longer applies must not linger."""
    if img_dir.exists():
        for old in img_dir.glob("*.png"):
            old.unlink()
    images: dict[str, Path] = {}
    for key, _title, plot in PLOTS:
        path = img_dir / f"{key}.png"
        if plot(inputs, path):
            images[key] = path
            log.info("plot %s → %s", key, path)
        else:
            log.info("plot %s skipped: no data", key)
    return images
