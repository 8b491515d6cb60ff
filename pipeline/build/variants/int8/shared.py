"""int8 variants: `onnx-int8-dynamic`, `onnx-int8-static` (QDQ, calibrated) and `int8` (torch).

This module holds what the three share (options, host suitability, the calibration set, the
sensitivity search's budget); the converters are in pipeline/build/variants/int8/onnx_int8.py (ONNX) and
pipeline/build/variants/int8/torch_int8.py (torch).

All three are judged by `conversion.tolerances.int8` (dtype "int8"; `gate: task` — the task's own
figures, pipeline/accuracy/task_gate.py) and share the fallback of pipeline/build/variants/int8/sensitivity.py: when the
whole-model quantization misses the gate on the calibration set, the most sensitive ops stay fp32.

Calibration set: `conversion.int8.calibration_samples` requests from the task adapter's example
distribution (handlers/tasks/__init__.py — for text the 5–15-word sentences of the serving load, for images
the golden-style pictures, for tensors the golden inputs' distribution), drawn with their own seed
so they are disjoint from the golden set that verifies the result. Reference outputs on it come from
the fp32 graph being quantized (ONNX) or the eager module (torch).

- onnx-int8-dynamic: the exported fp32 graph optimised by ORT at the BASIC level (ORT's own
  quantization pre-processing; the `onnx` variant's EXTENDED fusions would hide ops), its weight-
  bearing MatMul/Gemm/Conv quantized by onnxruntime.quantization.quantize_dynamic (int8 weights,
  per-channel where `per_channel`, activations quantized per call), then re-optimised by ORT so the
  artifact holds the fused integer kernels (MatMulIntegerToFloat / DynamicQuantizeMatMul).
- onnx-int8-static: the same graph with QDQ pairs from quantize_static; activation ranges from the
  calibration set (`conversion.int8.calibration`: minmax | entropy | percentile), u8 activations,
  s8 weights; ORT fuses the QDQ groups into integer kernels when it optimises the artifact.
- int8 (torch family): torch.ao.quantization.quantize_dynamic of nn.Linear (x86/fbgemm engine, CPU),
  traced to TorchScript like the `torchscript` variant, so the torch handler serves it unchanged.
  torch 2.13 still ships torch.ao.quantization's eager dynamic path; torchao is not installed here.

Host suitability: int8 pays where the CPU has integer dot-product instructions — AVX-512 VNNI,
AVX-VNNI, AMX-INT8, or at least AVX2, or Arm NEON/ASIMD. Without VNNI, x86 u8s8 kernels multiply
with vpmaddubsw, whose int16 pair sums saturate (255·127·2 > 32767), so the same int8 graph is less
accurate with AVX2 kernels than with VNNI ones. `reduce_range: auto` therefore quantizes weights to
7 bits exactly there (env.json's usable ISA).
GPU int8 is TensorRT's path (a calibrated TensorRT engine), which this pipeline does not build.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from pipeline.core.params_schema import Int8Params, Params, Tolerance, _default_tolerances
from pipeline.build.variants.base import BuildContext
from pipeline.build.variants.int8.sensitivity import Calibration, search
from pipeline.accuracy.task_gate_text import RERANK_GROUP

CALIBRATION_SEED_OFFSET = 7919     # calibration requests never repeat the golden set's
CALIBRATION_BATCH = 8


def calibration_rows(adapter, requests: list, wanted: int) -> list:
    """The model rows of the example requests, `wanted` of them. A request that fans out into rows
    (rerank: a query and its texts) gives its first RERANK_GROUP, so the rows come from several queries
    and each run of RERANK_GROUP rows is one query, as the rerank gate reads them."""
    rows: list = []
    for body, content_type in requests:
        rows.extend(adapter.decode_request(body, content_type).rows[:RERANK_GROUP])
        if len(rows) >= wanted:
            break
    return rows
GPU_INT8 = ("int8 on a GPU is TensorRT's path (a calibrated TensorRT engine), which this pipeline does not "
            "build; int8 variants are CPU variants")
INT8_ISA = ("amx_int8", "avx512_vnni", "avx_vnni", "avx2", "asimd", "neon")
VNNI_ISA = ("amx_int8", "avx512_vnni", "avx_vnni")     # integer dot products that do not saturate


def resolve_reduce_range(setting, env: dict) -> tuple[bool, str]:
    """`conversion.int8.reduce_range` for this host: (value, why)."""
    if setting != "auto":
        return bool(setting), "set in params.yaml"
    cpu = env.get("cpu") or {}
    isa = cpu.get("isa") or {}
    if (env.get("device") or "cpu") == "cpu" and cpu.get("arch") in ("x86_64", "AMD64") and isa \
            and not any(isa.get(k) for k in VNNI_ISA):
        return True, ("auto: this x86 CPU has no VNNI/AMX-INT8, so u8s8 kernels use vpmaddubsw, which "
                      "saturates 8-bit weights; 7-bit weights avoid it")
    return False, "auto: " + ("the CPU has VNNI/AMX-INT8 (no saturation)" if isa else "no ISA flags known (env.json)")


@dataclass(frozen=True)
class Int8Options:
    quantization: Int8Params = field(default_factory=Int8Params)
    tolerance: Tolerance = field(default_factory=lambda: _default_tolerances()["int8"])
    min_topk_agreement: float = 0.99


class Int8Mixin:
    """What the three int8 converters share: options from params, host suitability, calibration."""
    dtype = "int8"
    # Their second method is a fallback for a model the first cannot build (dynamo → legacy
    # exporter; frozen → plain trace of the same quantized module). A quantized model the gate
    # rejected comes back from it with the same ops and weights: trying it again would only be
    # another draw of the same accuracy, at the price of a second sensitivity search.
    retry_rejected = False

    @classmethod
    def int8_options(cls, params: Params) -> Int8Options:
        return Int8Options(quantization=params.conversion.int8, tolerance=params.conversion.tolerances["int8"],
                           min_topk_agreement=params.conversion.min_topk_agreement)

    @classmethod
    def host_unsuitable(cls, env: dict) -> Optional[str]:
        """Why int8 is not worth building on this host (artifacts/env.json), or None."""
        if (env.get("device") or "cpu") == "cuda":
            return GPU_INT8
        isa = (env.get("cpu") or {}).get("isa") or {}
        if isa and not any(isa.get(k) for k in INT8_ISA):
            return ("the CPU has no integer dot-product instructions (no AVX2, AVX-512 VNNI, AVX-VNNI, AMX-INT8 "
                    "or NEON): int8 kernels would not beat fp32")
        return None

    def for_host(self, env: dict):
        q = self.options.quantization
        value, why = resolve_reduce_range(q.reduce_range, env)
        resolved = type(self)(dataclasses.replace(self.options, quantization=dataclasses.replace(q, reduce_range=value)))
        resolved.reduce_range_reason = why
        return resolved

    def _q(self) -> Int8Params:
        return self.options.quantization

    def _reduce_range(self) -> bool:
        """The resolved setting ("auto" counts as off when no host was given)."""
        return self._q().reduce_range is True

    def calibration(self, ctx: BuildContext, reference) -> Calibration:
        """The calibration feeds and `reference(feeds)` → outputs on each batch."""
        adapter = ctx.golden.adapter()
        seed = int(ctx.golden.manifest.get("seed", 0)) + CALIBRATION_SEED_OFFSET
        wanted = self._q().calibration_samples
        rows = calibration_rows(adapter, adapter.example_requests(wanted, seed=seed), wanted)
        feeds = [adapter.collate(rows[i:i + CALIBRATION_BATCH]) for i in range(0, len(rows), CALIBRATION_BATCH)]
        kind = ctx.golden.task.get("kind")
        return Calibration(feeds, [reference(f) for f in feeds], list(ctx.golden.outputs), kind,
                           classification=kind == "image-classification")

    def run_search(self, candidates, quantize, run, cal: Calibration, op_errors=None, local_errors=None):
        o, q = self.options, self._q()
        # Kept on the converter: a second build method reuses the ranking and shares the budget.
        state = self.__dict__.setdefault("_search_state", {})
        return search(candidates, quantize, run, cal, o.tolerance, o.min_topk_agreement,
                      q.sensitivity_budget_s, q.max_fp32_share, op_errors=op_errors, state=state,
                      local_errors=local_errors)
