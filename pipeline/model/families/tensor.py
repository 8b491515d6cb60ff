"""tensor: a plain model of float tensors (a state_dict + `model.factory`, a TorchScript archive, or
an HF folder's AutoModel), fed one float32 input of shape [batch, *model.input_shape]; its outputs
(a tensor, a tuple of tensors or a dict of tensors) become named outputs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from pipeline.core.params import Params
from pipeline.model.families.base import Family, OutputsAsTuple, describe_outputs, register
from pipeline.model.loaded import InputSpec, LoadedModel
from pipeline.model.sources import load_eval
from pipeline.model.weights import CheckpointError, KeyReport, _first_line


@register
class Tensor(Family):
    name = "tensor"
    tasks = ("tensor",)

    def load(self, params: Params, path: Path) -> tuple[LoadedModel, Optional[KeyReport]]:
        module, sources, report = load_eval(params, path, self.hf_class(params.model.task))
        shape = list(params.model.input_shape or [])
        example = torch.zeros(1, *shape)
        try:
            names, keys = describe_outputs(module, example)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"the model fails on a zero input of shape [1, {', '.join(map(str, shape))}] "
                                  f"(`model.input_shape` = {shape}): {type(e).__name__}: {_first_line(e)}") from None
        wrapped = OutputsAsTuple(module, keys=keys) if keys else module
        task = {"kind": "tensor", "input_shape": shape, "input_dtype": "float32"}
        loaded = LoadedModel(module=wrapped.eval(), inputs=[InputSpec("input", "float32", {0: "batch"})],
                             outputs=names, task=task, extra_files={}, source_files=sources)
        return loaded, report
