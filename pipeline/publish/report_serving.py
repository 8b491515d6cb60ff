"""The report's sections about the served model: the operating point the tune stage chose in
TorchServe (against the hand-tuned reference and the naive baseline), and how the model starts
(store form, startupTimeout against the measured load, READY against the server's floor) and what
memory a worker takes.

Each function returns blocks of the page (pipeline/publish/report_render.py) from the report's
inputs; the SLO verdict itself is decided in pipeline/publish/report_summary.py.
"""
from __future__ import annotations

from pipeline.measure.stats import LOAD_AFTER_IMPORTS
from pipeline.publish.report_inputs import ReportInputs, as_number, model_bytes, winner
from pipeline.publish.report_render import Block, Heading, Para, Table, batches_text, fmt, fmt_bytes

# --------------------------------------------------------------------------- served operating point
CANDIDATE_HEADER = ["candidate", "batch / delay / workers×threads", "predicted req/s (offline)", "served req/s",
                    "predicted p99 (ms, offline)", "served p99 (ms)", "noise (2 s.e. of the mean, share)",
                    "batches formed (count of size)", "served p99 ≤ SLO"]


def _candidate_rows(cands: list[dict]) -> list[list]:
    out = []
    for c in cands:
        p = c.get("predicted") or {}
        st = c.get("settings") or {}
        rows = st.get("batch_rows")
        batch = f"{st.get('batch_size')}" + (f" req ({rows} rows/call)" if rows and rows != st.get("batch_size") else "")
        out.append([c.get("name"), f"{batch} / {st.get('max_batch_delay_ms')} ms / "
                    f"{st.get('workers')}×{st.get('threads_per_worker')}",
                    p.get("throughput_rps"), c.get("throughput_rps"), p.get("request_p99_ms"), c.get("p99_ms"),
                    c.get("throughput_spread"), batches_text(c.get("batches_formed")), c.get("meets_slo")])
    return out


def _decided(record: dict) -> list[Block]:
    """A tuning round's candidates and the steps of its decision."""
    return [Table(CANDIDATE_HEADER, _candidate_rows(record.get("candidates") or [])),
            Para("Why: " + " → ".join(record.get("decision_steps") or []))]


def tuning_blocks(inputs: ReportInputs) -> list[Block]:
    """The candidates served by the tune stage: predicted vs served, batches formed, and why the
    served one won; then the winner against the hand-tuned reference and the baseline."""
    t = inputs.tuning
    if not t:
        tm = inputs.tuning_metrics
        if tm:      # the committed figures only: the candidates are in artifacts/serve/tuning.json (DVC cache)
            return [Heading("Served operating point (tuned in TorchServe)"),
                    Para(f"The tune stage served {tm.get('chosen_name') or 'its choice'} ({fmt(tm.get('served_throughput_rps'))} "
                         f"req/s, p99 {fmt(tm.get('served_p99_ms'))} ms; SLO {'met' if tm.get('slo_met') else 'NOT met'}) "
                         f"in {fmt(tm.get('duration_s'))} s ({fmt(tm.get('server_starts'))} server starts). Its candidates "
                         f"are in `artifacts/serve/tuning.json`, not in this checkout (`dvc pull artifacts/serve`).")
                    ] + references_blocks(inputs)
        return [Heading("Served operating point"),
                Para("`artifacts/serve/tuning.json` is missing (run `dvc repro tune`): no operating point was "
                     "served by the tune stage.")] + references_blocks(inputs)
    b: list[Block] = [Heading("Served operating point (tuned in TorchServe)")]
    if not t.get("enabled", True):
        return b + [Para("Tuning is off (`tune.enabled: false`): the offline choice is served untested.")]
    b.append(Para(f"**{t.get('message')}**"))
    b.append(Para(f"{len(t.get('candidates') or [])} candidates from the offline curve, each served "
                  f"{(t.get('settings') or {}).get('rounds')} times in interleaved rounds with "
                  f"{t.get('expected_concurrency')} requests in flight; tuning took {fmt(t.get('duration_s'))} s "
                  f"({t.get('server_starts')} server starts, {t.get('registrations', 0)} re-registrations)."))
    contest = t.get("variant_contest")
    if contest:
        b += _contest_blocks(contest)
        b.append(Heading(f"Operating point of {t.get('variant')}", 3))
    b += _decided(t)
    fe = t.get("frontend")
    if fe:
        b.append(Heading("Frontend settings", 3))
        b += _decided(fe)
    elif t.get("frontend_skipped"):
        b.append(Para("Frontend settings: " + t["frontend_skipped"] + "."))
    return b + references_blocks(inputs)


