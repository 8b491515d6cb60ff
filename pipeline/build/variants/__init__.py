"""Deployment variants: one registered converter class per variant (see base.py)."""
from pipeline.build.variants import aoti, eager, onnx, onnx_int8, torch_int8, torchscript  # noqa: F401  (each registers its converters)
from pipeline.build.variants.base import REGISTRY, Artifact, BuildContext, Converter, get_converter, register  # noqa: F401
