"""Environment fingerprint: what the benchmarks ran on.

Its content must be STABLE on one machine (the probe stage always runs, and the benchmarks re-run
only when it changes): no timestamps, no measured speeds, no free-memory figures — only what
identifies the hardware and the software stack.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Callable, Optional

from pipeline.host import nvml
from pipeline.host.device import cuda_usable, resolve_device

# ISA extensions that decide which dtypes/kernels are fast on a CPU
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd")
PACKAGES = ("torch", "onnxruntime-gpu", "onnx", "onnxscript", "transformers", "tokenizers", "numpy",
            "safetensors", "torchserve", "torch-model-archiver", "dvc")


def parse_cpuinfo(text: str) -> dict:
    """Model name, ISA flags and physical core count from /proc/cpuinfo text."""
    model, flags, cores = None, set(), set()
    phys = core = None
    for line in text.splitlines() + [""]:
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("model name", "Model", "Hardware") and model is None:
            model = value
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
        elif key == "physical id":
            phys = value
        elif key == "core id":
            core = value
        elif not line.strip():          # end of one processor's block
            if core is not None:
                cores.add((phys, core))
            phys = core = None
    return {"model": model, "flags": flags, "physical_cores": len(cores) or None}


# Register state the OS must save for these flags to be usable: a listed flag is unusable when the
# OS (or a hypervisor) leaves the state off in XCR0, and then every library falls back to AVX2.
OS_STATE_GATED = ("avx512", "amx_")


def usable_cpu_features() -> Optional[dict]:
    """numpy's runtime dispatch table: cpuid AND the OS's XCR0, as every kernel library checks it.
    None when numpy does not expose it."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:
        return None
    return dict(__cpu_features__)


def os_disabled_flags(listed: set, features: Optional[dict]) -> list[str]:
    """ISA flags that /proc/cpuinfo lists but the OS does not let a process use. AVX-512 and AMX
    need the ZMM/tile state enabled; a CPU listing avx512f whose AVX512F numpy cannot use has that
    state off, so none of the avx512*/amx* flags are usable (ONNX Runtime's MLAS, oneDNN and
    cpuinfo all run their AVX2 kernels then)."""
    if not features or "avx512f" not in listed or features.get("AVX512F", True):
        return []
    return sorted(f for f in ISA_FLAGS if f in listed and f.startswith(OS_STATE_GATED))


def cpu_description(cpuinfo_text: Optional[str] = None, features: Optional[dict] = None) -> dict:
    if cpuinfo_text is None:
        try:
            cpuinfo_text = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo_text = ""
    info = parse_cpuinfo(cpuinfo_text)
    physical = info["physical_cores"]
    if physical is None:
        import psutil
        physical = psutil.cpu_count(logical=False)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    disabled = os_disabled_flags(info["flags"], usable_cpu_features() if features is None else features)
    description = {
        "model": info["model"] or platform.processor() or None,
        "arch": platform.machine(),
        "physical_cores": physical,
        "logical_cores": os.cpu_count(),
        "usable_cpus": usable,          # affinity mask / container limit: what this process may use
        # what the kernels can use: listed by the CPU and enabled by the OS
        "isa": {flag: flag in info["flags"] and flag not in disabled for flag in ISA_FLAGS},
    }
    if disabled:
        description["isa_disabled_by_os"] = disabled
    return description


def memory_mb() -> int:
    import psutil
    return psutil.virtual_memory().total // 2**20


def gpu_description() -> Optional[dict]:
    """NVML first (driver truth); torch.cuda as a fallback. None without a usable GPU."""
    desc = nvml.gpu_description(0)
    if desc is not None:
        desc["count"] = nvml.device_count()
        return desc
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        return {"name": props.name, "memory_mb": props.total_memory // 2**20, "driver": None,
                "cuda": torch.version.cuda, "count": torch.cuda.device_count()}
    except Exception:
        return None


def library_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def fingerprint(requested_device: str, probe: Callable[[], tuple[bool, str]] = cuda_usable) -> dict:
    """The env.json document (see docs/artifacts.md). Raises DeviceError when `cuda` is requested
    but no usable GPU exists."""
    return {
        "device": resolve_device(requested_device, probe),
        "cpu": cpu_description(),
        "memory_mb": memory_mb(),
        "gpu": gpu_description(),
        # a measured speed would change run to run and re-trigger every benchmark: the measured
        # raw read of each artifact is in metrics/benchmark/<v>.json (cold_load.raw_read_mb_s)
        "disk_read_mb_s": None,
        "os": {"system": platform.system(), "release": platform.release()},
        "versions": library_versions(),
    }