def _contest_blocks(contest: dict) -> list[Block]:
    """Variants selection could not tell apart, each served at its own offline point."""
    return [Heading("Variant contest", 3),
            Para(f"Selection could not tell {', '.join(contest.get('contenders') or [])} apart beyond the "
                 f"benchmark's noise, so each was served at its own offline point, in interleaved rounds. "
                 f"Served: **{contest.get('chosen')}**"
                 + (" (it replaced selection's winner)." if contest.get("replaced_selection") else ".")),
            *_decided(contest)]


RATIO_NAMES = {"throughput": "throughput", "throughput_within_slo": "throughput within the SLO", "p99": "p99",
               "ready": "READY"}


def references_blocks(inputs: ReportInputs) -> list[Block]:
    """The winner against the hand-tuned reference and the naive baseline, each measured where it was."""
    refs = (inputs.serve_check or {}).get("references") or {}
    setups = refs.get("setups") or {}
    if not setups:
        return []
    handtuned = refs.get("handtuned_setup") or {}
    measured = refs.get("measured") or {}
    if measured.get("interleaved_with_winner") is False:
        host = measured.get("references_host") or {}
        when = (f"The winner and the server's ceilings were served in this run; the hand-tuned reference and "
                f"the naive baseline by the references stage ({measured.get('from')}) at {measured.get('references')}"
                f" on {host.get('cpu') or 'this host'}, under the same load, in interleaved rounds of their own: "
                f"re-measured only when the host, the model, the load or their recipes change, so the ratios "
                f"below compare two runs (the rounds' spread shows the host's drift).")
    else:
        when = (f"Medians of up to {refs.get('rounds')} interleaved rounds, same host, same load (a reference is "
                f"served again only while a comparison with it is within "
                f"{fmt(100 * (refs.get('decided_band') or 0))}% of parity).")
    b: list[Block] = [
        Heading("Against the hand-tuned reference and the naive baseline (served)", 3),
        Para(f"{when} Hand-tuned: {handtuned.get('what') or handtuned.get('reason')}."),
        Table(["setup", "READY (s)", "req/s", "p50 (ms)", "p99 (ms)", "p99 ≤ SLO", "each round (req/s)"],
              [[n, s_.get("ready_s"), s_.get("throughput_rps"), s_.get("p50_ms"), s_.get("p99_ms"),
                s_.get("within_slo"), ", ".join(fmt(round(r["throughput_rps"], 1)) for r in s_.get("rounds") or []
                                                if r.get("throughput_rps") is not None) or "–"]
               for n, s_ in setups.items()])]
    rh = refs.get("ratios_handtuned")
    if rh:
        b.append(Para("Winner / hand-tuned: " + ", ".join(f"{RATIO_NAMES.get(k, k)} {fmt(v)}×" for k, v in rh.items()
                                                         if v is not None) + "."))
    return b + bound_blocks(inputs)


PHASE_ROWS = (("decode", "decode_us", "parsing and tokenizing each request"),
              ("collate", "collate_us", "padding the requests into one batch"),
              ("model", "model_us", "the runtime's call"),
              ("respond", "respond_us", "building and serialising the answers"),
              ("the handler in all", "handle_us", "handle() per request, these phases and the rest"))


