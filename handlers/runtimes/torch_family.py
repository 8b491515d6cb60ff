"""PyTorch family: `eager` (torch.export ExportedProgram), `torchscript` (also the fp16/bf16 variants)
and `aoti` (AOTInductor: the model library itself on CPU, the package on CUDA). None needs the
model's Python code.

Half-precision variants take and return float32 at the boundary: floating inputs are cast to the
variant's dtype here and outputs back to float32, so callers never see fp16/bf16.

Loading stays close to the disk: every format is deserialised from its path (the zip reader pulls
each tensor record straight into its storage), never from a bytes copy of the whole file first, so
peak memory is one copy of the weights and the load approaches the raw read; `read` is then 0 and
`deserialize` holds the whole load. The weights of an eager program, of a TorchScript archive and of
a CPU aoti library are not even copied: they are memory-mapped where they lie (`load_exported_program`,
`load_torchscript`, `mapped_constants`), so a load costs little more than parsing the program, the
pages come from the page cache at the first call, and the workers of one server share them.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from handlers.runtimes import Runtime, RuntimeLoadError, artifact_path

log = logging.getLogger(__name__)

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


# A TorchScript archive (torch.jit.save) holds two pickles, constants.pkl then data.pkl, whose tensors'
# storages are the records constants/<key> and data/<key>; code/ holds the program's source.
_SCRIPT_PICKLES = ("constants", "data")
_SCRIPT_SMALL_RECORDS = ("byteorder", ".data/version", "version")
_TS_ID = "0"


def load_torchscript(path: Path, map_location=None):
    """torch.jit.load with every tensor memory-mapped from the archive (copy-on-write, like
    load_exported_program) instead of read out of it record by record: bf16 XLM-R-large's 1.1 GB took
    ~0.6 s of CPU to copy (~2.6 s with two workers loading at once), the mapping ~0.04 s.

    torch.jit.load has no mmap option, but the loader torch.package uses for TorchScript does take the
    storages from a context when they are there: the archive's small records (pickles, code, version)
    are repacked under the names that loader reads into an in-memory archive of a few hundred KB, and
    each tensor record is handed over as a slice of one private mapping of the file. The pickles and
    the program are torch's own, so the module is the one torch.jit.load returns. An archive this
    cannot map (a legacy one, a record not 64-byte aligned, a storage key in both pickles, another
    torch) loads as torch.jit.load does.

    Either way the load runs on one intra-op thread: compiling the program pools its constants,
    comparing every two of one shape with aten::equal (20,874 calls for XLM-R-large), each an OpenMP
    region when torch has more threads. On a busy 2-vCPU host each region waited for a descheduled
    thread: 2 threads took 3.9-4.5 s where 1 took 0.05 s."""
    with _one_intra_op_thread():
        try:
            module = _load_script_mapped(path, map_location)
        except Exception as e:  # a torch whose package loader differs, a file that is no archive: torch's own load
            log.warning("memory-mapped TorchScript load of %s failed (%s: %s); loading it with torch.jit.load",
                        path, type(e).__name__, e)
            module = None
        return module if module is not None else torch.jit.load(str(path), map_location=map_location)


@contextlib.contextmanager
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def _load_script_mapped(path: Path, map_location):
    plan = _script_plan(path)
    if plan is None:
        return None
    reader, small, storages = plan
    buffer = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(buffer)
    for new, old in small.items():
        data = reader.get_record(old)
        writer.write_record(new, data, len(data))
    writer.write_end_of_file()
    repacked = torch._C.PyTorchFileReader(io.BytesIO(buffer.getvalue()))
    # The file format version decides which operator upgraders apply: it must be the archive's own.
    versions = [n for n in _SCRIPT_SMALL_RECORDS if n != "byteorder"]
    if ({n: bytes(reader.get_record(n)) for n in versions if n in small}
            != {n: bytes(repacked.get_record(n)) for n in versions if repacked.has_record(n)}):
        raise RuntimeError("the repacked archive's version differs from the archive's")
    whole = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=Path(path).stat().st_size)
    context = torch._C.DeserializationStorageContext()
    for key, (offset, nbytes) in storages.items():
        # Each slice holds the mapping, which lasts as long as any tensor made from it.
        context.add_storage(key, torch.empty(0, dtype=torch.uint8).set_(whole[offset:offset + nbytes]))
    from torch.jit._recursive import wrap_cpp_module
    from torch.jit._serialization import validate_map_location
    return wrap_cpp_module(torch._C._import_ir_module_from_package(
        torch._C.CompilationUnit(), repacked, context, validate_map_location(map_location), _TS_ID))


def _script_plan(path: Path):
    """(reader, {repacked name: record}, {storage key: (offset, nbytes)}) for a TorchScript archive
    whose tensors can all be mapped; None where load_torchscript must leave it to torch.jit.load."""
    if not all(hasattr(torch._C, n) for n in ("_import_ir_module_from_package", "DeserializationStorageContext",
                                              "PyTorchFileWriter")) \
            or not hasattr(torch._C.PyTorchFileReader, "get_record_offset"):
        return None
    reader = torch._C.PyTorchFileReader(str(path))
    names = set(reader.get_all_records())
    if "model.json" in names or not all(f"{p}.pkl" in names for p in _SCRIPT_PICKLES):
        return None                                   # a legacy archive, or not a TorchScript one
    # The package loader reads the pickles from .data/ts_code/<id>/ and the code from .data/ts_code/code/.
    small = {f".data/ts_code/{_TS_ID}/{p}.pkl": f"{p}.pkl" for p in _SCRIPT_PICKLES}
    small.update({f".data/ts_code/{n}": n for n in names if n.startswith("code/")})
    small.update({n: n for n in _SCRIPT_SMALL_RECORDS if n in names})
    storages: dict[str, tuple[int, int]] = {}
    for name in names:
        folder, _, key = name.partition("/")
        if folder not in _SCRIPT_PICKLES or not key:
            continue
        if key in storages:
            return None          # both pickles use this key: one storage context cannot tell them apart
        offset, nbytes = reader.get_record_offset(name), reader.get_record_size(name)
        if offset % 64:
            return None          # torch.jit.save aligns every record to 64 bytes; something else wrote this
        storages[key] = (offset, nbytes)
    return reader, small, storages


def executor_optimizes(device: str) -> bool:
    """Whether TorchScript's profiling executor would change what a graph runs on `device`: it profiles
    the first call and compiles an optimised graph at the second, and only its fusers (always on for
    CUDA, on CPU only where enabled: NNC, oneDNN Graph) put other kernels in. Without a fuser the optimised graph runs the
    same ATen kernels (bf16, fp16 and fp32 XLM-R-large: bit-identical outputs, the same steady
    latency), so that profiling call and recompile only make the first calls slow (~60-90 ms each)."""
    if device != "cpu":
        return True
    cpu_fusers = (getattr(torch._C, "_jit_can_fuse_on_cpu", None), getattr(torch._C, "_jit_llga_enabled", None))
    return any(enabled is None or enabled() for enabled in cpu_fusers)   # unknown: as if it fused


class TorchRuntime(Runtime):
    warmup_calls = 1

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
        self.plain_executor = False
        if fmt == "torchscript":
            # map_location puts frozen constants on the device too (a frozen module ignores .to()).
            self.model = load_torchscript(path, map_location=self.torch_device)
            t2 = time.perf_counter()
            if executor_optimizes(device):
                self.warmup_calls = 2     # the profiling executor compiles the optimised graph on the 2nd call
            else:
                # Run the graph as saved (frozen and optimised at build time): the first call is as
                # fast as the next, so one warm-up call is enough.
                self.plain_executor = True
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
        # The executor's switch is per thread: set for this call only (TorchServe may call from another).
        executor = torch.jit.optimized_execution(False) if self.plain_executor else contextlib.nullcontext()
        with torch.inference_mode(), executor:
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
