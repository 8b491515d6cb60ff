"""handlers/runtimes/: dispatch by family, dtype casting, load phases, ONNX provider choice and
the check that a GPU provider is really active, and that the ONNX path never imports torch."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from handlers.runtimes import RuntimeLoadError, load_runtime
from handlers.runtimes.onnx_family import (CPU_EP, CUDA_EP, TENSORRT_EP, check_providers_active,
                                   choose_providers)
from pipeline.core.params import REPO_ROOT

ALL_EPS = [TENSORRT_EP, CUDA_EP, CPU_EP]


def write_variant(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"variant": "t", "family": "onnx", "format": "onnx", "artifact": "model.onnx", "dtype": "float32",
            "device": "cpu", "inputs": [{"name": "x", "dtype": "float32"}], "outputs": [{"name": "y"}],
            "task": {"kind": "tensor"}, "files": ["model.onnx", "variant.json"], "graph_optimized": False}
    meta.update(fields)
    (folder / "variant.json").write_text(json.dumps(meta))
    return folder


@pytest.fixture
def onnx_folder(tmp_path):
    """y = x @ W + b, built with onnx.helper (no torch), dynamic batch."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8                 # onnx may stamp an IR newer than this onnxruntime reads
    folder = write_variant(tmp_path / "onnx")
    onnx.save(model, str(folder / "model.onnx"))
    return folder, w, b


# --------------------------------------------------------------------------- provider logic (pure)
def test_cpu_asks_for_the_cpu_provider_only():
    assert choose_providers("cpu", ALL_EPS) == [CPU_EP]
    assert check_providers_active("cpu", [CPU_EP], [CPU_EP]) == CPU_EP


def test_cuda_asks_for_cuda_then_cpu_and_tensorrt_only_when_asked():
    assert choose_providers("cuda", ALL_EPS) == [CUDA_EP, CPU_EP]
    assert choose_providers("cuda", ALL_EPS, tensorrt=True) == [TENSORRT_EP, CUDA_EP, CPU_EP]
    assert choose_providers("cuda", [CUDA_EP, CPU_EP], tensorrt=True) == [CUDA_EP, CPU_EP]


def test_cuda_without_a_cuda_build_is_a_clear_error():
    with pytest.raises(RuntimeLoadError, match="onnxruntime-gpu"):
        choose_providers("cuda", [CPU_EP])
    with pytest.raises(RuntimeLoadError, match="invalid"):
        choose_providers("tpu", ALL_EPS)


def test_silent_cpu_fallback_is_refused():
    with pytest.raises(RuntimeLoadError, match="runs only on"):
        check_providers_active("cuda", [CUDA_EP, CPU_EP], [CPU_EP])
    assert check_providers_active("cuda", [CUDA_EP, CPU_EP], [CUDA_EP, CPU_EP]) == CUDA_EP
    assert check_providers_active("cuda", [TENSORRT_EP, CUDA_EP, CPU_EP], [TENSORRT_EP, CUDA_EP, CPU_EP]) == TENSORRT_EP


def test_onnx_on_cuda_really_runs_on_the_gpu_or_refuses(onnx_folder):
    # onnxruntime-gpu lists CUDA even without a GPU; the session must not quietly run on CPU.
    folder, w, b = onnx_folder
    try:
        rt = load_runtime(folder, device="cuda")
    except RuntimeLoadError as e:
        assert "cpu" in str(e).lower()
        return
    assert rt.provider in (CUDA_EP, TENSORRT_EP)


# --------------------------------------------------------------------------- running
def test_onnx_runtime_runs_and_reports_load_phases(onnx_folder):
    folder, w, b = onnx_folder
    rt = load_runtime(folder, threads=1)
    assert rt.input_names == ["x"] and rt.output_names == ["y"]
    assert set(rt.load_phases) == {"import", "read", "deserialize", "to_device"}
    assert all(v >= 0 for v in rt.load_phases.values())
    x = np.arange(20, dtype=np.float64).reshape(5, 4)          # float64 in: cast to the declared float32
    (y,) = rt.run({"x": x})
    assert y.dtype == np.float32 and y.shape == (5, 3)
    np.testing.assert_allclose(y, x.astype(np.float32) @ w + b, rtol=1e-5)
    with pytest.raises(KeyError, match=r"\['x'\]"):
        rt.run({"pixels": x})
    rt.close()


