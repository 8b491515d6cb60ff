"""Which device a benchmark runs on, and how many intra-op threads it uses.

`auto` means CUDA only when a GPU is really usable: torch.cuda.is_available() AND a tiny op runs
on it. onnxruntime-gpu lists CUDA even on machines without a GPU, so it is never asked.
"""
from __future__ import annotations

from typing import Callable, Optional

DEVICES = ("auto", "cpu", "cuda")


class DeviceError(RuntimeError):
    """The requested device cannot be used; the message says why and what to set instead."""


def cuda_usable() -> tuple[bool, str]:
    """(usable, why): probe CUDA through torch with a real (tiny) computation."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a pinned requirement
        return False, f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        return False, f"torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    try:
        x = torch.ones(8, device="cuda")
        if float((x * 2).sum().item()) != 16.0:
            return False, "a test computation on CUDA returned a wrong result"
        torch.cuda.synchronize()
    except Exception as e:  # driver mismatch, no free device, ...
        return False, f"a test computation on CUDA failed: {type(e).__name__}: {e}"
    return True, f"CUDA usable: {torch.cuda.get_device_name(0)}"


def resolve_device(requested: str, probe: Callable[[], tuple[bool, str]] = cuda_usable) -> str:
    """`auto` → "cuda" when usable else "cpu"; "cuda" without a usable GPU → DeviceError."""
    if requested not in DEVICES:
        raise DeviceError(f"benchmark.device = {requested!r} is invalid; allowed: {', '.join(DEVICES)}")
    if requested == "cpu":
        return "cpu"
    usable, why = probe()
    if usable:
        return "cuda"
    if requested == "cuda":
        raise DeviceError(f"benchmark.device is 'cuda' but no usable CUDA GPU was found: {why}. "
                          f"Set benchmark.device to 'auto' or 'cpu' on this machine.")
    return "cpu"


def serving_threads(device: str, requested: int) -> Optional[int]:
    """Intra-op threads a benchmark uses: `requested` when > 0, else what one serving worker gets.

    CPU: one worker per core with 1 thread each (2 workers × 1 thread beat 1 × 2 on MiniLM, see
    docs/handtuned.md), so 1. CUDA: None — leave the runtime's default, the GPU does the work.
    """
    if requested < 0:
        raise DeviceError(f"benchmark.threads = {requested} is invalid; use 0 (as one serving worker) or a positive count")
    if requested > 0:
        return requested
    return 1 if device == "cpu" else None


def synchronizer(device: str) -> Optional[Callable[[], None]]:
    """A call that waits for queued GPU work, so GPU timings are real; None on CPU.

    Only uses torch when torch is already imported (the ONNX path never imports it; its outputs
    come back to host memory, which already waits for the device).
    """
    if device != "cuda":
        return None
    import sys
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.synchronize