def bound_blocks(inputs: ReportInputs) -> list[Block]:
    """Served vs the speed the host allows (pipeline/serve/reference/ceiling.py) and where a request's time
    goes inside the worker (the handler's own timers under the load)."""
    sc = inputs.serve_check or {}
    bound = (sc.get("references") or {}).get("bound") or {}
    profile = sc.get("handler_profile") or {}
    b: list[Block] = []
    if bound.get("bound_rps"):
        alone = bound.get("model_alone") or {}
        if alone.get("measured"):
            how = (f"the served variant run alone in this run, {fmt(alone.get('workers'))} worker process(es) at once "
                   f"on the served requests in server batches of {fmt(alone.get('batch_size'))}")
        else:
            how = (f"{fmt(alone.get('workers'))} worker(s) x the benchmark's {fmt(alone.get('per_process_sps'))} "
                   f"samples/s at batch {fmt(alone.get('batch_size'))}"
                   + (f" rows ÷ {fmt(alone['rows_per_request'])} rows per request" if alone.get("rows_per_request") else ""))
        bench = bound.get("model_alone_benchmark") or {}
        bench_note = (f" (the benchmark stage's figure, synthetic feeds at another hour: {fmt(bench.get('value'))})"
                      if alone.get("measured") and bench.get("value") else "")
        b += [Heading("Against the host's bound", 3),
              Para(f"Served {fmt(bound.get('served_rps'))} req/s of a bound of {fmt(bound.get('bound_rps'))} "
                   f"= **{fmt(bound.get('served_vs_bound'))}**, where bound = {bound.get('formula')}: the ceiling is a "
                   f"do-nothing handler served exactly as the model is, in the same rounds and load, answering "
                   f"{fmt(bound.get('ceiling_answer_bytes'))} bytes per request as the model's answers do "
                   f"({fmt(bound.get('ceiling_rps'))} req/s; {fmt(bound.get('ceiling_empty_rps'))} with empty answers); "
                   f"the model alone is {how} "
                   f"({fmt(bound.get('model_alone_rps'))} req/s){bench_note}.")]
    if profile.get("requests"):
        b += [Para(f"Where a request's time goes inside the workers (their own timers, {profile['requests']} requests "
                   f"in {profile.get('batches')} batches under the check's load), microseconds per request:"),
              Table(["phase", "µs / request", "what"],
                    [[name, profile.get(key), what] for name, key, what in PHASE_ROWS if key in profile])]
    return b


def rerank_load_blocks(inputs: ReportInputs) -> list[Block]:
    """Task rerank (issue 26): the rerank load's rows/s against the model alone, measured in the same run
    on the same requests (else the benchmark's figure at the calls the server made, and it says so)
    (metrics/serve_check.json `rerank_load`, pipeline/serve/checks/rerank_load.py)."""
    rl = (inputs.serve_check or {}).get("rerank_load")
    if not rl:
        return []
    b: list[Block] = [Heading("Rerank load: rows/s served against the model alone", 3)]
    if rl.get("error"):
        return b + [Para(f"Not measured: {rl['error'][:300]}")]
    off = rl.get("offline") or {}
    # Records before the in-run measurement have only the benchmark's figure, under `offline`.
    bench = rl.get("offline_benchmark") if "offline_benchmark" in rl else off
    bench = bench or {}
    measured = off.get("source") == "model_alone"
    calls = ", ".join(f"{c['calls']} of {c['rows']} rows" for c in bench.get("calls") or [])
    batches = ", ".join(f"{n} of {k} request(s)" for k, n in sorted((rl.get("batches_formed") or {}).items(),
                                                                       key=lambda kv: int(kv[0])))
    text = (f"{rl.get('texts_per_query')} texts per query from {rl.get('clients')} keep-alive clients against the "
            f"winner: one request is {rl.get('rows_per_request')} model rows. TorchServe formed batches "
            f"({batches or '–'}) and the handler ran their rows in model calls of at most {rl.get('batch_rows')} "
            f"rows ({calls or '–'}). ")
    if measured:
        per_batch = ", ".join(f"{n} of {k} rows" for k, n in (off.get("model_calls_per_batch") or {}).items())
        text += (f"Offline = the served variant run alone right after the load, in this run, on the load's own "
                 f"queries: {fmt(off.get('workers'))} worker process(es) at once, {fmt(off.get('threads_per_process'))} "
                 f"thread(s) each, server batches of {fmt(off.get('batch_size'))} request(s) ({off.get('batch_basis')}) "
                 f"fanned out into model calls ({per_batch or '–'} per batch), one common "
                 f"{fmt(off.get('window_s'))}-s window. The benchmark stage's figure at the same calls (its synthetic "
                 f"feeds, at another hour) is shown beside it for comparison only.")
    else:
        text += (f"Offline = {bench.get('formula', '–')}." +
                 (f" Why this figure: {rl['offline_why']}." if rl.get("offline_why") else ""))
    rows = [["rows answered / wall (s)", f"{fmt(rl.get('rows_answered'))} / {fmt(rl.get('wall_s'))}"],
            ["served rows/s", rl.get("served_rows_per_s")],
            ["served requests/s, p50 / p99 per request (ms)",
             f"{fmt(rl.get('served_requests_per_s'))}, {fmt(rl.get('p50_ms'))} / {fmt(rl.get('p99_ms'))}"]]
    if measured:
        rows.append(["offline rows/s: the model alone on these requests, this run", rl.get("offline_rows_per_s")])
    rows.append(["offline rows/s at the served model calls (benchmark)" + (", for comparison" if measured else ""),
                 fmt(bench.get("value") if measured else rl.get("offline_rows_per_s"))])
    rows.append([f"served / offline (target ≥ {fmt(rl.get('target'))})",
                 f"**{fmt(rl.get('served_vs_offline'))}**" + ("" if rl.get("meets_target") is None else
                                                             " (met)" if rl.get("meets_target") else " (NOT met)")])
    if measured and rl.get("served_vs_offline_benchmark") is not None:
        rows.append(["served / benchmark figure (not the ratio judged)", fmt(rl.get("served_vs_offline_benchmark"))])
    return b + [Para(text), Table(["figure", "value"], rows)]


