"""PyTorch family: `eager` (torch.export ExportedProgram), `torchscript` (also the fp16/bf16 variants)
and `aoti` (AOTInductor: the model library itself on CPU, the package on CUDA). None needs the
model's Python code.

Half-precision variants take and return float32 at the boundary: floating inputs are cast to the
variant's dtype here and outputs back to float32, so callers never see fp16/bf16.

Loading stays close to the disk: every format is deserialised from its path (the zip reader pulls
each tensor record straight into its storage), never from a bytes copy of the whole file first, so
peak memory is one copy of the weights and the load approaches the raw read; `read` is then 0 and
`deserialize` holds the whole load. The eager program's weights and a CPU aoti library's are not
even copied: they are memory-mapped where they lie (`load_exported_program`, `mapped_constants`).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

try:
    from .runtime import Runtime, RuntimeLoadError, artifact_path
except ImportError:  # imported as a top-level module (folder on sys.path)
    from runtime import Runtime, RuntimeLoadError, artifact_path

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int64": torch.int64, "int32": torch.int32}
FORMATS = ("eager", "torchscript", "aoti")


def set_threads(threads: Optional[int]) -> None:
    if threads:
        torch.set_num_threads(threads)
    try:
        # One inter-op thread: serving runs one request batch at a time per worker.
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set (or parallel work already started) in this process: keep it


class AotiLibrary:
    """A CPU AOTInductor model library opened in place: what `aoti_load_package` does after it has
    extracted the package to a temporary folder (see pipeline/build/variants/aoti.py), without the copy.
    Its weights, when they lie beside it (`weights`, indexed by `<weights>.json`), are memory-mapped
    and handed to the library as user-managed constants: used where they lie, never copied (a
    library holding its weights copies them into the heap at every load)."""

    def __init__(self, path: Path, weights: Optional[Path] = None):
        from torch.utils import _pytree as pytree
        self._unflatten = pytree.tree_unflatten
        self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
        self.out_spec = pytree.treespec_loads(self.runner.get_call_spec()[1])
        self.constants = mapped_constants(weights) if weights is not None else None
        if self.constants:
            # user_managed: the library keeps the tensors' pointers, so self.constants keeps them alive.
            self.runner.update_constant_buffer(self.constants, False, True, True)

    def __call__(self, *tensors: torch.Tensor):
        # The program was exported with positional tensors only, so they are its flat inputs.
        return self._unflatten(self.runner.run(list(tensors)), self.out_spec)


# torch's binding of update_constant_buffer makes a tensor handle per constant and, when the library
# does not own them (user_managed), never frees them: the mapping outlives the library. One mapping
# per file and process, shared by every library opened on it (the build's screen and verification).
_MAPPED: dict[tuple, dict[str, torch.Tensor]] = {}


def mapped_constants(weights: Path) -> dict[str, torch.Tensor]:
    """The tensors of an aligned weights file (pipeline/build/variants/aoti.py writes it) as copy-on-write
    views of one private mapping of it (the same views again for the same unchanged file)."""
    st = weights.stat()
    key = (str(weights.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _MAPPED:
        _MAPPED[key] = _map_constants(weights)
    return _MAPPED[key]


def _map_constants(weights: Path) -> dict[str, torch.Tensor]:
    import json
    index = json.loads(weights.with_name(weights.name + ".json").read_text())
    if not index:
        return {}                     # a model without weights: an empty file cannot be mapped
    whole = torch.empty(0, dtype=torch.uint8).set_(
        torch.UntypedStorage.from_file(str(weights), shared=False, nbytes=weights.stat().st_size))
    out = {}
    for name, t in index.items():
        base = whole[t["offset"]:t["offset"] + t["nbytes"]].view(getattr(torch, t["dtype"]))
        out[name] = base.as_strided(t["shape"], t["stride"], base.storage_offset() + t["storage_offset"])
    return out


def load_exported_program(path: Path):
    """torch.export.load with the weights memory-mapped from the archive (copy-on-write, like
    torch.load(mmap=True)) instead of copied out of it record by record: bert-large's 1.34 GB took
    ~3 s of a 4.5 s load to copy. The archive's records are uncompressed and 64-byte aligned, so
    each tensor is a slice of one mapping of the file. Anything else (a record that is empty or not
    aligned to its dtype, a tensor saved for another device, another torch) loads as torch does."""
    from torch.export.pt2_archive import _package as pt2
    original = getattr(pt2, "_build_file_map", None)
    if original is None or not hasattr(torch._C.PyTorchFileReader, "get_record_offset"):
        return torch.export.load(path)
    whole = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=Path(path).stat().st_size)

    def mapped_file_map(archive_reader, config, base_dir):
        records = archive_reader.archive_file
        out = {}
        for meta in config.config.values():
            if meta.use_pickle or meta.path_name in out:
                continue
            dtype = pt2.deserialize_scalar_type(meta.tensor_meta.dtype)
            element = torch._utils._element_size(dtype)
            name = os.path.join(base_dir, meta.path_name)
            offset, nbytes = records.get_record_offset(name), records.get_record_size(name)
            if (nbytes == 0 or nbytes % element or offset % element
                    or pt2.deserialize_device(meta.tensor_meta.device).type != "cpu"):
                return original(archive_reader, config, base_dir)
            tensor = torch.empty(0, dtype=dtype).set_(whole[offset:offset + nbytes], 0, (nbytes // element,), (1,))
            if meta.tensor_meta.requires_grad:
                tensor.requires_grad_(True)
            out[meta.path_name] = tensor
        return out

    pt2._build_file_map = mapped_file_map
    try:
        return torch.export.load(path)
    finally:
        pt2._build_file_map = original


class TorchRuntime(Runtime):
    warmup_calls = 2       # TorchScript's profiling executor specialises the graph on its second call

    def __init__(self, variant: dict, model_dir: Path, device: str, threads: Optional[int]):
        super().__init__(variant, model_dir, device, threads)
        fmt = variant["format"]
        if fmt not in FORMATS:
            raise RuntimeLoadError(f"format {fmt!r} is not a torch format ({FORMATS}); variant.json is inconsistent")
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeLoadError("device 'cuda' asked but torch sees no usable GPU "
                                   f"(torch {torch.__version__}); run on device 'cpu'")
        built_for = variant.get("device", "cpu")
        if fmt == "aoti" and built_for != device:
            raise RuntimeLoadError(f"this AOTInductor package was compiled for {built_for!r} and cannot run on "
                                   f"{device!r}; rebuild it with benchmark.device: {device}")
        set_threads(threads)
        self.torch_device = torch.device(device)
        self.input_torch_dtypes = [TORCH_DTYPES[i["dtype"]] for i in variant["inputs"]]

        t0 = time.perf_counter()
        path = artifact_path(model_dir, variant)
        t1 = time.perf_counter()
        if fmt == "torchscript":
            # map_location puts frozen constants on the device too (a frozen module ignores .to()).
            self.model = torch.jit.load(str(path), map_location=self.torch_device)
            t2 = time.perf_counter()
        elif fmt == "eager":
            program = load_exported_program(path)
            t2 = time.perf_counter()
            if device != "cpu":
                from torch.export.passes import move_to_device_pass
                program = move_to_device_pass(program, device)
            self.model = program.module()
        else:  # aoti: the package is a zip holding a shared library; it loads from a path
            # Loading compiles small CPU-capability probes into the inductor cache, which lives under
            # TMPDIR by default: ~10 s on every start when each server gets its own TEMP (TorchServe).
            # A per-user cache makes only a host's first start pay it (the benchmark measures that one).
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "torchinductor"))
            if path.suffix == ".so":      # unpacked at build time (CPU): opened where it lies
                weights = variant.get("weights")    # absent: a library built with its weights inside
                self.model = AotiLibrary(path, model_dir / weights if weights else None)
            else:
                self.model = torch._inductor.aoti_load_package(str(path))
            t2 = time.perf_counter()
        if device == "cuda":
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        self.load_phases.update(read=t1 - t0, deserialize=t2 - t1, to_device=t3 - t2)

    def _run(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        with torch.inference_mode():
            args = [torch.from_numpy(a).to(self.torch_device).to(dt)
                    for a, dt in zip(arrays, self.input_torch_dtypes)]
            out = self.model(*args)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if self.device == "cuda":
                torch.cuda.synchronize()
            return [o.detach().to("cpu", torch.float32).numpy() for o in outs]

    def close(self) -> None:
        self.model = None
        if self.device == "cuda":
            torch.cuda.empty_cache()


def load(variant: dict, model_dir: Path, device: str, threads: Optional[int], tensorrt: bool = False) -> Runtime:
    return TorchRuntime(variant, model_dir, device, threads)
