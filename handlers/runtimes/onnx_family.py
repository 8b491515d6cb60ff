"""ONNX Runtime family: numpy + onnxruntime only (never torch — it would add ~1.3 s to every cold start).

The graph is optimised once at build time (pipeline/build/variants/onnx.py saves ORT's optimised model),
so sessions load it with graph optimisation disabled: a faster start (docs/handtuned.md).

Big models keep their tensors in external data files (variant.json "external_data", e.g.
model.onnx.data). ONNX Runtime resolves those relative to the model file, so such a variant is
loaded by its path inside the model directory and ORT reads (memory-maps on CPU) the data itself;
a one-file model is read as bytes first, which times the raw read separately.

Pre-packed weights (variant.json "prepacked"): on CPU, ORT re-lays every MatMul/Gemm weight out
for its kernels (MLAS "pre-packing") at each session creation — for a big model most of the load.
A variant may ship that layout, computed once at build time, in its data file beside the original
weights, with a second graph (`model.prepacked.onnx`) whose initialisers point at it; ORT then
memory-maps it instead of packing. The layout belongs to ORT's version and the CPU features its
kernels dispatch on (`packing_host()`), so the runtime uses that graph only on a host that packs
the same way, and otherwise the portable `model.onnx` (ORT packs at load, as any ONNX model).

GPU: onnxruntime-gpu lists CUDA (and TensorRT) among its providers even on a machine without a GPU
and then silently runs on CPU. So the providers are chosen explicitly and, after the session is
created, checked to really be active; a silent CPU fallback is an error, not a slow surprise.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Optional

import numpy as np
import onnxruntime as ort

from handlers.runtimes import Runtime, RuntimeLoadError, artifact_path, read_artifact

CPU_EP = "CPUExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
TENSORRT_EP = "TensorrtExecutionProvider"
GPU_EPS = (TENSORRT_EP, CUDA_EP)
# CPU features ORT's kernels (MLAS) choose their weight layout by: numpy's names, which it reports
# only where the OS enables them (XCR0), so a masked AVX-512 counts as absent, as it does for MLAS.
PACKING_FEATURES = ("AVX", "AVX2", "FMA3", "F16C", "AVX512F", "AVX512BW", "AVX512DQ", "AVX512VL", "AVX512VNNI",
                    "AVX512BF16", "AVX512FP16", "ASIMD", "ASIMDDP", "ASIMDHP", "SVE")
PACKING_CPUINFO_FLAGS = ("avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "amx_fp16")   # numpy does not list them


def choose_providers(device: str, available: list[str], tensorrt: bool = False) -> list[str]:
    """Execution providers to ask for, in priority order (CPU last as ORT requires for fallbacks)."""
    if device == "cpu":
        return [CPU_EP]
    if device != "cuda":
        raise RuntimeLoadError(f"device {device!r} is invalid for ONNX Runtime; use 'cpu' or 'cuda'")
    if CUDA_EP not in available:
        raise RuntimeLoadError(
            f"device 'cuda' asked but this onnxruntime build has no {CUDA_EP} (available: {available}); "
            f"install onnxruntime-gpu (not onnxruntime) or run on device 'cpu'")
    chosen = [TENSORRT_EP] if tensorrt and TENSORRT_EP in available else []
    return chosen + [CUDA_EP, CPU_EP]


def check_providers_active(device: str, requested: list[str], active: list[str]) -> str:
    """The provider really doing the work; raises when a GPU was asked for but ORT fell back to CPU."""
    if device == "cpu":
        return CPU_EP
    gpu_active = [p for p in active if p in GPU_EPS]
    if not gpu_active:
        raise RuntimeLoadError(
            f"asked ONNX Runtime for {requested} but the session runs only on {active}: the GPU provider "
            f"could not start (no usable GPU, or CUDA/cuDNN libraries missing — see onnxruntime's log). "
            f"Run on device 'cpu' or fix the CUDA installation")
    return gpu_active[0]


def session_options(threads: Optional[int], graph_optimized: bool) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL if graph_optimized
                                   else ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.inter_op_num_threads = 1
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3          # errors only: ORT's warnings are noise in serving logs
    return so


def packing_host() -> dict:
    """What decides the layout ORT pre-packs weights into on this host: its version, the machine,
    and the CPU features its kernels dispatch on. Two hosts with equal dicts pack alike."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:                     # numpy < 2
        from numpy.core._multiarray_umath import __cpu_features__ as features
    try:
        flags = set(next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo")
                          if ln.startswith(("flags", "Features"))), []))
    except OSError:
        flags = set()
    return {"onnxruntime": ort.__version__, "machine": platform.machine().lower(),
            "features": sorted([f for f in PACKING_FEATURES if features.get(f)] +
                               [f for f in PACKING_CPUINFO_FLAGS if f in flags])}