def quantized_alternative_blocks(inputs: ReportInputs) -> list[Block]:
    """The inexact variant selection held back (exact by default: int8, or a float variant that changes
    the task's answers), what it would give, the line to opt in."""
    alt = (inputs.selection or {}).get("quantized_alternative")
    if not alt:
        return []
    fig = alt.get("figures") or {}
    gate = next(iter((fig.get("task_gate") or {}).values()), {}) if isinstance(fig.get("task_gate"), dict) else {}
    gate_text = ", ".join(f"{k} {fmt(v)}" for k, v in gate.items() if isinstance(v, (int, float)) and k != "samples")
    if fig.get("answers") and not gate:
        how = f"within its float tolerance, but {fig['answers'].get('reason')}"
        title = "Held back, offline: a variant that changes the answers"
    else:
        how = f"its answers move beyond the float tolerances (task gate: {gate_text or 'see its conversion record'})"
        title = "Held back, offline: the quantized alternative"
    return [Heading(title, 3),
            Para(f"`{alt.get('variant')}` would give {fmt(fig.get('throughput_sps'))} samples/s offline at batch "
                 f"{fmt(fig.get('batch_size'))} (request p99 {fmt(fig.get('request_p99_ms'))} ms); {how}. The served "
                 f"variant stays exact; to serve it instead, set `{alt.get('opt_in')}` in params.yaml.")]


# --------------------------------------------------------------------------- start-up and memory
def load_vs_read(cold: dict) -> str:
    """A variant's load after imports against the raw read of its bytes, from the page cache and
    (when measured) from the disk."""
    ph = cold.get("phases_ms") or {}
    load = sum(as_number((ph.get(p) or {}).get("median")) or 0.0 for p in LOAD_AFTER_IMPORTS)
    text = (f"page cache: {fmt(load)} ms vs {fmt(cold.get('raw_read_ms'))} ms "
            f"({fmt(cold.get('load_floor_ratio'))}×)")
    disk = cold.get("from_disk") or {}
    if disk.get("measured"):
        text += (f"; from disk: {fmt(disk.get('load_ms'))} ms vs {fmt(disk.get('raw_read_ms'))} ms "
                 f"({fmt(disk.get('load_floor_ratio'))}×)")
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
    rows = (_store_form_rows(form, sc) + _startup_timeout_rows(st, sc) + _load_rows(inputs, sc)
            + _memory_rows(inputs, d, st, sc))
    return [Heading("Start-up and memory of the served model"), Table(["", ""], rows)]


def _store_form_rows(form, sc: dict) -> list[list]:
    """The store form configure chose, and READY from each form the serve check started."""
    rows = []
    if isinstance(form, dict):
        fi = form.get("inputs") or {}
        rows.append(["store form", f"{form.get('value')} (artifact {fmt(fi.get('artifact_mb'))} MB, folder from "
                                   f"{fmt(fi.get('folder_store_min_mb'))} MB; unpack avoided ≈ "
                                   f"{fmt(fi.get('unpack_estimate_s'))} s per start)"])
    forms = sc.get("store_forms") or {}
    for f in ("mar", "folder"):
        if isinstance(forms.get(f), dict):
            r = forms[f]
            rows.append([f"READY from the {f}" + (" (served)" if forms.get("chosen") == f else ""),
                         f"{fmt(r.get('ready_s'))} s (WorkerLoadTime {fmt(r.get('worker_load_ms'))} ms)"
                         if r.get("ready") else f"not READY: {str(r.get('error'))[:200]}"])
    return rows


