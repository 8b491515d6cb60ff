"""Read checkpoint weights safely and close to the disk: single files and sharded checkpoints.

Formats: `.safetensors`, and torch pickles (`.bin`, `.pt`, `.pth`) read with
`torch.load(weights_only=True)` — a pickle that needs more than tensors and plain containers is
refused (no code of it runs) unless `model.trust_checkpoint: true`. A sharded checkpoint is the
index transformers writes (`model.safetensors.index.json` / `pytorch_model.bin.index.json`: a
`weight_map` of key -> shard file) plus its shards; every shard obeys the same rules.

Memory: safetensors and zip-format torch files are memory-mapped (tensors backed by the file's
pages, read on first touch), shards are read one at a time, and `load_into` assigns the mapped
tensors into the module (`load_state_dict(assign=True)`): peak memory stays near one copy of the
model whatever the number of shards.

Keys are judged by what the task computes (`judge_missing`): a weight the checkpoint lacks is an
error only when it feeds the task's outputs (found with autograd on one small forward: a parameter
the outputs do not depend on gets no gradient); an unused one (BERT's pooler under a
text-embedding head) is logged and zeroed (random initial values would make every load, and
so every artifact, different).
"""
from __future__ import annotations

import json
import logging
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

log = logging.getLogger(__name__)

STATE_DICT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
INDEX_SUFFIX = ".index.json"
# A Hugging Face folder's weights, in the order transformers prefers them.
HF_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded; the message names the file/key problem and the fix."""


@dataclass
class WeightFiles:
    """Where a checkpoint's tensors are: one file, or an index and its shards (in index order)."""
    files: list[Path]
    index: Optional[Path] = None

    @property
    def sharded(self) -> bool:
        return self.index is not None

    @property
    def paths(self) -> list[Path]:
        """Every file that makes up the checkpoint (provenance, DVC hashing)."""
        return ([self.index] if self.index else []) + self.files

    @property
    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)

    def describe(self) -> str:
        return str(self.files[0]) if not self.sharded else f"{self.index} ({len(self.files)} shards)"


# --------------------------------------------------------------------------- locating files
def read_index(index: Path) -> WeightFiles:
    """Shards named by a transformers index file; each must exist beside it."""
    try:
        doc = json.loads(index.read_text())
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise KeyError("weight_map")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint index not found: {index}; check `model.checkpoint`") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a checkpoint index (a JSON object with a non-empty `weight_map` "
                              f"of tensor name -> shard file; {type(e).__name__}: {e}); copy it again") from None
    names = list(dict.fromkeys(str(v) for v in weight_map.values()))    # first-seen order
    files = [index.parent / n for n in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index} names {len(missing)} shard(s) that are not beside it: {', '.join(missing[:5])}; "
                              f"copy every shard of the checkpoint into {index.parent}")
    bad = [f.name for f in files if f.suffix not in STATE_DICT_SUFFIXES]
    if bad:
        raise CheckpointError(f"{index}: shard(s) {', '.join(bad[:5])} are not one of {', '.join(STATE_DICT_SUFFIXES)}")
    return WeightFiles(files=files, index=index)


def find_hf_weights(folder: Path) -> WeightFiles:
    """The weights of a Hugging Face folder: a single file first, else a sharded index."""
    for name in HF_SINGLE_FILES:
        if (folder / name).is_file():
            return WeightFiles([folder / name])
    for name in HF_INDEX_FILES:
        if (folder / name).is_file():
            return read_index(folder / name)
    shards = sorted(folder.glob("model-*.safetensors")) + sorted(folder.glob("pytorch_model-*.bin"))
    if shards:
        raise CheckpointError(f"{folder}: shard files ({shards[0].name}, …) without their index "
                              f"(model.safetensors.index.json or pytorch_model.bin.index.json); copy the index too")
    raise CheckpointError(f"{folder}: no model.safetensors or pytorch_model.bin (nor a sharded index); point "
                          f"`model.checkpoint` at a Hugging Face model folder")


def state_dict_files(path: Path) -> WeightFiles:
    """`model.checkpoint` of source state_dict: one weights file, or a `*.index.json` of shards."""
    if path.is_dir():
        raise CheckpointError(f"`model.checkpoint` -> {path} is a folder; source 'state_dict' needs one "
                              f"weights file ({', '.join(STATE_DICT_SUFFIXES)}) or a sharded `*{INDEX_SUFFIX}`")
    if path.name.endswith(INDEX_SUFFIX):
        return read_index(path)
    if path.suffix not in STATE_DICT_SUFFIXES:
        raise CheckpointError(f"`model.checkpoint` -> {path}: suffix {path.suffix!r} is not one of "
                              f"{', '.join(STATE_DICT_SUFFIXES)} (or a sharded `*{INDEX_SUFFIX}`)")
    return WeightFiles([path])


