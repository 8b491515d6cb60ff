"""`aoti`: torch.export (dynamic batch/sequence) compiled by AOTInductor for the resolved target
device (benchmark.device). The build only runs on the device it was compiled for; the runtime
refuses another one with a clear error.

On CPU the variant ships the compiled library itself (`aoti.so`, weights inside), unpacked from
the .pt2 package at build time. `aoti_load_package` extracts the whole package to a temporary
folder at every load, checksumming it on the way: bert-large's 1.34 GB took 6.4 s a load on a
quiet host and 22 s in the benchmark's fresh processes, against 1.2–3.8 s to open the library
where it lies. A CUDA build keeps the package (its kernels are separate files the loader places)."""
from __future__ import annotations

import shutil
import zipfile
from pathlib import Path
from typing import Optional

import torch

from pipeline.variants.base import Artifact, BuildContext, Converter, default_input_dtypes, module_copy, register

LIBRARY = "aoti.so"
# Package members that are only sources or descriptions of the build, not needed to run it.
_NOT_NEEDED = (".cpp", ".h", ".json", "serialization_id", "byteorder", "version", "archive_format", ".txt")


@register
class AotiConverter(Converter):
    name = "aoti"
    family = "torch"
    dtype = "float32"
    methods = ("export-compile",)

    def build_export_compile(self, ctx: BuildContext) -> Artifact:
        module = module_copy(ctx.module(), ctx.device)
        program = torch.export.export(module, ctx.example_inputs(None, ctx.device), dynamic_shapes=ctx.dynamic_shapes())
        path = ctx.out_dir / "aoti.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        if ctx.device == "cpu" and unpack_library(path, ctx.out_dir / LIBRARY):
            path.unlink()
            return Artifact(LIBRARY, "aoti", default_input_dtypes(ctx.loaded))
        return Artifact(path.name, "aoti", default_input_dtypes(ctx.loaded))


def library_member(package: zipfile.ZipFile) -> Optional[str]:
    """The package's one model library, when that is all it needs to run (else None: keep the package)."""
    needed = [n for n in package.namelist() if not n.endswith("/") and not n.endswith(_NOT_NEEDED)]
    if len(needed) == 1 and needed[0].endswith(".so") and "/aotinductor/" in needed[0]:
        return needed[0]
    return None


def unpack_library(package_path: Path, dest: Path) -> bool:
    """Copy the package's model library to `dest`; False (nothing written) when the package needs
    more than that one file."""
    with zipfile.ZipFile(package_path) as z:
        member = library_member(z)
        if member is None:
            return False
        with z.open(member) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 16 * 2**20)
    return True
