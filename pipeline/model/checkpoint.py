"""Load a checkpoint safely and wrap it as a task model with named, batch-first inputs/outputs.

Sources (params `model.source`):
- `hf`: a Hugging Face folder (config.json + model.safetensors | pytorch_model.bin, or their sharded
  form with its `*.index.json`; tokenizer.json).
- `state_dict`: .safetensors / .pt / .pth / .bin weights (or a sharded `*.index.json`) + `model.factory`
  that builds the module.
- `torchscript`: a TorchScript archive (.pt) loaded with torch.jit.load.

Safety: weights are read with safetensors or `torch.load(weights_only=True)`. A pickle that needs
more than tensors and plain containers is refused (no code of it runs) unless the user sets
`model.trust_checkpoint: true`. Every problem (missing/corrupt file, a missing weight that feeds the
task's outputs, mis-shaped keys, factory not importable) is a `CheckpointError` raised before any
conversion starts; missing weights the task never uses and unexpected keys are logged (pipeline/model/weights.py).

The returned module takes tensors in `LoadedModel.inputs` order and returns a tensor or a tuple of
tensors in `LoadedModel.outputs` order; the task wrappers avoid Python ints taken from shapes so
tracing/export keeps the batch (and sequence) dimension dynamic.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

# Nothing here may reach a hub: weights come from local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch import nn

from pipeline.core.params import REPO_ROOT, Params, ParamsError, checkpoint_path
# Weight reading lives in pipeline.model.weights; re-exported here for callers of the checkpoint API.
from pipeline.model.weights import (STATE_DICT_SUFFIXES, CheckpointError, KeyReport, _first_line,  # noqa: F401
                              check_readable, find_hf_weights, judge_missing, key_problem, load_into,
                              read_weights, state_dict_files)

from handlers.pooling import POOLINGS, pool
from pipeline.model import text_tasks
from pipeline.model.loaded import InputSpec, LoadedModel, free_memory  # noqa: F401  (re-exported)
from pipeline.model.sentence_folder import read_sentence_folder, tokenizer_settings
from pipeline.model.text_tasks import TEXT_HEAD_TASKS

log = logging.getLogger(__name__)


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


# --------------------------------------------------------------------------- task wrappers
class TextEmbeddingModel(nn.Module):
    """HF encoder (or decoder backbone) + the folder's pooling over attention_mask (+ L2
    normalisation), as sentence-transformers computes them (handlers/pooling.py)."""

    def __init__(self, encoder: nn.Module, pooling: str = "mean", normalize: bool = True):
        super().__init__()
        if pooling not in POOLINGS:
            raise CheckpointError(f"text-embedding pooling {pooling!r} is not supported ({', '.join(POOLINGS)})")
        self.encoder = encoder
        self.pooling = pooling
        self.normalize = normalize
        # Decided once here, not per call: e.g. DistilBERT takes no token_type_ids; a decoder
        # backbone takes use_cache, which an embedding never needs (no KV cache in the graph).
        accepted = inspect.signature(encoder.forward).parameters
        self.pass_token_types = "token_type_ids" in accepted
        self.no_cache = "use_cache" in accepted

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kwargs = {"use_cache": False} if self.no_cache else {}
        # token_type_ids explicit: the encoder's own default slices a buffer by a shape-derived int.
        if self.pass_token_types:
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return pool(out.last_hidden_state, attention_mask, self.pooling, self.normalize)


class OutputsAsTuple(nn.Module):
    """Turn a model's output (tensor / tuple / dict / HF ModelOutput) into a tensor or a tuple of tensors."""

    def __init__(self, model: nn.Module, keys: list[str] | None = None, pick: str | None = None):
        super().__init__()
        self.model = model
        self.keys = keys        # dict-like outputs: which entries, in order
        self.pick = pick        # HF outputs: one attribute (e.g. 'logits')

    def forward(self, x: torch.Tensor):
        out = self.model(x)
        if self.pick is not None:
            return getattr(out, self.pick) if not isinstance(out, dict) else out[self.pick]
        if self.keys is not None:
            return tuple(out[k] for k in self.keys)
        return out


