"""The report's first screen: the decision, worded from the summary already decided.

What a deployer needs before anything else, in this order:

1. what to deploy: the .mar's repo-relative path (artifacts/model_store/<name>.mar), its size and sha256;
2. how it serves, measured in TorchServe by the serve check at a named load (N concurrent clients):
   one throughput (req/s), one p50 / p99 (ms), READY (s), the SLO verdict;
3. the configuration it serves with: batch size, max batch delay, workers, threads per worker,
   startup and response timeouts;
4. the runner-up and why it lost;
5. a start command that works pasted from the repo root (relative paths only).

Offline figures (the benchmark's) are not on this screen: they come later, in sections labelled
offline. Nothing is decided here: every figure is `summary` (pipeline/publish/report_summary.py),
so metrics/summary.json and the page cannot disagree.
"""
from __future__ import annotations

from typing import Optional

from pipeline.decide.properties import format_start_command, start_command
from pipeline.publish.report_inputs import ReportInputs
from pipeline.publish.report_render import Block, Code, Heading, Para, Table, fmt, fmt_bytes

MODEL_STORE = "artifacts/model_store"
TS_CONFIG = "artifacts/serve/config.properties"


def decision_blocks(inputs: ReportInputs, summary: dict) -> list[Block]:
    """The first section of the page: deploy what, served how, configured how, against what, started how."""
    b: list[Block] = [Heading("Decision: what to deploy")]
    w = summary.get("winner")
    if w is None:
        return b + [Para("**No decision yet**: `artifacts/selection.json` is missing (run `dvc repro select`).")]
    b.append(Para(_deploy_text(w, summary.get("deploy") or {})))
    b.append(Para(_verdict_text(inputs, summary)))
    b.append(_served_table(summary))
    b.append(_config_table(summary.get("config") or {}))
    b += _runner_up_blocks(inputs, summary)
    b += start_blocks(inputs, summary)
    return b


def _deploy_text(w: str, deploy: dict) -> str:
    path = deploy.get("artifact")
    text = f"Deploy **`{path}`**: variant **{w}**"
    if deploy.get("present"):
        text += f", {fmt_bytes(deploy.get('bytes'))}, sha256 `{deploy.get('sha256')}`"
    else:
        text += (" (not in this checkout: `dvc pull artifacts/model_store` fetches it from the remote, "
                 "`dvc repro archive` builds it)")
    if deploy.get("store_form") == "folder":
        text += (f"; the model store serves it unpacked, as `{MODEL_STORE}/{path.rsplit('/', 1)[-1][:-4]}/` "
                 f"beside it (store form folder: no copy out of the archive at each start)")
    return text + "."


def load_text(load: dict) -> str:
    """The load the served figures were measured under, named."""
    n, expected = load.get("concurrency"), load.get("expected_concurrency")
    if n is None:
        return ("load unknown: metrics/serve_check.json does not record its concurrency"
                + (f" (serve.expected_concurrency: {expected})" if expected is not None else ""))
    text = f"{n} concurrent clients"
    if load.get("is_expected"):
        return text + " = serve.expected_concurrency"
    if expected is not None:
        return text + f", not the expected load (serve.expected_concurrency {expected})"
    return text + " (the expected concurrency is not recorded)"


def _verdict_text(inputs: ReportInputs, summary: dict) -> str:
    slo = f"Latency SLO {inputs.latency_slo_ms:g} ms p99: "
    met = summary.get("slo_met")
    word = "**met**" if met else ("**NOT met**" if met is False else "**unknown**")
    basis = summary.get("slo_basis")
    load = summary.get("load") or {}
    if basis == "served (serve_check)":
        how = f"measured in TorchServe by the serve check, {load_text(load)}"
    elif basis == "served":
        t = summary.get("tuning") or {}
        how = "in TorchServe under the expected load"
        if summary.get("serve_check_confirms_slo"):
            how += f" (the tune stage's verdict, confirmed by the serve check at {load_text(load)})"
        else:
            how += (f" (the tune stage's verdict: served p99 {fmt(t.get('served_p99_ms'))} ms at "
                    f"{fmt(t.get('expected_concurrency'))} requests in flight)")
    else:
        how = "(offline prediction: not measured in TorchServe yet)"
    return slo + word + " " + how + "."


def _served_table(summary: dict) -> Table:
    load = summary.get("load") or {}
    head = f"served in TorchServe (serve check, {load_text(load)})"
    if summary.get("throughput_rps") is None:
        return Table([head, "value"], [["serve check", "not run: `metrics/serve_check.json` is missing "
                                                        "(`dvc repro serve_check`; it needs Java 17 and TorchServe)"]])
    slo = summary.get("latency_slo_ms")
    p99 = summary.get("p99_ms")
    within = None if p99 is None or slo is None else p99 <= slo
    return Table([head, "value"], [
        ["throughput", f"{fmt(summary['throughput_rps'])} req/s"],
        ["latency p50 / p99", f"{fmt(summary.get('p50_ms'))} ms / {fmt(p99)} ms"],
        ["READY after start (all workers loaded)", f"{fmt(summary.get('ready_s'))} s"],
        [f"p99 ≤ SLO {fmt(slo)} ms", fmt(within)],
        ["measured", f"{summary.get('served_source') or '–'} (metrics/serve_check.json)"]])


