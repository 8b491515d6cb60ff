"""Device selection: `auto` → CUDA only when really usable; `cuda` without a GPU → clear error."""
import pytest
import torch

from pipeline.host import nvml
from pipeline.host.device import DeviceError, cuda_usable, resolve_device, serving_threads, synchronizer
from pipeline.measure.memory import GpuMemoryTracker, current_rss_mb, peak_rss_mb


def no_gpu():
    return False, "torch.cuda.is_available() is False"


def gpu():
    return True, "CUDA usable: Fake GPU"


def test_auto_picks_cuda_only_when_usable():
    assert resolve_device("auto", probe=no_gpu) == "cpu"
    assert resolve_device("auto", probe=gpu) == "cuda"


def test_cpu_never_probes_the_gpu():
    def probe():
        raise AssertionError("cpu must not probe CUDA")
    assert resolve_device("cpu", probe=probe) == "cpu"


def test_cuda_requested_without_gpu_is_a_clear_error():
    with pytest.raises(DeviceError, match=r"benchmark.device is 'cuda'.*is_available\(\) is False.*'auto' or 'cpu'"):
        resolve_device("cuda", probe=no_gpu)
    with pytest.raises(DeviceError, match="allowed: auto, cpu, cuda"):
        resolve_device("gpu", probe=gpu)


def test_real_probe_agrees_with_torch_on_this_machine():
    usable, why = cuda_usable()
    assert usable == torch.cuda.is_available(), why
    assert resolve_device("auto") == ("cuda" if usable else "cpu")
    if not usable:
        with pytest.raises(DeviceError):
            resolve_device("cuda")


def test_serving_threads():
    assert serving_threads("cpu", 0) == 1          # one thread per worker, one worker per core
    assert serving_threads("cuda", 0) is None      # leave the runtime's default
    assert serving_threads("cpu", 3) == 3 and serving_threads("cuda", 2) == 2
    with pytest.raises(DeviceError, match="benchmark.threads"):
        serving_threads("cpu", -1)


def test_cpu_has_no_synchroniser_and_no_gpu_memory():
    assert synchronizer("cpu") is None
    t = GpuMemoryTracker("cpu")
    t.start()
    t.sample()
    assert t.peak_mb() is None


def test_gpu_memory_tracker_counts_allocations_outside_torch(monkeypatch):
    # ONNX Runtime's CUDA EP allocates outside torch: the rise of device memory over the baseline
    readings = iter([1000.0, 1200.0, 1150.0, 1100.0])
    monkeypatch.setattr(nvml, "used_memory_mb", lambda index=0: next(readings))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = GpuMemoryTracker("cuda")
    t.start()          # baseline 1000
    t.sample()         # 1200
    t.sample()         # 1150
    assert t.peak_mb() == 200.0


def test_gpu_memory_tracker_without_any_gpu_reports_zero_not_a_guess(monkeypatch):
    monkeypatch.setattr(nvml, "used_memory_mb", lambda index=0: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = GpuMemoryTracker("cuda")
    t.start()
    t.sample()
    assert t.peak_mb() == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_gpu_memory_tracker_on_a_real_gpu():
    t = GpuMemoryTracker("cuda")
    t.start()
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    assert t.peak_mb() >= 64
    del x


def test_rss_figures_are_plausible():
    assert peak_rss_mb() >= current_rss_mb() * 0.9 > 10