def _describe_outputs(module: nn.Module, example: torch.Tensor) -> tuple[list[str], list[str] | None]:
    """Run once to find output names: tensor -> ['output'], tuple -> output_0.., dict -> its keys."""
    with torch.inference_mode():
        out = module(example)
    if isinstance(out, torch.Tensor):
        return ["output"], None
    if isinstance(out, dict):
        keys = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
        return keys, keys
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        return [f"output_{i}" for i in range(len(out))], None
    raise CheckpointError(f"the model returns {type(out).__name__}; a tensor, a tuple of tensors or a dict "
                          f"of tensors is needed")


# --------------------------------------------------------------------------- sources
def _quiet_transformers():
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _load_hf(params: Params, folder: Path) -> tuple[nn.Module, list[Path]]:
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
    transformers = _quiet_transformers()
    if params.model.task in TEXT_HEAD_TASKS:
        auto = text_tasks.auto_class(params.model.task)
    else:
        auto = (transformers.AutoModelForImageClassification if params.model.task == "image-classification"
                else transformers.AutoModel)
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


def _load_module(params: Params, path: Path) -> tuple[nn.Module, list[Path], Optional[KeyReport]]:
    """The bare module, its source files, and how its keys matched (None: nothing to judge)."""
    m = params.model
    if m.source == "hf":
        return _load_hf(params, path)
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


def _example_hint(path: Path) -> str | None:
    """The examples' text models are built, not committed (examples/README.md): the command its
    params.yaml names (`# make examples  # or: python scripts/...`)."""
    examples = REPO_ROOT / "examples"
    try:
        folder = path.resolve().relative_to(examples.resolve()).parts[0]
    except (ValueError, IndexError):
        return None
    params_file = examples / folder / "params.yaml"
    lines = params_file.read_text(encoding="utf-8").splitlines() if params_file.is_file() else []
    command = next((line.split("# or:", 1)[1].strip() for line in lines if "make examples" in line and "# or:" in line),
                   None)
    if command is None:
        return None
    return (f"the example models are built, not committed: run `make examples` (or `{command}`), see "
            f"examples/{folder}/README.md")


def load_model(params: Params) -> LoadedModel:
    """Load `params.model` safely and wrap it for its task (eval, fp32, CPU)."""
    m = params.model
    try:
        path = checkpoint_path(params)
    except ParamsError as e:
        raise CheckpointError(str(e)) from None
    if not path.exists():
        raise CheckpointError(f"`model.checkpoint` = {m.checkpoint!r} -> {path} does not exist; "
                              + (_example_hint(path) or "give a path relative to the repo root, an absolute "
                                                        "path, or pkg:<package>/<path>"))
    if m.task == "text-embedding":
        loaded, report = _text_embedding(params, path)
    elif m.task in TEXT_HEAD_TASKS:
        loaded, report = text_tasks.text_head_model(params, path, _load_module)
    else:
        module, sources, report = _load_module(params, path)
        module = module.float().eval() if not isinstance(module, torch.jit.ScriptModule) else module.eval()
        loaded = (_image_classification if m.task == "image-classification" else _tensor)(params, module, sources)
    if report is not None:
        # Missing weights matter only where they feed what the task computes (e.g. BERT's pooler does
        # not feed a text embedding): judged on the wrapped task module.
        judge_missing(report, loaded.module, probe_args(loaded), m.task)
    # Inference only: outputs never carry autograd state (numpy() works on them directly).
    for param in loaded.module.parameters():
        param.requires_grad_(False)
    loaded.reload = lambda: load_model(params).module
    return loaded


def probe_args(loaded: LoadedModel) -> tuple:
    """One small batch-1 input of the right shapes and dtypes (token ids 1: inside any vocabulary)."""
    task = loaded.task
    args = []
    for spec in loaded.inputs:
        if spec.dtype.startswith("int"):
            args.append(torch.ones(1, 8, dtype=torch.int64))
        elif task.get("kind") == "image-classification":
            args.append(torch.zeros(1, 3, *task["input_size"]))
        else:
            args.append(torch.zeros(1, *task.get("input_shape", [])))
    return tuple(args)


