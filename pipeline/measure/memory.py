"""Peak memory: host RSS of this process, and device memory on GPU."""
from __future__ import annotations

import resource
import sys
from typing import Optional

from pipeline.host import nvml


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (MiB). Linux reports ru_maxrss in KiB."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kb / 1024 if sys.platform != "darwin" else kb / 2**20, 1)


def current_rss_mb() -> float:
    import psutil
    return round(psutil.Process().memory_info().rss / 2**20, 1)


class GpuMemoryTracker:
    """Peak device memory over a measurement.

    torch allocations: torch.cuda.max_memory_allocated (reset at start). Allocations outside torch
    (ONNX Runtime's CUDA EP): the rise of device-wide used memory (NVML) over the baseline taken at
    start, sampled by `sample()` after calls. The larger of the two is reported.
    """

    def __init__(self, device: str, index: int = 0):
        self.active = device == "cuda"
        self.index = index
        self._baseline_mb: Optional[float] = None
        self._nvml_peak_mb = 0.0

    def _torch(self):
        torch = sys.modules.get("torch")
        return torch if torch is not None and torch.cuda.is_available() else None

    def start(self) -> None:
        if not self.active:
            return
        torch = self._torch()
        if torch is not None:
            torch.cuda.reset_peak_memory_stats(self.index)
        self._baseline_mb = nvml.used_memory_mb(self.index)
        self._nvml_peak_mb = 0.0

    def sample(self) -> None:
        if not self.active or self._baseline_mb is None:
            return
        used = nvml.used_memory_mb(self.index)
        if used is not None:
            self._nvml_peak_mb = max(self._nvml_peak_mb, used - self._baseline_mb)

    def peak_mb(self) -> Optional[float]:
        """None on CPU; MiB on GPU."""
        if not self.active:
            return None
        self.sample()
        torch = self._torch()
        torch_mb = torch.cuda.max_memory_allocated(self.index) / 2**20 if torch is not None else 0.0
        return round(max(torch_mb, self._nvml_peak_mb), 1)
