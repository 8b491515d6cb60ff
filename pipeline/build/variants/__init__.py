"""Deployment variants: one registered converter class per variant (see base.py)."""
# Each import registers its converters; this order keeps the registry's order.
from pipeline.build.variants import aoti, eager, onnx  # noqa: F401
from pipeline.build.variants.int8 import onnx_int8, torch_int8  # noqa: F401
from pipeline.build.variants import torchscript  # noqa: F401
from pipeline.build.variants.base import REGISTRY, Artifact, BuildContext, Converter, get_converter, register  # noqa: F401