def _text_embedding(params: Params, path: Path) -> tuple[LoadedModel, Optional[KeyReport]]:
    if params.model.source != "hf":
        raise CheckpointError(f"task 'text-embedding' needs `model.source: hf` (a Hugging Face folder with "
                              f"tokenizer.json), got {params.model.source!r}")
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        raise CheckpointError(f"{path}: tokenizer.json is missing; text-embedding needs the fast tokenizer file "
                              f"(save it with tokenizer.save_pretrained)")
    folder = read_sentence_folder(path)          # before the weights: a refused folder costs no load
    encoder, sources, report = _load_module(params, path)
    module = TextEmbeddingModel(encoder.float().eval(), folder.pooling, folder.normalize).eval()
    config = getattr(encoder, "config", None)
    hidden = getattr(config, "hidden_size", None)
    limits = {"model.text.max_length": params.model.text.max_length, "the folder's max_seq_length": folder.max_seq_length,
              "config.json max_position_embeddings": getattr(config, "max_position_embeddings", None)}
    limit_from, max_length = min(((k, int(v)) for k, v in limits.items() if v), key=lambda kv: kv[1])
    task = {"kind": "text-embedding", "max_length": max_length, "max_length_from": limit_from,
            "dim": hidden, "tokenizer": "tokenizer.json", "max_texts": params.model.text.max_texts,
            **folder.as_task(), **tokenizer_settings(path)}
    seq = {0: "batch", 1: "sequence"}
    loaded = LoadedModel(module=module,
                         inputs=[InputSpec("input_ids", "int64", dict(seq)), InputSpec("attention_mask", "int64", dict(seq))],
                         outputs=["embedding"], task=task, extra_files={"tokenizer.json": tokenizer},
                         source_files=sources + [tokenizer])
    return loaded, report


def _image_classification(params: Params, module: nn.Module, sources: list[Path]) -> LoadedModel:
    """The logits of the model (one output), its labels and its preprocessing (pipeline/model/image_task.py)."""
    from pipeline.model.image_task import image_classification_model
    if params.model.source == "hf":
        wrapped = OutputsAsTuple(module, pick="logits")
    else:
        example = torch.zeros(1, 3, *probe_size(params))
        names, keys = _describe_outputs(module, example)
        if len(names) != 1:
            raise CheckpointError(f"image-classification needs one logits output; the model returns {len(names)} "
                                  f"({', '.join(names)}); use task 'tensor' or make the factory return logits only")
        wrapped = OutputsAsTuple(module, keys=None, pick=keys[0] if keys else None)
    folder = checkpoint_path(params) if params.model.source == "hf" else None
    return image_classification_model(params, module, sources, wrapped.eval(), folder)


def probe_size(params: Params) -> tuple[int, int]:
    """The (height, width) a state_dict / TorchScript image model takes, from params `model.image`."""
    from pipeline.model.image_task import recipe_from_params
    from handlers.task_image import check_recipe
    return check_recipe(recipe_from_params(params.model.image))


def _tensor(params: Params, module: nn.Module, sources: list[Path]) -> LoadedModel:
    shape = list(params.model.input_shape or [])
    example = torch.zeros(1, *shape)
    try:
        names, keys = _describe_outputs(module, example)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"the model fails on a zero input of shape [1, {', '.join(map(str, shape))}] "
                              f"(`model.input_shape` = {shape}): {type(e).__name__}: {_first_line(e)}") from None
    wrapped = OutputsAsTuple(module, keys=keys) if keys else module
    task = {"kind": "tensor", "input_shape": shape, "input_dtype": "float32"}
    return LoadedModel(module=wrapped.eval(), inputs=[InputSpec("input", "float32", {0: "batch"})],
                       outputs=names, task=task, extra_files={}, source_files=sources)
