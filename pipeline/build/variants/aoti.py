"""`aoti`: torch.export (dynamic batch/sequence) compiled by AOTInductor for the resolved target
device (benchmark.device). The build only runs on the device it was compiled for; the runtime
refuses another one with a clear error.

On CPU the variant ships the compiled library itself (`aoti.so`), unpacked from the .pt2 package at
build time, and its weights beside it in one file (`aoti.so.weights`, each tensor 64-byte aligned,
indexed by `aoti.so.weights.json`) that the runtime memory-maps and hands to the library as
user-managed constants. Why both:
- `aoti_load_package` extracts the whole package to a temporary folder at every load, checksumming
  it on the way: for a GB-sized model several times what opening the library where it lies takes.
- weights compiled into the library are copied out of it into a heap blob at every load (the AOTI
  runtime's load_constants), so each worker held them twice, and the build held a third copy (the
  blob serialised for the library). Mapped from their own file they are the page cache's pages,
  shared by every worker, and the build never serialises them in memory.
A CUDA build keeps the package (its kernels are separate files the loader places; weights inside)."""
from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path
from typing import Optional

import torch

from pipeline.build.variants.base import (Artifact, BuildContext, Converter, default_input_dtypes, forget_last_export,
                                    module_copy, register)

LIBRARY = "aoti.so"
WEIGHTS = LIBRARY + ".weights"      # named after the library: measured as part of it (pipeline/measure/cold.py)
WEIGHTS_INDEX = WEIGHTS + ".json"      # the runtime finds the index by this name (handlers/runtimes/torch_family.py)
ALIGN = 64
# Package members that are only sources or descriptions of the build, not needed to run it.
_NOT_NEEDED = (".cpp", ".h", ".json", "serialization_id", "byteorder", "version", "archive_format", ".txt")
_WEIGHTS_DIR = "/data/weights/"
# Weights out of the library, pickled one per tensor in the package (read back one at a time here).
CPU_INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False,
                        "aot_inductor.package_constants_on_disk_format": "pickle_weights"}


class AotiBuildError(RuntimeError):
    pass


@register
class AotiConverter(Converter):
    name = "aoti"
    family = "torch"
    dtype = "float32"
    methods = ("export-compile",)
    releases_module = True          # after the export: the program holds the weights the compile reads

    def build_export_compile(self, ctx: BuildContext) -> Artifact:
        module = module_copy(ctx.module(), ctx.device)
        program = torch.export.export(module, ctx.example_inputs(None, ctx.device), dynamic_shapes=ctx.dynamic_shapes())
        # The module would outlive the compile beside the mapped weights the screen and verification
        # load: one more copy of the weights at the build's peak.
        del module
        ctx.loaded.release_module()
        path = ctx.out_dir / "aoti.pt2"
        cpu = ctx.device == "cpu"
        torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                 inductor_configs=CPU_INDUCTOR_CONFIGS if cpu else None)
        del program
        forget_last_export()
        if cpu:
            unpack_cpu_package(path, ctx.out_dir / LIBRARY, ctx.out_dir / WEIGHTS)
            path.unlink()
            return Artifact(LIBRARY, "aoti", default_input_dtypes(ctx.loaded), extra={"weights": WEIGHTS},
                            data_files=[WEIGHTS, WEIGHTS_INDEX])
        return Artifact(path.name, "aoti", default_input_dtypes(ctx.loaded))


def library_member(package: zipfile.ZipFile) -> Optional[str]:
    """The package's one model library, when that and its pickled weights are all it needs to run
    (else None)."""
    needed = [n for n in package.namelist()
              if not n.endswith("/") and not n.endswith(_NOT_NEEDED) and _WEIGHTS_DIR not in n]
    if len(needed) == 1 and needed[0].endswith(".so") and "/aotinductor/" in needed[0]:
        return needed[0]
    return None


def unpack_cpu_package(package_path: Path, library: Path, weights: Path) -> None:
    """Write the package's model library to `library` and its weights to `weights` (+ the index
    beside it, keyed by the library's constant names)."""
    with zipfile.ZipFile(package_path) as z:
        member = library_member(z)
        if member is None:
            raise AotiBuildError(f"the AOTInductor package needs more than one model library and its weights "
                                 f"to run ({sorted(z.namelist())}): this torch ({torch.__version__}) packs CPU "
                                 f"builds differently than the pipeline expects")
        with z.open(member) as src, open(library, "wb") as out:
            shutil.copyfileobj(src, out, 16 * 2**20)
        configs = [n for n in z.namelist() if n.startswith(member.rsplit("/", 1)[0] + "/")
                   and n.endswith("/weights_config.json")]
        by_fqn = json.loads(z.read(configs[0])) if configs else {}
        stored = {n.rsplit("/", 1)[1]: n for n in z.namelist() if _WEIGHTS_DIR in n}
        write_weights(z, stored, by_fqn, library, weights)


def write_weights(z: zipfile.ZipFile, stored: dict[str, str], by_fqn: dict, library: Path, weights: Path) -> None:
    """Stream the package's pickled weights into one aligned file, one tensor in memory at a time.
    Constants sharing storage (tied weights) share its bytes, as in the package."""
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)
    fqns = runner.get_constant_names_to_original_fqns()
    del runner
    missing = sorted(name for name, fqn in fqns.items() if fqn not in by_fqn)
    if missing:
        raise AotiBuildError(f"the AOTInductor package has no weights for constants {missing[:5]} "
                             f"({len(missing)} of {len(fqns)}): cannot ship the library's weights apart")
    offsets: dict[str, tuple[int, str, int]] = {}       # stored file -> (offset, dtype, nbytes)
    index = {}
    with open(weights, "wb") as out:
        for name, fqn in sorted(fqns.items()):
            file, shape, stride, storage_offset = by_fqn[fqn]
            if file not in offsets:
                # The whole storage, as torch.save kept it: storage_offset and stride refer to it.
                tensor = torch.load(io.BytesIO(z.read(stored[file])), weights_only=True)
                data = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
                out.write(b"\0" * (-out.tell() % ALIGN))
                offsets[file] = (out.tell(), str(tensor.dtype).removeprefix("torch."), data.numel())
                out.write(data.numpy().data)
                del tensor, data
            offset, dtype, nbytes = offsets[file]
            index[name] = {"offset": offset, "nbytes": nbytes, "dtype": dtype, "shape": list(shape),
                           "stride": list(stride), "storage_offset": storage_offset}
    weights.with_name(weights.name + ".json").write_text(json.dumps(index, indent=1, sort_keys=True))
