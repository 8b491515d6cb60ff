"""TorchServe handler for torch-family variants: eager, TorchScript, fp16/bf16, AOTInductor package.

TorchServe loads `torch_handler` from the unpacked .mar and needs exactly one class defined here.
Loading, casting to the variant's dtype and device placement are the runtime's job
(handlers/runtimes/torch_family.py); request handling is shared (handlers/serving.py).
"""
from handlers.serving import ServingHandler


class TorchHandler(ServingHandler):
    family = "torch"

    def select_gpu(self, gpu_id: int) -> None:
        import torch   # the worker has imported it already
        # 'cuda' without an index is the current device: the GPU TorchServe gave this worker.
        torch.cuda.set_device(gpu_id)
