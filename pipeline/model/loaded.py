"""The loaded model as every later step sees it: a module with named, batch-first inputs and outputs,
the task settings that go into variant.json, and the files it came from. The task families
(families/) make one; the loader (checkpoint.py) dispatches to them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn


@dataclass
class InputSpec:
    name: str
    dtype: str                                   # 'int64' | 'float32'
    dynamic_axes: dict[int, str] = field(default_factory=dict)   # e.g. {0: 'batch', 1: 'sequence'}

    def as_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype,
                "dynamic_axes": {str(k): v for k, v in self.dynamic_axes.items()}}


@dataclass
class LoadedModel:
    module: Optional[nn.Module]   # eval(), fp32, CPU; forward(*tensors in `inputs` order); None once released
    inputs: list[InputSpec]
    outputs: list[str]
    task: dict                    # goes into variant.json "task"
    extra_files: dict[str, Path] = field(default_factory=dict)   # variant-folder name -> source file
    source_files: list[Path] = field(default_factory=list)       # checkpoint file(s), for provenance
    # Loads the module again (load_model sets it): a released module comes back if a step needs it.
    reload: Optional[Callable[[], nn.Module]] = field(default=None, repr=False, compare=False)

    def example_inputs(self, feeds: dict) -> tuple:
        """Order a feeds dict (numpy arrays or tensors) as the module's positional arguments."""
        return tuple(torch.as_tensor(feeds[spec.name]) for spec in self.inputs)

    def release_module(self) -> bool:
        """Drop the module, one copy of the model's weights, for the steps of a build that no longer
        use it (an ONNX build after its export: quantizing bert-large then held 5.7 GB with it);
        `require_module()` loads it again if a later step does. False (kept) when it cannot be."""
        if self.module is None or self.reload is None:
            return self.module is None
        self.module = None
        free_memory()
        return True

    def require_module(self) -> nn.Module:
        if self.module is None:
            if self.reload is None:
                raise RuntimeError("the model's module was released and cannot be loaded again")
            self.module = self.reload()
        return self.module


def free_memory() -> None:
    """Collect garbage and hand the heap's free pages back to the OS (glibc keeps freed chunks of
    a few MB, such as a transformer's weights, for reuse; the peak of the next step then adds to
    them)."""
    import ctypes
    import ctypes.util
    import gc
    gc.collect()
    libc = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(libc).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass                          # not glibc: nothing to trim