def test_onnx_runtime_never_imports_torch(onnx_folder):
    folder, _, _ = onnx_folder
    code = ("import sys, numpy as np\n"
            "from handlers.runtimes import load_runtime\n"
            f"rt = load_runtime({str(folder)!r}, threads=1)\n"
            "rt.run({'x': np.ones((2, 4), np.float32)})\n"
            "assert 'torch' not in sys.modules, 'the ONNX path imported torch'\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_half_torchscript_takes_and_returns_float32(tmp_path):
    import torch
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3).eval()
    for dtype, tdtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        folder = write_variant(tmp_path / dtype, family="torch", format="torchscript", artifact="model.pt",
                               dtype=dtype, inputs=[{"name": "x", "dtype": dtype}])
        half = torch.nn.Linear(4, 3).eval()
        half.load_state_dict(module.state_dict())
        torch.jit.trace(half.to(tdtype), torch.ones(1, 4, dtype=tdtype)).save(str(folder / "model.pt"))
        t0 = time.perf_counter()
        rt = load_runtime(folder, threads=1)
        load_s = time.perf_counter() - t0
        x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
        (y,) = rt.run({"x": x})
        assert y.dtype == np.float32 and y.shape == (3, 3)
        with torch.inference_mode():
            ref = module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(y, ref, atol=5e-2, rtol=5e-2)
        # import, read, deserialize and to_device are consecutive parts of the load, each timed.
        phases = rt.load_phases
        assert set(phases) == {"import", "read", "deserialize", "to_device"}
        assert phases["deserialize"] > 0 and min(phases.values()) >= 0
        assert sum(phases.values()) <= load_s
        rt.close()


def mapped_files(address: int) -> list[str]:
    """The files this process maps at `address` (Linux /proc/self/maps)."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(None, 5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= address < hi and len(parts) == 6:
            found.append(parts[5].strip())
    return found


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_eager_program_weights_are_mapped_from_the_archive_not_copied(tmp_path):
    """The eager variant's weights are slices of one mapping of the .pt2 (no copy out of the archive),
    with torch.export.load's outputs; a record that cannot be mapped (an empty buffer) loads as torch does."""
    import torch
    from handlers.runtimes.torch_family import load_exported_program

    class Net(torch.nn.Module):
        def __init__(self, empty: bool):
            super().__init__()
            self.fc = torch.nn.Linear(64, 32)
            self.register_buffer("shift", torch.arange(32, dtype=torch.float32))
            if empty:
                self.register_buffer("nothing", torch.zeros(0))

        def forward(self, x):
            return self.fc(x) + self.shift

    torch.manual_seed(0)
    x = torch.randn(3, 64)
    for empty in (False, True):
        path = tmp_path / f"exported-{empty}.pt2"
        torch.export.save(torch.export.export(Net(empty).eval(), (x,)), str(path))
        mapped, plain = load_exported_program(path).module(), torch.export.load(str(path)).module()
        with torch.inference_mode():
            assert torch.equal(mapped(x), plain(x))
        weight = mapped.fc.weight
        in_archive = str(path.resolve()) in mapped_files(weight.data_ptr())
        assert in_archive is (not empty), mapped_files(weight.data_ptr())
    from torch.export.pt2_archive import _package
    assert _package._build_file_map.__name__ == "_build_file_map"      # torch's own again after the load


def _script_net(constant: bool = False):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 32)
            self.register_buffer("shift", torch.arange(32, dtype=torch.float32))

        def forward(self, x):
            y = torch.relu(self.fc(x)) + self.shift
            return y * torch.tensor(2.0, dtype=y.dtype) if constant else y   # a tensor constant in the trace

    torch.manual_seed(0)
    return Net().eval()


def _graph_tensors(module) -> list:
    """The tensors a frozen TorchScript module's graph holds as constants."""
    import torch
    return [n.output().toIValue() for n in module.graph.findAllNodes("prim::Constant")
            if isinstance(n.output().type(), torch._C.TensorType)]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
@pytest.mark.filterwarnings("ignore:torch.tensor results are registered as constants")
def test_torchscript_tensors_are_mapped_from_the_archive_not_copied(tmp_path):
    """A frozen archive's constants (fp32, bf16) and a plain trace's parameters are slices of one
    mapping of the .pt, with torch.jit.load's code and outputs; where both pickles use one storage
    key (a plain trace holding a tensor constant) it loads as torch.jit.load does."""
    import torch
    from handlers.runtimes.torch_family import load_torchscript
    x = torch.randn(3, 64)
    for dtype in (torch.float32, torch.bfloat16):
        net = _script_net().to(dtype)
        path = tmp_path / f"frozen-{dtype}.pt"
        torch.jit.freeze(torch.jit.trace(net, x.to(dtype)).eval()).save(str(path))
        mapped, plain = load_torchscript(path), torch.jit.load(str(path))
        assert str(mapped.code) == str(plain.code)
        with torch.inference_mode():
            for _ in range(3):       # the profiling executor's runs: profiled, optimised, then as optimised
                assert torch.equal(mapped(x.to(dtype)), plain(x.to(dtype)))
        constants = _graph_tensors(mapped)
        assert constants and all(str(path.resolve()) in mapped_files(t.data_ptr()) for t in constants)
    for constant in (False, True):
        path = tmp_path / f"trace-{constant}.pt"
        torch.jit.trace(_script_net(constant), x).save(str(path))
        mapped, plain = load_torchscript(path), torch.jit.load(str(path))
        with torch.inference_mode():
            assert torch.equal(mapped(x), plain(x))
        in_archive = str(path.resolve()) in mapped_files(mapped.fc.weight.data_ptr())
        assert in_archive is (not constant)


