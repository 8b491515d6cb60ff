"""The GPU code paths on a real CUDA GPU: skipped where torch sees none (CI has no GPU); on a GPU host
run `pytest tests/host/test_gpu.py`. What `benchmark.device: cuda` (or `auto` on a GPU host) makes the
pipeline do: the probe records the GPU; each variant built for the GPU converts, verifies against the
fp32 reference, and benchmarks there with its GPU memory measured (AOTInductor keeps its .pt2, whose
cubins the library needs; int8 is refused for its reason); the handlers serve from the GPU that
TorchServe assigns a worker (gpu_id), batch-mates unharmed by a bad request."""
from __future__ import annotations

import json

import pytest
import torch

from pipeline.host.device import cuda_usable

USABLE, WHY = cuda_usable()
pytestmark = pytest.mark.skipif(not USABLE, reason=f"no usable CUDA GPU here ({WHY})")

GPU_VARIANTS = ["eager", "torchscript", "fp16", "bf16", "aoti", "onnx", "onnx-fp16"]
GPU_BENCH = dict(batch_sizes=(1, 4), cold_runs=1, steady_runs=1, warmup_iters=2, min_iters=10,
                 min_duration_s=0.05, max_cv=10.0, min_gain=-1.0, latency_cap_ms=10_000)


def ort_has_cuda() -> bool:
    import onnxruntime as ort
    return "CUDAExecutionProvider" in ort.get_available_providers()


NEEDS_ORT_CUDA = pytest.mark.skipif(not (USABLE and ort_has_cuda()),
                                    reason="this onnxruntime has no CUDAExecutionProvider (the pinned onnxruntime-gpu has it)")


def on_gpu(*names: str) -> list:
    """`names` as parameters; the ONNX ones run only where ONNX Runtime has its CUDA provider."""
    return [pytest.param(n, marks=NEEDS_ORT_CUDA) if n.startswith("onnx") else n for n in names]


def test_the_probe_records_the_gpu():
    from pipeline.host.probe import fingerprint
    env = fingerprint("auto")
    assert env["device"] == "cuda"
    gpu = env["gpu"]
    assert gpu["count"] >= 1 and gpu["memory_mb"] > 1000
    assert gpu["name"] in (torch.cuda.get_device_name(0), torch.cuda.get_device_name(0).replace("NVIDIA ", ""))


@pytest.mark.parametrize("variant", on_gpu(*GPU_VARIANTS))
def test_variant_converts_verifies_and_benchmarks_on_the_gpu(variant, text_params, tmp_path):
    from pipeline.model.checkpoint import load_model
    from pipeline.model.golden import write_golden
    from pipeline.measure.runner import BenchmarkSettings, benchmark_or_record
    from pipeline.build.variants.base import get_converter
    from pipeline.build.builder import build_variant
    from pipeline.accuracy.verify import tolerance_for
    loaded = load_model(text_params)
    golden = write_golden(text_params, loaded, tmp_path / "golden")
    converter = get_converter(variant).from_params(text_params)
    out = tmp_path / variant
    record = build_variant(converter, loaded, golden, out, "cuda", tolerance_for(text_params, converter.dtype),
                           text_params.conversion.min_topk_agreement)
    assert record["status"] == "converted", (record["reason"], record.get("attempts"))
    meta = json.loads((out / "variant.json").read_text())
    assert meta["device"] == "cuda"
    if variant == "aoti":
        assert meta["artifact"].endswith(".pt2")       # CUDA keeps the package: the library needs its cubins
    r = benchmark_or_record(out, variant, BenchmarkSettings(**GPU_BENCH), "cuda")
    assert r["status"] == "ok", r["reason"]
    assert r["device"] == "cuda" and list(r["steady"]) == ["1", "4"]
    for s in r["steady"].values():
        assert 0 < s["p50_ms"] <= s["p99_ms"]
        assert s["peak_gpu_mb"] is not None and s["peak_gpu_mb"] > 0, s
    assert r["cold_load"]["phases_ms"]["first_call"]["median"] > 0


def test_int8_is_refused_on_the_gpu_with_its_reason():
    from pipeline.build.variants.base import get_converter
    from pipeline.build.variants.int8.shared import GPU_INT8
    for variant in ("int8", "onnx-int8-dynamic", "onnx-int8-static"):
        assert get_converter(variant).host_unsuitable({"device": "cuda"}) == GPU_INT8


@pytest.mark.parametrize("fmt", on_gpu("torchscript", "eager", "onnx"))
def test_handlers_serve_from_the_gpu_torchserve_assigns(fmt, tmp_path):
    from handlers.onnx_handler import OnnxHandler
    from handlers.torch_handler import TorchHandler
    from tests.handlers.test_handlers import MALFORMED, VALID, close_enough, make_context, make_variant, reference, serve_batch
    folder, model = make_variant(tmp_path, "tensor", fmt)
    meta = json.loads((folder / "variant.json").read_text())
    (folder / "variant.json").write_text(json.dumps({**meta, "device": "cuda"}))   # built for the GPU
    handler = (OnnxHandler if fmt == "onnx" else TorchHandler)()
    handler.initialize(make_context(folder, {"threads": 1, "warmup_batch_size": 2}, gpu=0))
    assert handler.runtime.device == "cuda"
    valid = [VALID["tensor"](i) for i in range(3)]
    answers = serve_batch(handler, make_context(folder, {"threads": 1}, gpu=0), [MALFORMED["tensor"][0], *valid])
    assert 400 <= answers[0][0] < 500
    for (status, body), request in zip(answers[1:], valid):
        assert status == 200, body
        close_enough(body, reference("tensor", model, folder, *request), 1e-3)   # TF32/cuDNN vs CPU fp32
    if fmt != "onnx":
        assert torch.cuda.memory_allocated() > 0
    handler.close()