def packing_mismatch(built: dict, here: dict) -> Optional[str]:
    """Why weights pre-packed on `built` cannot be used on `here`, or None."""
    diffs = []
    for key in ("onnxruntime", "machine"):
        if built.get(key) != here.get(key):
            diffs.append(f"{key} {built.get(key)} there, {here.get(key)} here")
    a, b = set(built.get("features") or ()), set(here.get("features") or ())
    if a != b:
        diffs.append("CPU features " + ", ".join([f"+{f}" for f in sorted(b - a)] + [f"-{f}" for f in sorted(a - b)]))
    return "; ".join(diffs) or None


def session_source(model_dir: Path, variant: dict, device: str) -> tuple[str, Optional[str]]:
    """The graph to create the session from (prepacked where this host packs like the build host)
    and, when the prepacked one is passed over, why."""
    external = variant.get("external_data") or []
    if not external:
        return read_artifact(model_dir, variant), None
    packed = variant.get("prepacked")
    note = None
    if packed and device == "cpu":
        note = packing_mismatch(packed.get("host") or {}, packing_host())
        if note is None:
            return external_model_path(model_dir, variant, external, packed["artifact"]), None
        note = f"weights pre-packed on another kind of host ({note}): ONNX Runtime packs them at load"
    return external_model_path(model_dir, variant, external), note


class OnnxSessionRuntime(Runtime):
    def __init__(self, variant: dict, model_dir: Path, device: str, threads: Optional[int], tensorrt: bool):
        super().__init__(variant, model_dir, device, threads)
        t0 = time.perf_counter()
        source, self.prepack_note = session_source(model_dir, variant, device)
        self.prepacked = bool(variant.get("prepacked")) and device == "cpu" and self.prepack_note is None
        t1 = time.perf_counter()
        self.requested_providers = choose_providers(device, ort.get_available_providers(), tensorrt)
        self.session = ort.InferenceSession(
            source, sess_options=session_options(threads, bool(variant.get("graph_optimized", False))),
            providers=self.requested_providers)
        self.provider = check_providers_active(device, self.requested_providers, self.session.get_providers())
        t2 = time.perf_counter()
        self.load_phases.update(read=t1 - t0, deserialize=t2 - t1, to_device=0.0)
        graph_inputs = [i.name for i in self.session.get_inputs()]
        if sorted(graph_inputs) != sorted(self.input_names):
            raise RuntimeLoadError(f"{variant['artifact']} takes inputs {graph_inputs} but variant.json "
                                   f"declares {self.input_names}; rebuild the variant")

    def _run(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return self.session.run(self.output_names, dict(zip(self.input_names, arrays)))

    def close(self) -> None:
        self.session = None


def external_model_path(model_dir: Path, variant: dict, external: list[str], graph: Optional[str] = None) -> str:
    """The model file's path (`graph`, default the artifact), after checking its external data
    files are beside it."""
    missing = [name for name in [*external, *([graph] if graph else [])] if not (model_dir / name).is_file()]
    if missing:
        raise RuntimeLoadError(f"{model_dir}: file(s) {missing} of {variant['artifact']} are missing; "
                               f"copy the whole variant folder (variant.json lists every file) or rebuild it")
    return str(model_dir / graph) if graph else str(artifact_path(model_dir, variant))


def load(variant: dict, model_dir: Path, device: str, threads: Optional[int], tensorrt: bool = False) -> Runtime:
    if variant["format"] != "onnx":
        raise RuntimeLoadError(f"format {variant['format']!r} is not an ONNX format; variant.json is inconsistent")
    return OnnxSessionRuntime(variant, model_dir, device, threads, tensorrt)
