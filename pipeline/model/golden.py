"""The golden set: deterministic inputs and the eager fp32 reference outputs (artifacts/golden/).

Inputs are made through the task adapter from its example requests (`handlers.tasks`), so the HTTP
parity check later sends the very same requests. Layout (docs/artifacts.md):
- `golden.json`: {"task", "batches": [{"file", "batch_size"}], "inputs", "outputs", ...}
- `batch_<k>_b<size>.npz`: `in.<input>` and `out.<output>` arrays
- `http_cases.json`: [{"id", "content_type", "body" | "body_file", "expected"}]
- the task's extra files (tokenizer.json, labels.json) so converters can copy them into variants.
Files are byte-for-byte reproducible (fixed zip timestamps), so DVC sees no change on a re-run.
"""
from __future__ import annotations

import io
import json
import logging
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from handlers.tasks import TaskAdapter, make_adapter
from pipeline.model.loaded import LoadedModel
from pipeline.core.params import Params

log = logging.getLogger(__name__)

GOLDEN_JSON = "golden.json"
HTTP_CASES_JSON = "http_cases.json"
HTTP_BODIES = "http"
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


@dataclass
class GoldenBatch:
    file: str
    batch_size: int
    feeds: dict[str, np.ndarray]          # input name -> batch-first array
    outputs: list[np.ndarray]             # in Golden.outputs order, float32


@dataclass
class Golden:
    dir: Path
    task: dict
    inputs: list[dict]                    # [{"name", "dtype", "dynamic_axes"}]
    outputs: list[str]
    batches: list[GoldenBatch]
    http_cases: list[dict] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)

    @property
    def input_names(self) -> list[str]:
        return [i["name"] for i in self.inputs]

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({b.batch_size for b in self.batches})

    def adapter(self) -> TaskAdapter:
        """The task adapter over this folder's extra files (tokenizer.json, labels.json)."""
        return make_adapter(self.dir, self.task)


def batch_plan(batch_sizes: list[int], golden_batches: int) -> list[int]:
    """Batch 1 and the largest size get `golden_batches` distinct batches each; other listed sizes one
    each (cheap, and they catch a trace that only works at its trace batch size)."""
    sizes = sorted(set(batch_sizes) | {1})
    largest = sizes[-1]
    plan: list[int] = []
    for size in sizes:
        plan += [size] * (max(1, golden_batches) if size in (1, largest) else 1)
    return plan


def run_reference(loaded: LoadedModel, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Eager fp32 outputs for a feeds dict, as float32 numpy arrays in `loaded.outputs` order."""
    with torch.inference_mode():
        out = loaded.module(*loaded.example_inputs(feeds))
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    if len(outs) != len(loaded.outputs):
        raise RuntimeError(f"model returned {len(outs)} outputs, expected {len(loaded.outputs)} ({loaded.outputs})")
    return [o.detach().float().cpu().numpy() for o in outs]


class ActivationRange(torch.overrides.TorchFunctionMode):
    """The largest |value| any op of the eager fp32 model produces over the golden set, and where.

    Half precision tops out at 65504: a variant that holds such a value in fp16 overflows to inf on
    any device that really computes in fp16, even where the build machine's runtime silently
    upcasts (ONNX Runtime's CPU provider runs most fp16 ops in fp32). Every torch op is seen (a
    function mode, so functional code and tensor arithmetic count, not only module outputs); module
    hooks name the module it happened in. Checked by every fp16 variant
    (pipeline.accuracy.verify.fp16_range_violation)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.max_abs: dict[str, float] = {}
        self._where: list[str] = []
        self._handles = []
        for name, m in module.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._enter(name or "<model>")))
            self._handles.append(m.register_forward_hook(self._leave))

    # Hooks must return None: a value would replace the module's input/output.
    def _enter(self, name: str):
        def hook(_module, _args) -> None:
            self._where.append(name)
        return hook

    def _leave(self, _module, _args, _output) -> None:
        if self._where:
            self._where.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                value = float(t.detach().abs().max())
                if value >= torch.finfo(t.dtype).max / 2:
                    continue   # a masking sentinel (attention masks filled with finfo.min), not an activation
                key = f"{self._where[-1] if self._where else '<model>'}: {getattr(func, '__name__', str(func))}"
                if value > self.max_abs.get(key, 0.0):
                    self.max_abs[key] = value
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def summary(self, top: int = 5) -> dict:
        ranked = sorted(self.max_abs.items(), key=lambda kv: -kv[1])[:top]
        return {"max_abs": ranked[0][1] if ranked else 0.0,
                "top_modules": [{"module": n, "max_abs": v} for n, v in ranked]}


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like np.savez, but with fixed zip timestamps so identical arrays give identical bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_TIME), buf.getvalue())


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")


def _clear(out_dir: Path) -> None:
    if out_dir.exists():
        if any(out_dir.iterdir()) and not (out_dir / GOLDEN_JSON).exists():
            raise FileExistsError(f"{out_dir} is not empty and holds no {GOLDEN_JSON}; refusing to overwrite it")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)


