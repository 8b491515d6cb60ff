"""The environment fingerprint: parsed right, and stable run to run (the benchmarks re-run only
when it changes)."""
import json
from pathlib import Path

import psutil
import pytest

from pipeline.host.device import DeviceError
from pipeline.host.probe import ISA_FLAGS, cpu_description, fingerprint, parse_cpuinfo

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480C
physical id\t: 0
core id\t: 0
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480C
physical id\t: 0
core id\t: 0
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16

processor\t: 2
model name\t: Intel(R) Xeon(R) Platinum 8480C
physical id\t: 0
core id\t: 1
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16
"""


def test_parse_cpuinfo_model_flags_and_physical_cores():
    info = parse_cpuinfo(CPUINFO)
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8480C"
    assert info["physical_cores"] == 2          # 3 logical CPUs, two of them siblings on core 0
    assert {"avx512f", "amx_bf16", "avx512_fp16"} <= info["flags"] and "avx_vnni" not in info["flags"]


def test_cpu_description_from_text():
    cpu = cpu_description(CPUINFO, features={"AVX2": True, "AVX512F": True})
    assert cpu["isa"]["amx_bf16"] is True and cpu["isa"]["avx_vnni"] is False
    assert set(cpu["isa"]) == set(ISA_FLAGS) and "isa_disabled_by_os" not in cpu
    assert cpu["physical_cores"] == 2 and cpu["usable_cpus"] >= 1 and cpu["logical_cores"] >= 1


def test_avx512_listed_but_off_in_the_os_is_not_usable():
    # The CPU lists AVX-512 and AMX, but the OS leaves their register state off (numpy, like every
    # kernel library, checks XCR0): the kernels run AVX2, so the plan must not count on bf16/fp16.
    cpu = cpu_description(CPUINFO, features={"AVX2": True, "AVX512F": False})
    assert cpu["isa"]["avx2"] is True and cpu["isa"]["fma"] is True
    assert not any(cpu["isa"][f] for f in ("avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"))
    assert cpu["isa_disabled_by_os"] == ["amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f"]


def test_fingerprint_is_stable_and_json_serialisable():
    no_gpu = lambda: (False, "no GPU")  # noqa: E731
    a, b = fingerprint("auto", no_gpu), fingerprint("auto", no_gpu)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a["device"] == "cpu" and a["disk_read_mb_s"] is None      # no measured speeds in it
    assert a["versions"]["torch"] and a["cpu"]["physical_cores"] >= 1
    # The host's total memory in MiB (2**20), as psutil and the kernel report it.
    assert a["memory_mb"] == psutil.virtual_memory().total // 2**20
    if Path("/proc/meminfo").exists():
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
        assert a["memory_mb"] == kib // 1024
    assert set(a) == {"device", "cpu", "memory_mb", "gpu", "disk_read_mb_s", "os", "versions"}


def test_fingerprint_with_cuda_requested_but_absent_is_a_clear_error():
    with pytest.raises(DeviceError, match="benchmark.device is 'cuda'"):
        fingerprint("cuda", lambda: (False, "torch.cuda.is_available() is False"))


def test_probe_stage_writes_env_json_once(tmp_path, monkeypatch):
    from stages import inputs as stage
    out = tmp_path / "env.json"
    monkeypatch.setattr(stage, "ENV_JSON", out)
    assert stage.main(["probe"]) == 0
    first = out.read_text()
    mtime = out.stat().st_mtime_ns
    assert stage.main(["probe"]) == 0
    assert out.read_text() == first and out.stat().st_mtime_ns == mtime   # unchanged: not rewritten
    assert json.loads(first)["device"] in ("cpu", "cuda")
