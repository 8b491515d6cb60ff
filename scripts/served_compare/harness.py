"""The check's run: params for the model, the eager (or another) variant built and served in a real
TorchServe, or the handler's adapter in this process, the requests posted concurrently, each answer
judged against its reference, a JSON summary."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from scripts.served_compare.cases import CASES, TASKS, Case
from scripts.served_compare.judging import ATOL, judge
from scripts.served_compare.references import REFERENCE_NAMES, reference_for
from scripts.served_compare.summary import summarize

REPO_ROOT = Path(__file__).resolve().parents[2]


def params_for(args) -> Any:
    import yaml

    from pipeline.core.params import parse_params
    if args.params:
        data = yaml.safe_load(Path(args.params).read_text())
        data["model"]["name"] = "cc-" + str(data["model"].get("name", "model"))
    else:
        data = {"model": {"name": f"cc-{args.task}", "source": "hf", "checkpoint": str(Path(args.folder).resolve()),
                          "task": args.task}}
        if args.task != "image-classification":
            data["model"]["text"] = {"max_length": args.max_length}
    data["variants"] = list(dict.fromkeys(["eager", args.variant]))
    data["benchmark"] = {**(data.get("benchmark") or {}), "batch_sizes": [1, 4]}
    data["conversion"] = {**(data.get("conversion") or {}), "golden_batches": 1}
    return parse_params(data)


def context_for(task: str, params, task_map: dict, folder: Optional[Path]) -> dict:
    ctx: dict = {}
    if task == "token-classification":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.no_truncation()
        tok.no_padding()
        ctx["fits"] = lambda t: len(tok.encode(t).ids) <= params.model.text.max_length
        ctx["default_strategy"] = task_map.get("aggregation_strategy", "simple")
    if task == "image-classification":
        ctx["num_classes"] = int(task_map["num_classes"])
    return ctx


def post_concurrently(post: Callable[[bytes, str], tuple], cases: list[Case], clients: int) -> None:
    with ThreadPoolExecutor(clients) as pool:
        for case, served in zip(cases, pool.map(lambda c: post(c.body, c.content_type), cases)):
            case.served = served


def in_process_post(loaded, folder: Optional[Path], rows_per_call: int = 4) -> Callable[[bytes, str], tuple]:
    """The serving handler's steps on the eager module, in this process: decode, fan rows out in calls of
    `rows_per_call`, gather, respond (a 4xx as TorchServe's handler answers it)."""
    import torch

    from handlers.tasks import RequestError, make_adapter
    adapter = make_adapter(folder if folder is not None else Path("."), loaded.task)

    def post(body: bytes, content_type: str):
        try:
            decoded = adapter.decode_request(body, content_type)
        except RequestError as e:
            return e.status, {"error": str(e)}
        outs = []
        for s in range(0, len(decoded.rows), rows_per_call):
            feeds = adapter.collate(decoded.rows[s:s + rows_per_call])
            with torch.no_grad():
                result = loaded.module(*loaded.example_inputs(feeds))
            logits = (result[0] if isinstance(result, (tuple, list)) else result).numpy()
            outs += [[logits[j]] for j in range(logits.shape[0])]
        return 200, json.loads(json.dumps(adapter.respond_request(outs, decoded.meta)))
    return post


def compare(task: str, cases: list[Case], reference, atol: float = ATOL) -> dict:
    for case in cases:
        case.want = reference(case)
        judge(case, atol)
    return summarize(cases)


def _commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO_ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args) -> dict:
    """Build, serve, ask, compare; the workdir (artifacts, the server's logs) is removed unless --workdir."""
    root = Path(args.workdir or tempfile.mkdtemp(prefix="served-vs-transformers-"))
    try:
        return _run(args, root)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


def _run(args, root: Path) -> dict:
    params = params_for(args)
    task = params.model.task
    if task not in TASKS:
        raise SystemExit(f"task {task!r}: this check covers {', '.join(TASKS)}")
    folder = Path(args.folder).resolve() if args.folder else None
    if folder is None and params.model.source == "hf":
        from pipeline.core.params import checkpoint_path
        folder = checkpoint_path(params)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    batches: dict[str, int] = {}
    if args.in_process:
        from pipeline.model.checkpoint import load_model
        loaded = load_model(params)
        task_map, ts = loaded.task, None
        post = in_process_post(loaded, folder)
    else:
        from pipeline.serve.variant_server import serve_variant
        served = serve_variant(params, root, variant=args.variant)
        task_map, ts = served.golden.task, served.ts
    timings["build_s"] = time.monotonic() - t0
    cases = CASES[task](args.requests, random.Random(args.seed), context_for(task, params, task_map, folder))
    t1 = time.monotonic()
    if ts is None:
        post_concurrently(post, cases, args.clients)
    else:
        with ts:
            ids: list = []

            def post(body, ct):
                r = ts.api.predict(body, ct)
                ids.append(r.request_id)
                try:
                    return r.status, r.json()
                except ValueError:
                    return r.status, r.body[:300].decode("utf-8", "replace")
            post_concurrently(post, cases, args.clients)
            timings["ready_s"] = ts.readiness.ready_s if ts.readiness else None
            batches = {str(k): v for k, v in sorted(ts.log.batch_sizes_for(ids).items())}
    timings["serve_s"] = time.monotonic() - t1
    t2 = time.monotonic()
    reference = reference_for(task, params, task_map, folder)
    summary = compare(task, cases, reference, args.atol)
    timings["reference_s"] = time.monotonic() - t2
    described = REFERENCE_NAMES[type(reference).__name__].format(task=task)
    return {"task": task, "model": str(folder or params.model.checkpoint), "variant": args.variant,
            "served": "in-process adapter" if args.in_process else "TorchServe 0.12 (4 clients, batch 4)",
            "reference": described, "seed": args.seed, "atol": args.atol, "commit": _commit(),
            "date": time.strftime("%Y-%m-%d"), **summary, "batches_formed": batches, "timings_s": timings}