def _unit(v, unit: str) -> str:
    if v is None:
        return "–"
    if v == 1 and unit.endswith("s") and unit not in ("s", "ms"):
        unit = unit[:-1]           # 1 thread, 1 process, 1 request
    return f"{fmt(v)} {unit}"


def _config_table(c: dict) -> Table:
    rows_differ = c.get("batch_rows") not in (None, c.get("batch_size"))
    return Table([f"configuration ({c.get('source') or 'not recorded'})", "value"], [
        ["batch size (TorchServe batchSize)", _unit(c.get("batch_size"), "requests")],
        *([["rows per model call (handler.batch_rows)", _unit(c.get("batch_rows"), "rows")]] if rows_differ else []),
        ["max batch delay (maxBatchDelay)", _unit(c.get("max_batch_delay_ms"), "ms")],
        ["workers (minWorkers = maxWorkers)", _unit(c.get("workers"), "processes")],
        ["threads per worker (handler.threads)", _unit(c.get("threads_per_worker"), "threads")],
        ["startup timeout (startupTimeout)", _unit(c.get("startup_timeout_s"), "s")],
        ["response timeout (responseTimeout)", _unit(c.get("response_timeout_s"), "s")]])


def _runner_up_blocks(inputs: ReportInputs, summary: dict) -> list[Block]:
    """The next variant and why it lost; the tune stage's runner-up operating point when it served several."""
    out: list[Block] = []
    ru = summary.get("runner_up")
    w = summary.get("winner")
    if ru:
        rel = ru.get("relative")
        if ru.get("figure") == "request_p99_ms":
            why = (f"its p99 per request is {abs(rel) * 100:.0f}% higher than {w}'s" if rel is not None
                   else "a higher p99 per request")
        else:
            why = (f"{abs(rel) * 100:.0f}% less throughput than {w}, each at its own served batch" if rel is not None
                   else f"less throughput than {w}")
        out.append(Para(f"Runner-up: **{ru['variant']}**, which lost on the objective ({summary.get('objective')}): "
                        f"{why}, in the offline benchmark (its figures: Variants, offline benchmark)."))
    else:
        out.append(Para("Runner-up: none: no other variant could be served (see Variants, offline)."))
    op = _operating_point_runner_up(inputs)
    if op:
        out.append(Para(op))
    alt = (inputs.selection or {}).get("quantized_alternative")
    if alt:
        out.append(Para(f"Held back: `{alt.get('variant')}` (its answers are not exact: opt in with "
                        f"`{alt.get('opt_in')}`; see Held back, offline)."))
    return out


def _operating_point_runner_up(inputs: ReportInputs) -> Optional[str]:
    """The tune stage's best other candidate served in TorchServe, and the decision step about it."""
    t = inputs.tuning or {}
    cands = [c for c in t.get("candidates") or [] if c.get("name") != t.get("chosen_name")
             and c.get("throughput_rps") is not None]
    if not cands:
        return None
    c = max(cands, key=lambda c: c["throughput_rps"])
    step = next((s for s in t.get("decision_steps") or [] if s.startswith(f"{c.get('name')}:")), None)
    st = c.get("settings") or {}
    return (f"Runner-up operating point, served by the tune stage: {c.get('name')} (batch {fmt(st.get('batch_size'))}, "
            f"delay {fmt(st.get('max_batch_delay_ms'))} ms, {fmt(st.get('workers'))} workers × "
            f"{fmt(st.get('threads_per_worker'))} threads), {fmt(c.get('throughput_rps'))} req/s, p99 "
            f"{fmt(c.get('p99_ms'))} ms" + (f": {step.split(':', 1)[1].strip()}" if step else "") + ".")


def start_blocks(inputs: ReportInputs, summary: dict) -> list[Block]:
    """The start command with repo-relative paths (paste it in the repo root), and the token note."""
    c = summary.get("config") or {}
    form = (summary.get("deploy") or {}).get("store_form") or "mar"
    cmd = start_command(model_name=inputs.model_name, model_store=MODEL_STORE, config_path=TS_CONFIG,
                        threads=c.get("threads_per_worker") or 1, store_form=form)
    b: list[Block] = [Para("Start it from the repo root (`--model-store` on the command line wins over the "
                           "`model_store` line in config.properties):"),
                      Code(format_start_command(cmd), "bash")]
    if (inputs.serve_check or {}).get("token_authorization") is not False:
        b.append(Para("Token authorization is on: TorchServe writes `key_file.json` into its working directory "
                      "(here, the repo root); send `Authorization: Bearer <inference key>` with every request."))
    return b
