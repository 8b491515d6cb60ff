"""`eager`: the fp32 reference, servable without the model's Python code.

Preferred: a torch.export ExportedProgram (torch.export.save) with dynamic batch/sequence axes. It
runs the same ATen ops as the eager module, needs neither the model's classes nor a pickle, and
keeps the program readable. When export cannot capture the model (data-dependent control flow, a
shape-specialising Python int), the fallback is `torch.jit.script`, which keeps Python control flow
(unlike tracing) and is equally code-free to load.
"""
from __future__ import annotations

import torch

from pipeline.build.variants.base import Artifact, BuildContext, Converter, default_input_dtypes, forget_jit_types, register


@register
class EagerConverter(Converter):
    name = "eager"
    family = "torch"
    dtype = "float32"
    methods = ("export", "script")

    def build_export(self, ctx: BuildContext) -> Artifact:
        program = torch.export.export(ctx.module(), ctx.example_inputs(), dynamic_shapes=ctx.dynamic_shapes())
        torch.export.save(program, ctx.out_dir / "exported.pt2")
        return Artifact("exported.pt2", "eager", default_input_dtypes(ctx.loaded))

    def build_script(self, ctx: BuildContext) -> Artifact:
        scripted = torch.jit.script(ctx.module())
        scripted.save(str(ctx.out_dir / "model.pt"))
        forget_jit_types()
        return Artifact("model.pt", "torchscript", default_input_dtypes(ctx.loaded))
