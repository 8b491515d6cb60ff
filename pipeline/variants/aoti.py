"""`aoti`: torch.export (dynamic batch/sequence) compiled by AOTInductor into a .pt2 package for
the resolved target device (benchmark.device). The package only runs on the device it was compiled
for; the runtime refuses another one with a clear error."""
from __future__ import annotations

import torch

from pipeline.variants.base import Artifact, BuildContext, Converter, default_input_dtypes, module_copy, register


@register
class AotiConverter(Converter):
    name = "aoti"
    family = "torch"
    dtype = "float32"
    methods = ("export-compile",)

    def build_export_compile(self, ctx: BuildContext) -> Artifact:
        module = module_copy(ctx.loaded.module, ctx.device)
        program = torch.export.export(module, ctx.example_inputs(None, ctx.device), dynamic_shapes=ctx.dynamic_shapes())
        path = ctx.out_dir / "aoti.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        return Artifact(path.name, "aoti", default_input_dtypes(ctx.loaded))