# --------------------------------------------------------------------------- safe reading
def _trust_hint(path: Path) -> str:
    return (f"Re-save the weights as .safetensors (or a plain state_dict of tensors), or, only if you "
            f"trust whoever made {path.name}, set `model.trust_checkpoint: true` in params.yaml — "
            f"that runs code stored in the file (dangerous).")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def read_weights(path: Path, trust: bool = False) -> dict[str, torch.Tensor]:
    """A flat {key: tensor} from .safetensors or a torch pickle, without running code from it.
    Tensors are memory-mapped where the format allows (safetensors, zip-format torch files)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}; check `model.checkpoint` in params.yaml")
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    obj = _torch_load(path, trust)
    return _as_state_dict(obj, path)


def check_readable(files: WeightFiles, trust: bool = False) -> None:
    """Cheap safety/integrity check before a library reads the files: safetensors headers (offsets
    must cover the file: catches truncation), torch pickles unpickled memory-mapped with
    weights_only (refuses code, reads no tensor data)."""
    from safetensors import safe_open
    for path in files.files:
        if path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt") as f:
                    f.keys()
            except Exception as e:
                raise CheckpointError(_corrupt_safetensors(path, e)) from None
        else:
            _as_state_dict(_torch_load(path, trust), path)


def _corrupt_safetensors(path: Path, e: BaseException) -> str:
    return (f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); the file is truncated "
            f"or corrupt — download/copy it again")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    try:
        return load_file(str(path), device="cpu")     # storages map the file (copy-on-write)
    except Exception as e:  # SafetensorError, OSError: truncated header/data, bad JSON header
        raise CheckpointError(_corrupt_safetensors(path, e)) from None


def _torch_load(path: Path, trust: bool) -> Any:
    is_zip = zipfile.is_zipfile(path)
    if not is_zip and path.stat().st_size == 0:
        raise CheckpointError(f"{path}: file is empty; copy the checkpoint again")
    try:
        # mmap needs the zip format (torch >= 1.6's default); legacy files are read whole.
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError as e:
        if not trust:
            raise CheckpointError(
                f"{path}: refused to unpickle: the file needs more than tensors and plain containers "
                f"to load ({_first_line(e)}), so loading it would run code stored in it. "
                + _trust_hint(path)) from None
        log.warning("model.trust_checkpoint is true: unpickling %s with full pickle (runs its code)", path)
        try:
            return torch.load(str(path), map_location="cpu", weights_only=False)
        except Exception as e2:
            raise CheckpointError(f"{path}: could not be loaded even as a trusted pickle: {e2}") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        raise CheckpointError(
            f"{path}: not a readable torch checkpoint ({type(e).__name__}: {_first_line(e)}); the file is "
            f"truncated or corrupt — copy it again, or re-save it with torch.save(model.state_dict(), ...)"
        ) from None


def _as_state_dict(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(obj, nn.Module):          # only reachable with trust_checkpoint
        obj = obj.state_dict()
    if isinstance(obj, dict):
        # Common training-script wrappers: {"state_dict": {...}}, {"model": {...}}.
        for wrapper in ("state_dict", "model_state_dict", "model"):
            inner = obj.get(wrapper)
            if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                obj = inner
                break
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if tensors and len(tensors) == len(obj):
            return tensors
        if tensors:
            others = sorted(str(k) for k, v in obj.items() if not isinstance(v, torch.Tensor))
            raise CheckpointError(f"{path}: mixes tensors with other entries ({', '.join(others[:10])}); "
                                  f"save only model.state_dict()")
    raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state_dict of tensors; "
                          f"save it with torch.save(model.state_dict(), path) or as .safetensors")


def iter_shards(files: WeightFiles, trust: bool = False) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    """(file, its tensors) one file at a time; the caller drops each before the next is read."""
    for path in files.files:
        yield path, read_weights(path, trust)


# --------------------------------------------------------------------------- loading into a module
@dataclass
class KeyReport:
    """How a checkpoint's keys matched a module. `missing` maps each absent key to the module's own
    tensor (still at its initial value), so the task's use of it can be judged after wrapping."""
    source: str                                      # what was loaded (for messages)
    fix: str                                         # what the user should change when it does not fit
    missing: dict[str, torch.Tensor] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


