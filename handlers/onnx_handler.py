"""TorchServe handler for ONNX Runtime variants (fp32, fp16).

Never imports torch itself: the session (graph optimised at build time, threads from
model-config.yaml) is created by handlers/runtimes/onnx_family.py with onnxruntime + numpy only; request
handling is shared (handlers/serving.py). TorchServe needs exactly one class defined here.
"""
import os

from handlers.serving import ServingHandler


class OnnxHandler(ServingHandler):
    family = "onnx"

    def select_gpu(self, gpu_id: int) -> None:
        # The CUDA execution provider uses device 0 of what it can see: show it only the GPU
        # TorchServe gave this worker (read when CUDA initialises, i.e. at session creation).
        # gpu_id counts the GPUs already visible to the worker, if the host restricted them.
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[gpu_id] if gpu_id < len(visible) else str(gpu_id)
