"""Load and run one built variant: the same code for verification, benchmarks and TorchServe.

`load_runtime(model_dir, device, threads)` reads `model_dir/variant.json` and imports only the
runtime family it names (`torch` → torch_family.py, `onnx` → onnx_family.py), so an ONNX variant never
pays for `import torch`. Every runtime takes and returns batch-first numpy arrays: inputs are cast
to the dtypes the artifact declares (e.g. float32 → float16), outputs always come back float32.

This module uses the standard library and numpy only (it is packed into the .mar and imported by
the handlers); it never imports `pipeline/`.
"""
from __future__ import annotations

import importlib
import json
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Optional

import numpy as np

VARIANT_FILE = "variant.json"
FAMILIES = {"torch": "torch_family", "onnx": "onnx_family"}
DEVICES = ("cpu", "cuda")
LOAD_PHASES = ("import", "read", "deserialize", "to_device")


class RuntimeLoadError(RuntimeError):
    """The variant folder cannot be loaded as asked; the message says what is wrong and the fix."""


class Runtime(ABC):
    """What every family provides. Subclasses fill the attributes and implement `_run`."""
    # Calls a serving worker makes before it reports ready, so the first request is not slow:
    # one allocates ONNX Runtime's arena; TorchScript's profiling executor specialises on the 2nd.
    warmup_calls: int = 1

    def __init__(self, variant: dict, model_dir: Path, device: str, threads: Optional[int]):
        self.variant = variant
        self.model_dir = model_dir
        self.device = device
        self.threads = threads
        self.input_names: list[str] = [i["name"] for i in variant["inputs"]]
        self.output_names: list[str] = [o["name"] for o in variant["outputs"]]
        self.input_dtypes: dict[str, np.dtype] = {i["name"]: numpy_dtype(i["dtype"]) for i in variant["inputs"]}
        self.load_phases: dict[str, float] = {p: 0.0 for p in LOAD_PHASES}   # seconds

    def prepare_feeds(self, feeds: dict) -> list[np.ndarray]:
        """Feeds in `input_names` order, cast to the artifact's dtypes; a missing input is an error."""
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise KeyError(f"feeds lack input(s) {missing}; this variant takes {self.input_names}")
        return [np.ascontiguousarray(np.asarray(feeds[n]), dtype=self.input_dtypes[n]) for n in self.input_names]

    def run(self, feeds: dict) -> list[np.ndarray]:
        outputs = self._run(self.prepare_feeds(feeds))
        return [np.asarray(o, dtype=np.float32) for o in outputs]

    @abstractmethod
    def _run(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Run prepared inputs (in `input_names` order) → the outputs, any float dtype."""

    def close(self) -> None:
        """Drop the model so its memory can go; the runtime is unusable afterwards."""


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        # numpy has no bfloat16: bf16 variants take float32 at the boundary and cast in torch.
        return np.dtype(np.float32)
    try:
        return np.dtype(name)
    except TypeError:
        raise RuntimeLoadError(f"variant.json names an unknown dtype {name!r}; "
                               f"expected int64, float32, float16 or bfloat16") from None


def read_variant(model_dir: str | Path) -> dict:
    path = Path(model_dir) / VARIANT_FILE
    try:
        variant = json.loads(path.read_text())
    except FileNotFoundError:
        raise RuntimeLoadError(f"{path} not found: {model_dir} is not a built variant folder "
                               f"(run `python -m stages.convert <variant>` to make one)") from None
    except json.JSONDecodeError as e:
        raise RuntimeLoadError(f"{path} is not valid JSON ({e}); rebuild the variant") from None
    for key in ("family", "format", "artifact", "dtype", "inputs", "outputs"):
        if key not in variant:
            raise RuntimeLoadError(f"{path} lacks `{key}`; rebuild the variant with the current pipeline")
    if variant["family"] not in FAMILIES:
        raise RuntimeLoadError(f"{path}: family {variant['family']!r} is unknown; expected one of {sorted(FAMILIES)}")
    return variant


def load_runtime(model_dir: str | Path, device: str = "cpu", threads: Optional[int] = None,
                 *, tensorrt: bool = False) -> Runtime:
    """Load the variant in `model_dir` on `device` ('cpu' | 'cuda') with `threads` intra-op threads
    (None → the library's default; inter-op parallelism is always 1). `tensorrt`: ONNX on CUDA
    tries the TensorRT execution provider first (torch variants ignore it)."""
    if device not in DEVICES:
        raise RuntimeLoadError(f"device {device!r} is invalid; use one of {DEVICES}")
    if threads is not None and threads <= 0:
        raise RuntimeLoadError(f"threads = {threads} is invalid; use a positive count or None")
    model_dir = Path(model_dir)
    variant = read_variant(model_dir)
    t0 = time.perf_counter()
    family = _family_module(variant["family"])
    import_s = time.perf_counter() - t0
    runtime = family.load(variant, model_dir, device, threads, tensorrt=tensorrt)
    runtime.load_phases["import"] = import_s
    return runtime


def _family_module(family: str):
    return importlib.import_module(f"{__package__}.{FAMILIES[family]}")


def artifact_path(model_dir: Path, variant: dict) -> Path:
    """The artifact's path inside `model_dir`; a missing file is a RuntimeLoadError naming the fix."""
    path = Path(model_dir) / variant["artifact"]
    if not path.is_file():
        raise RuntimeLoadError(f"{path} not found: variant.json names `{variant['artifact']}` but the "
                               f"folder lacks it; rebuild the variant")
    return path


def read_artifact(model_dir: Path, variant: dict) -> bytes:
    return artifact_path(model_dir, variant).read_bytes()