def _http_case(case_id: str, body: bytes, content_type: str, expected, out_dir: Path) -> dict:
    case = {"id": case_id, "content_type": content_type}
    if content_type.startswith("text/") or content_type == "application/json":
        case["body"] = body.decode("utf-8")
    else:
        suffix = {"image/png": ".png", "image/jpeg": ".jpg", "application/x-npy": ".npy"}.get(content_type, ".bin")
        rel = f"{HTTP_BODIES}/{case_id}{suffix}"
        (out_dir / HTTP_BODIES).mkdir(exist_ok=True)
        (out_dir / rel).write_bytes(body)
        case["body_file"] = rel
    case["expected"] = expected
    return case


def write_golden(params: Params, loaded: LoadedModel, out_dir: str | Path) -> Golden:
    out_dir = Path(out_dir)
    _clear(out_dir)
    for name, src in loaded.extra_files.items():
        shutil.copyfile(src, out_dir / name)
    adapter = make_adapter(out_dir, loaded.task)
    plan = batch_plan(params.benchmark.batch_sizes, params.conversion.golden_batches)
    requests = adapter.example_requests(sum(plan), seed=params.conversion.golden_seed)
    log.info("golden set: %d batches (sizes %s), %d requests", len(plan), plan, len(requests))

    # One request may be many model rows (a rerank query and its texts): the golden batches are the
    # plan's sizes in ROWS; a request's HTTP case is answered from its rows' reference outputs.
    decoded = [adapter.decode_request(body, ct) for body, ct in requests]
    rows = [(row, r) for r, d in enumerate(decoded) for row in d.rows]
    total = sum(plan)
    row_outputs: list = [None] * len(rows)
    first_at: dict = {}                     # request -> (batch k, position) of its first row
    batches, cases, entries, cursor = [], [], [], 0
    activations = ActivationRange(loaded.module)
    for k, size in enumerate(plan):
        chunk = rows[cursor:cursor + size]
        feeds = adapter.collate([row for row, _ in chunk])
        with activations:
            outputs = run_reference(loaded, feeds)
        file = f"batch_{k:03d}_b{size}.npz"
        arrays = {f"in.{n}": a for n, a in feeds.items()}
        arrays.update({f"out.{n}": a for n, a in zip(loaded.outputs, outputs)})
        _save_npz(out_dir / file, arrays)
        entries.append({"file": file, "batch_size": size})
        batches.append(GoldenBatch(file, size, feeds, outputs))
        for j, (_, r) in enumerate(chunk):
            row_outputs[cursor + j] = [o[j] for o in outputs]
            first_at.setdefault(r, (k, j))
        cursor += size
    # The rest of the last request the batches reached: one more reference run, not a golden batch.
    last = rows[total - 1][1]
    rest = [i for i in range(total, len(rows)) if rows[i][1] == last]
    if rest:
        outputs = run_reference(loaded, adapter.collate([rows[i][0] for i in rest]))
        for j, i in enumerate(rest):
            row_outputs[i] = [o[j] for o in outputs]
    for r in range(last + 1):
        outs = [row_outputs[i] for i, (_, owner) in enumerate(rows) if owner == r]
        k, j = first_at[r]
        body, ct = requests[r]
        cases.append(_http_case(f"b{k:03d}-{j:02d}", body, ct, adapter.respond_request(outs, decoded[r].meta),
                                out_dir))
    activations.close()

    manifest = {
        "model": params.model.name,
        "task": loaded.task,
        "batches": entries,
        "inputs": [spec.as_dict() for spec in loaded.inputs],
        "outputs": [{"name": n} for n in loaded.outputs],
        "batch_sizes": sorted(set(plan)),
        "seed": params.conversion.golden_seed,
        "files": sorted(loaded.extra_files),
        "http_cases": HTTP_CASES_JSON,
        "activation_range": activations.summary(),
    }
    _write_json(out_dir / HTTP_CASES_JSON, cases)
    _write_json(out_dir / GOLDEN_JSON, manifest)
    return Golden(out_dir, loaded.task, manifest["inputs"], list(loaded.outputs), batches, cases, manifest)


def read_golden(golden_dir: str | Path) -> Golden:
    golden_dir = Path(golden_dir)
    manifest_file = golden_dir / GOLDEN_JSON
    if not manifest_file.is_file():
        raise FileNotFoundError(f"{manifest_file} not found; run `python -m stages.prepare` first")
    manifest = json.loads(manifest_file.read_text())
    inputs = [i["name"] for i in manifest["inputs"]]
    outputs = [o["name"] for o in manifest["outputs"]]
    batches = []
    for entry in manifest["batches"]:
        with np.load(golden_dir / entry["file"], allow_pickle=False) as npz:
            feeds = {n: npz[f"in.{n}"] for n in inputs}
            outs = [npz[f"out.{n}"] for n in outputs]
        batches.append(GoldenBatch(entry["file"], int(entry["batch_size"]), feeds, outs))
    cases_file = golden_dir / manifest.get("http_cases", HTTP_CASES_JSON)
    cases = json.loads(cases_file.read_text()) if cases_file.is_file() else []
    return Golden(golden_dir, manifest["task"], manifest["inputs"], outputs, batches, cases, manifest)
