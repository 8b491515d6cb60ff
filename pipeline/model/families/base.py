"""The model-family registry: one class per task family, registered by name (as the variants are).

A family names the tasks it serves (params `model.task`) and the transformers auto class an `hf`
folder of them is built with, and `load`s a checkpoint into a `LoadedModel`: it reads the module
through pipeline/model/sources.py, wraps it for the task (named, batch-first tensors in and out)
and says what the serving handler needs (variant.json "task"). The helpers below are what more
than one family uses.
"""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Optional

import torch
from torch import nn

from pipeline.core.params import Params
from pipeline.model.loaded import LoadedModel
from pipeline.model.weights import CheckpointError, KeyReport

REGISTRY: dict[str, type["Family"]] = {}


class Family:
    name: ClassVar[str]
    tasks: ClassVar[tuple[str, ...]]            # the `model.task` values it loads

    def hf_class(self, task: str) -> str:
        """The transformers auto class an `hf` folder of `task` is built with."""
        return "AutoModel"

    def load(self, params: Params, path: Path) -> tuple[LoadedModel, Optional[KeyReport]]:
        """The task model of the checkpoint at `path`, and how its keys matched (None: nothing to judge)."""
        raise NotImplementedError


def register(cls: type[Family]) -> type[Family]:
    if cls.name in REGISTRY:
        raise ValueError(f"model family {cls.name!r} registered twice ({REGISTRY[cls.name].__name__}, {cls.__name__})")
    claimed = {task: other.name for other in REGISTRY.values() for task in other.tasks}
    for task in cls.tasks:
        if task in claimed:
            raise ValueError(f"task {task!r} of model family {cls.name!r} is already family {claimed[task]!r}'s")
    REGISTRY[cls.name] = cls
    return cls


def family_for(task: str) -> Family:
    import pipeline.model.families  # noqa: F401  (registers every family module)
    for cls in REGISTRY.values():
        if task in cls.tasks:
            return cls()
    known = sorted(t for cls in REGISTRY.values() for t in cls.tasks)
    raise CheckpointError(f"no model family loads task {task!r}; known: {', '.join(known)}")


# --------------------------------------------------------------------------- shared by families
def hf_tokenizer(params: Params, path: Path, folder_holds: str) -> Path:
    """The tokenizer.json of a text task's HF folder; refused for another source or without one."""
    task = params.model.task
    if params.model.source != "hf":
        raise CheckpointError(f"task {task!r} needs `model.source: hf` (a Hugging Face folder with {folder_holds}), "
                              f"got {params.model.source!r}")
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        raise CheckpointError(f"{path}: tokenizer.json is missing; {task} needs the fast tokenizer file "
                              f"(save it with tokenizer.save_pretrained)")
    return tokenizer


def labels_of(config, folder: Path) -> list[str]:
    id2label = getattr(config, "id2label", None) or {}
    n = int(getattr(config, "num_labels", len(id2label)))
    try:
        return [str(id2label[i]) for i in range(n)]
    except KeyError as e:
        raise CheckpointError(f"{folder}/config.json: id2label lacks label {e} of {n}; give every class a name") from None


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


def describe_outputs(module: nn.Module, example: torch.Tensor) -> tuple[list[str], list[str] | None]:
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
