"""Read the bare module of a checkpoint (params `model.source`), no task wrapper yet.

- `hf`: a Hugging Face folder (config.json + model.safetensors | pytorch_model.bin, or their sharded
  form with its `*.index.json`), built by the transformers auto class the task family names.
- `state_dict`: .safetensors / .pt / .pth / .bin weights (or a sharded `*.index.json`) + `model.factory`
  that builds the module.
- `torchscript`: a TorchScript archive (.pt) loaded with torch.jit.load.

Every file is checked (pipeline/model/weights.py) before transformers or the factory runs.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

# Nothing here may reach a hub: weights come from local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch import nn

from pipeline.core.params import REPO_ROOT, Params
from pipeline.model.weights import (CheckpointError, KeyReport, _first_line, check_readable, find_hf_weights,
                                    key_problem, load_into, state_dict_files)


# --------------------------------------------------------------------------- factory
def import_factory(spec: str, base: Path = REPO_ROOT):
    """'pkg.module:fn' or 'path/to/file.py:fn' (relative to the repo root) -> the callable."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise CheckpointError(f"`model.factory` = {spec!r}: expected 'pkg.module:function' or "
                              f"'path/to/file.py:function'")
    if target.endswith(".py"):
        file = Path(target).expanduser()
        file = file if file.is_absolute() else base / file
        if not file.is_file():
            raise CheckpointError(f"`model.factory` = {spec!r}: file {file} not found; the path is relative "
                                  f"to the repo root ({base})")
        mod_name = "_factory_" + "_".join(file.with_suffix("").parts[-3:]).replace("-", "_").replace(".", "_")
        module_spec = importlib.util.spec_from_file_location(mod_name, file)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module   # dataclasses/pickling inside the file look themselves up here
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise CheckpointError(f"`model.factory` = {spec!r}: importing {file} failed: "
                                  f"{type(e).__name__}: {e}") from None
    else:
        if str(base) not in sys.path:
            sys.path.insert(0, str(base))
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise CheckpointError(f"`model.factory` = {spec!r}: cannot import module `{target}` "
                                  f"({type(e).__name__}: {e}); install the package or fix the name") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise CheckpointError(f"`model.factory` = {spec!r}: `{target}` has no attribute `{attr}`")
    if not callable(fn):
        raise CheckpointError(f"`model.factory` = {spec!r}: `{attr}` is a {type(fn).__name__}, not callable")
    return fn


def build_from_factory(spec: str, kwargs: dict) -> nn.Module:
    fn = import_factory(spec)
    try:
        module = fn(**kwargs)
    except Exception as e:
        raise CheckpointError(f"`model.factory` = {spec!r} failed when called with "
                              f"`model.factory_kwargs` = {kwargs!r}: {type(e).__name__}: {e}") from None
    if not isinstance(module, nn.Module):
        raise CheckpointError(f"`model.factory` = {spec!r} returned a {type(module).__name__}; "
                              f"it must return a torch.nn.Module")
    return module


# --------------------------------------------------------------------------- sources
def _quiet_transformers():
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _load_hf(params: Params, folder: Path, hf_class: str) -> tuple[nn.Module, list[Path], KeyReport]:
    if not folder.is_dir():
        raise CheckpointError(f"`model.checkpoint` = {params.model.checkpoint!r} -> {folder}: not a folder; "
                              f"source 'hf' needs a Hugging Face model folder (config.json + weights)")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: config.json is missing; source 'hf' needs a Hugging Face model folder")
    weights = find_hf_weights(folder)
    # Check the files ourselves first (headers, weights_only unpickling, no tensor data read): clear
    # errors, and a .bin never gets full unpickling. transformers then reads shard by shard into a
    # model built without memory (meta device) — peak memory near one copy, sharded or not.
    check_readable(weights, trust=params.model.trust_checkpoint)
    auto = getattr(_quiet_transformers(), hf_class)
    try:
        model, info = auto.from_pretrained(str(folder), local_files_only=True, output_loading_info=True,
                                           torch_dtype=torch.float32)
    except Exception as e:
        raise CheckpointError(f"{folder}: transformers could not build the model: {type(e).__name__}: "
                              f"{_first_line(e)}") from None
    report = KeyReport(source=f"{weights.describe()} (for {folder / 'config.json'})",
                       fix="Use the weights that belong to this config.",
                       unexpected=sorted(info.get("unexpected_keys") or []),
                       mismatched=sorted(str(k) for k in (info.get("mismatched_keys") or [])))
    if report.mismatched:
        raise CheckpointError(key_problem(report, sorted(info.get("missing_keys") or [])))
    state = model.state_dict(keep_vars=True)
    report.missing = {k: state[k] for k in sorted(info.get("missing_keys") or []) if k in state}
    return model, [folder / "config.json", *weights.paths], report


def load_module(params: Params, path: Path, hf_class: str) -> tuple[nn.Module, list[Path], Optional[KeyReport]]:
    """The bare module, its source files, and how its keys matched (None: nothing to judge).
    `hf_class`: the transformers auto class (e.g. 'AutoModel') an `hf` folder is built with."""
    m = params.model
    if m.source == "hf":
        return _load_hf(params, path, hf_class)
    if m.source == "state_dict":
        files = state_dict_files(path)
        check_readable(files, trust=m.trust_checkpoint)     # before the factory: fail fast, no code
        module = build_from_factory(m.factory, dict(m.factory_kwargs))
        report = load_into(module, files, m.trust_checkpoint,
                           fix="Fix `model.factory` / `model.factory_kwargs` so the architecture matches the checkpoint.")
        return module, files.paths, report
    # torchscript
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}; check `model.checkpoint` in params.yaml")
    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except Exception as e:
        raise CheckpointError(f"{path}: not a loadable TorchScript archive ({type(e).__name__}: {_first_line(e)}); "
                              f"save it with torch.jit.save, or use source 'state_dict' with a factory") from None
    return module, [path], None


def load_eval(params: Params, path: Path, hf_class: str) -> tuple[nn.Module, list[Path], Optional[KeyReport]]:
    """`load_module`, then eval() and fp32 (a TorchScript module keeps its dtypes)."""
    module, sources, report = load_module(params, path, hf_class)
    module = module.float().eval() if not isinstance(module, torch.jit.ScriptModule) else module.eval()
    return module, sources, report
