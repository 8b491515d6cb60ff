"""Load a checkpoint safely and wrap it as a task model with named, batch-first inputs/outputs.

A short dispatcher: the task family of `model.task` (pipeline/model/families/) loads it, reading
the module through pipeline/model/sources.py (`model.source`: hf | state_dict | torchscript).

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

from pathlib import Path

import torch

from pipeline.core.params import REPO_ROOT, Params, ParamsError, checkpoint_path
from pipeline.model.families.base import family_for
# Re-exported for callers of the checkpoint API.
from pipeline.model.loaded import InputSpec, LoadedModel, free_memory  # noqa: F401
from pipeline.model.sources import build_from_factory, import_factory  # noqa: F401
from pipeline.model.weights import (STATE_DICT_SUFFIXES, CheckpointError, KeyReport, _first_line,  # noqa: F401
                                    check_readable, find_hf_weights, judge_missing, key_problem, load_into,
                                    read_weights, state_dict_files)


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
    loaded, report = family_for(m.task).load(params, path)
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


