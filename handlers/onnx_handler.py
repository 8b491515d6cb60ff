"""TorchServe handler for ONNX Runtime variants (fp32, fp16).

Never imports torch: TorchServe's worker already pays for it once, and the pipeline's cold-load
benchmark of this handler's runtime must not. The session (graph optimised at build time, threads
from model-config.yaml) is created by handlers/runtime_onnx.py; request handling is shared
(handlers/serving.py). TorchServe needs exactly one class defined here.
"""
from handlers.serving import ServingHandler


class OnnxHandler(ServingHandler):
    family = "onnx"
