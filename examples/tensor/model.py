"""A small tensor-in/tensor-out model whose code lives in this repo: Conv1d features + MLP head.

One sample is [16, 32] (16 channels × 32 steps); output [10] scores per sample.
params: model.factory = examples/tensor/model.py:build, weights in weights.safetensors (make_weights.py).
"""
from torch import nn


class SignalNet(nn.Module):
    def __init__(self, channels: int = 16, length: int = 32, hidden: int = 32, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv1d(channels, hidden, kernel_size=3, padding=1)
        self.act = nn.GELU()
        self.pool = nn.AvgPool1d(2)
        self.head = nn.Sequential(
            nn.Flatten(1),                           # no shape-derived Python ints: batch stays dynamic
            nn.Linear(hidden * (length // 2), 64),
            nn.ReLU(),
            nn.Linear(64, classes),
        )

    def forward(self, x):
        return self.head(self.pool(self.act(self.conv(x))))


def build(channels: int = 16, length: int = 32, hidden: int = 32, classes: int = 10) -> nn.Module:
    return SignalNet(channels, length, hidden, classes).eval()
