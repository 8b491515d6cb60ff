"""Minimal NVML reader via ctypes (no extra package): GPU name, memory, driver, CUDA driver version.

Used to describe a GPU and to read device memory when the runtime is not torch (ONNX Runtime on
CUDA allocates outside torch's allocator). Returns None wherever NVML is absent.
"""
from __future__ import annotations

import ctypes
from typing import Optional

_lib = None


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml():
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return None
            _lib = lib
        except (OSError, AttributeError):
            return None
    return _lib


def _handle(lib, index: int):
    h = ctypes.c_void_p()
    return h if lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(h)) == 0 else None


def device_count() -> int:
    lib = _nvml()
    if lib is None:
        return 0
    n = ctypes.c_uint()
    return n.value if lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) == 0 else 0


def gpu_description(index: int = 0) -> Optional[dict]:
    """{"name", "memory_mb", "driver", "cuda"} of GPU `index`, or None without NVML/GPU."""
    lib = _nvml()
    if lib is None or device_count() <= index:
        return None
    h = _handle(lib, index)
    if h is None:
        return None
    name = ctypes.create_string_buffer(96)
    driver = ctypes.create_string_buffer(96)
    mem = _Memory()
    cuda = ctypes.c_int()
    lib.nvmlDeviceGetName(h, name, 96)
    lib.nvmlSystemGetDriverVersion(driver, 96)
    lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem))
    ok_cuda = lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(cuda)) == 0
    return {
        "name": name.value.decode(errors="replace"),
        "memory_mb": mem.total // 2**20,
        "driver": driver.value.decode(errors="replace"),
        "cuda": f"{cuda.value // 1000}.{cuda.value % 1000 // 10}" if ok_cuda else None,
    }


def used_memory_mb(index: int = 0) -> Optional[float]:
    """Device-wide memory in use (MiB), or None without NVML."""
    lib = _nvml()
    if lib is None:
        return None
    h = _handle(lib, index)
    mem = _Memory()
    if h is None or lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem)) != 0:
        return None
    return mem.used / 2**20