def _startup_timeout_rows(st, sc: dict) -> list[list]:
    """The derived startupTimeout, what it would be on a reference disk, and READY against it."""
    rows = []
    if isinstance(st, dict):
        si = st.get("inputs") or {}
        ref = si.get("at_reference_disk") or {}
        disk_ms = si.get("cold_load_from_disk_ms")
        rows += [["startupTimeout (derived)", f"{fmt(st.get('value'))} s from a worst cold load of "
                  f"{fmt(si.get('worst_cold_load_ms', si.get('cold_load_max_ms')))} ms (page cache: max "
                  f"{fmt(si.get('cold_load_max_ms'))}, median {fmt(si.get('cold_load_median_ms'))} ms"
                  + (f"; from disk: {fmt(disk_ms)} ms" if disk_ms is not None else "")
                  + f"), read measured at {fmt(si.get('measured_read_mb_s'))} MB/s"],
                 [f"startupTimeout on a {fmt(ref.get('read_mb_s'))} MB/s disk",
                  f"{fmt(ref.get('startup_timeout_s'))} s (+{fmt(ref.get('disk_read_s'))} s to read the artifact)"]]
        if si.get("target_disk_read_mb_s"):
            rows.append(["serve.target_disk_read_mb_s", f"{fmt(si['target_disk_read_mb_s'])} MB/s "
                         f"(+{fmt(si.get('disk_read_s'))} s, included above)"])
    if sc.get("ready_s") is not None and isinstance(st, dict):
        rows.append(["READY in TorchServe vs startupTimeout", f"{fmt(sc['ready_s'])} s of {fmt(st.get('value'))} s"])
    return rows


def _load_rows(inputs: ReportInputs, sc: dict) -> list[list]:
    """READY against the server's floor, the load against the raw read, the handler's share, a miss."""
    rows = []
    vf = sc.get("ready_vs_floor") or {}
    if vf.get("ratio") is not None:
        rows.append(["READY vs server floor + raw read", f"{fmt(vf['ratio'])}× ({fmt(vf['ready_s'])} s against a "
                     f"do-nothing model's {fmt(vf['floor_ready_s'])} s with as many workers "
                     f"({vf.get('floor_workers') or 1}) + {fmt(vf['raw_read_s'])} s raw read)"])
    served = inputs.benchmarks.get(winner(inputs) or "") or {}
    if served.get("cold_load"):
        rows.append(["load after imports vs raw read of the served artifact", load_vs_read(served["cold_load"])])
    hl = sc.get("handler_load_ms") or {}
    if hl.get("total") is not None:
        floor_ms = ((sc.get("server_floor") or {}).get("worker_load_ms"))
        rows.append(["worker load (WorkerLoadTime) and the handler's part", f"{fmt(sc.get('worker_load_ms'))} ms"
                     + (f" (a do-nothing model's: {fmt(floor_ms)} ms)" if floor_ms else "") + "; handler "
                     + ", ".join(f"{k} {fmt(v)}" for k, v in hl.items()) + " ms"])
    diag = sc.get("startup_diagnosis") or {}
    if diag.get("message"):
        rows.append(["startupTimeout MISSED", diag["message"]])
    return rows


def _memory_rows(inputs: ReportInputs, d: dict, st, sc: dict) -> list[list]:
    """Peak RSS per worker (benchmark and TorchServe) against the artifact and the model's size."""
    rows = []
    workers = d.get("workers") if isinstance(d.get("workers"), dict) else {}
    rss_bench = (workers.get("inputs") or {}).get("peak_rss_mb")
    size = model_bytes(inputs)
    art = (st or {}).get("inputs", {}).get("artifact_bytes") if isinstance(st, dict) else None
    if rss_bench is not None:
        rows.append(["peak RSS per worker (benchmark → workers)",
                     f"{fmt(rss_bench)} MB; workers = {fmt(workers.get('value'))} ({workers.get('formula', '')})"])
    if sc.get("worker_peak_rss_mb") is not None:
        ratio = f", {sc['worker_peak_rss_mb'] * 2**20 / art:.2f}× the served artifact" if art else ""
        rows.append(["peak RSS per worker in TorchServe", f"{fmt(sc['worker_peak_rss_mb'])} MB{ratio}"])
    if size:
        rows.append(["model size (eager weights)", fmt_bytes(size)])
    return rows