def load_into(module: nn.Module, files: WeightFiles, trust: bool, fix: str) -> KeyReport:
    """Load shard by shard with assign=True (the module's tensors become the mapped ones: no second
    copy). Shape mismatches raise at once (listing all); missing keys are returned for judging."""
    expected = module.state_dict()
    report = KeyReport(source=files.describe(), fix=fix)
    seen: set[str] = set()
    for path, shard in iter_shards(files, trust):
        report.mismatched += [f"{k} (checkpoint {tuple(t.shape)} vs model {tuple(expected[k].shape)})"
                              for k, t in shard.items() if k in expected and tuple(t.shape) != tuple(expected[k].shape)]
        report.unexpected += [k for k in shard if k not in expected]
        if not report.mismatched:
            module.load_state_dict({k: t for k, t in shard.items() if k in expected}, strict=False, assign=True)
        seen.update(k for k in shard if k in expected)
        del shard
    report.mismatched.sort()
    report.unexpected.sort()
    if report.mismatched:
        raise CheckpointError(key_problem(report, sorted(set(expected) - seen)))
    state = module.state_dict(keep_vars=True)
    report.missing = {k: state[k] for k in sorted(set(expected) - seen)}
    return report


def key_problem(report: KeyReport, missing: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"missing keys ({len(missing)}): {listing(missing)} (they feed the task's outputs)")
    if report.unexpected:
        parts.append(f"unexpected keys ({len(report.unexpected)}): {listing(report.unexpected)}")
    if report.mismatched:
        parts.append(f"shape mismatches ({len(report.mismatched)}): {listing(report.mismatched)}")
    return f"{report.source} does not match the model: " + "; ".join(parts) + ". " + report.fix


def listing(keys: list[str], limit: int = 20) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", … (+{len(keys) - limit} more)" if len(keys) > limit else "")


def unused_by_outputs(module: nn.Module, tensors: dict[str, torch.Tensor], example_args: tuple) -> list[str]:
    """Names in `tensors` (tensors of `module`) that the outputs of `module(*example_args)` do not
    depend on: autograd gives them no gradient. Only these tensors track gradients, so the cost is
    one small forward. A non-float tensor cannot be traced this way and counts as used."""
    candidates = {k: t for k, t in tensors.items() if t.is_floating_point()}
    if not candidates:
        return []
    flags = {p: p.requires_grad for p in module.parameters()}
    try:
        for p in module.parameters():
            p.requires_grad_(False)
        leaves = []
        for t in candidates.values():
            t.requires_grad_(True)
            leaves.append(t)
        with torch.enable_grad():
            out = module(*example_args)
            outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                    if isinstance(o, torch.Tensor) and o.is_floating_point()]
            if not outs or not any(o.requires_grad for o in outs):
                return sorted(candidates)
            total = sum(o.float().sum() for o in outs if o.requires_grad)
            grads = torch.autograd.grad(total, leaves, allow_unused=True)
        return sorted(k for k, g in zip(candidates, grads) if g is None)
    finally:
        for t in candidates.values():
            if not isinstance(t, nn.Parameter):
                t.requires_grad_(False)
        for p, flag in flags.items():
            p.requires_grad_(flag)


def judge_missing(report: KeyReport, task_module: nn.Module, example_args: tuple, task: str) -> None:
    """Raise when a missing key feeds the task's outputs; log the ones that do not (and unexpected keys)."""
    if report.missing:
        unused = set(unused_by_outputs(task_module, report.missing, example_args))
        used = [k for k in report.missing if k not in unused]
        if used:
            raise CheckpointError(key_problem(report, used) + " Those weights would be random.")
        # Zeroed, not left at their random initial values: every process then builds the same
        # module, so the artifacts are reproducible and the shared ONNX export (keyed by the
        # weights' bytes) is found by the next conversion.
        with torch.no_grad():
            for key in unused:
                report.missing[key].zero_()
        log.info("%s lacks %d weight(s) that task %r never uses (zeroed): %s",
                 report.source, len(unused), task, listing(sorted(unused), 10))
    if report.unexpected:
        log.info("ignoring %d checkpoint key(s) the model does not have: %s", len(report.unexpected),
                 listing(report.unexpected, 5))


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (shared tensors counted once): the model's size."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