def test_torchscript_loads_as_torch_does_where_the_mapped_import_fails(tmp_path, monkeypatch, caplog):
    import torch
    from handlers.runtimes.torch_family import load_torchscript
    x = torch.randn(3, 64)
    path = tmp_path / "frozen.pt"
    torch.jit.freeze(torch.jit.trace(_script_net(), x).eval()).save(str(path))

    def broken(*args):
        raise RuntimeError("a package loader of another kind")
    monkeypatch.setattr(torch._C, "_import_ir_module_from_package", broken)
    module = load_torchscript(path)
    with torch.inference_mode():
        assert torch.equal(module(x), torch.jit.load(str(path))(x))
    assert "loading it with torch.jit.load" in caplog.text


def test_torchscript_loads_on_one_thread_and_gives_the_threads_back(tmp_path, monkeypatch):
    """Compiling the program compares its constants pairwise (aten::equal), each an OpenMP region with
    more threads: the load runs on one, the runtime's threads are back after it."""
    import torch
    from handlers.runtimes.torch_family import load_torchscript
    x = torch.randn(3, 64)
    path = tmp_path / "frozen.pt"
    torch.jit.freeze(torch.jit.trace(_script_net(), x).eval()).save(str(path))
    importer, seen = torch._C._import_ir_module_from_package, []

    def counting(*args):
        seen.append(torch.get_num_threads())
        return importer(*args)
    monkeypatch.setattr(torch._C, "_import_ir_module_from_package", counting)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        load_torchscript(path)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_torchscript_on_cpu_runs_as_saved_and_warms_up_once(tmp_path, monkeypatch):
    """Without a CPU fuser the graph runs as saved: the same outputs as the profiling executor's
    (profiled call, optimising call, optimised calls) and one warm-up call. Where the executor
    optimises (a GPU) it keeps it and warms up twice."""
    import torch
    import handlers.runtimes.torch_family as rt_torch
    folder = write_variant(tmp_path / "ts", family="torch", format="torchscript", artifact="model.pt")
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    torch.jit.freeze(torch.jit.trace(_script_net(), torch.from_numpy(x)).eval()).save(str(folder / "model.pt"))
    plain = torch.jit.load(str(folder / "model.pt"))
    runtime = load_runtime(folder, threads=1)
    assert runtime.plain_executor and runtime.warmup_calls == 1
    with torch.inference_mode():
        for n in range(1, 5):
            (y,) = runtime.run({"x": x[:n % 3 + 1]})
            np.testing.assert_array_equal(y, plain(torch.from_numpy(x[:n % 3 + 1])).numpy())
    assert torch._C._get_graph_executor_optimize()            # the switch is back after each call
    monkeypatch.setattr(rt_torch, "executor_optimizes", lambda device: True)
    runtime = load_runtime(folder, threads=1)
    assert not runtime.plain_executor and runtime.warmup_calls == 2


def test_clear_errors_for_bad_folders_and_devices(tmp_path):
    with pytest.raises(RuntimeLoadError, match="stages.convert"):
        load_runtime(tmp_path / "nothing")
    folder = write_variant(tmp_path / "x", family="tensorflow")
    with pytest.raises(RuntimeLoadError, match="family 'tensorflow'"):
        load_runtime(folder)
    folder = write_variant(tmp_path / "aoti", family="torch", format="aoti", artifact="aoti.pt2", device="cuda")
    with pytest.raises(RuntimeLoadError, match="compiled for 'cuda'"):
        load_runtime(folder, device="cpu")
    folder = write_variant(tmp_path / "gone")
    with pytest.raises(RuntimeLoadError, match="lacks it"):
        load_runtime(folder)
    with pytest.raises(RuntimeLoadError, match="device"):
        load_runtime(folder, device="gpu")
    with pytest.raises(RuntimeLoadError, match="threads"):
        load_runtime(folder, threads=0)
