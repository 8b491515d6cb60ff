"""Make a virtual environment run as on an AVX2-only host, on a host that has AVX-512.

The pipeline must choose well on both host classes (README, "Hosts differ"), and an AVX2-only
machine is not always at hand. ONNX Runtime's MLAS, oneDNN, cpuinfo and numpy choose their
kernels from `cpuid` plus `xgetbv`, the OS's report of which register state it saves; none
offers a switch. This script rewrites every `xgetbv` instruction in the venv's native
libraries to `int3; nop; nop` and installs a SIGTRAP handler (xgetbv_trap.c, loaded by a
.pth file) that answers with the AVX-512 and AMX state bits cleared. The libraries then run
their AVX2 kernels natively, on the same cores: what differs from a real AVX2 machine is the
microarchitecture, not the code path. `torch.backends.cpu.get_cpu_capability()` reads "AVX2"
in such a venv, and the pipeline's env.json records the libraries' view (`isa_usable`).

    python scripts/hide_avx512/hide_avx512.py .venv          # patch (idempotent)
    python scripts/hide_avx512/hide_avx512.py .venv --check  # what the libraries see

Patch a venv of its own (a second clone's `make setup`): the change is not undone here.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

XGETBV = b"\x0f\x01\xd0"
TRAP = b"\xcc\x90\x90"
HERE = Path(__file__).resolve().parent
MANIFEST = "hide_avx512.json"


def load_segments(path: Path) -> list[tuple[int, int, int]]:
    """(vaddr, file offset, file size) of each LOAD segment, from readelf."""
    out = subprocess.run(["readelf", "-lW", str(path)], capture_output=True, text=True, check=True).stdout
    segments = []
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0] == "LOAD":
            offset, vaddr, filesz = (int(fields[i], 16) for i in (1, 2, 4))
            segments.append((vaddr, offset, filesz))
    return segments


def xgetbv_offsets(path: Path) -> list[int]:
    """File offsets of the instructions objdump decodes as xgetbv (not stray byte matches)."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)],
                         capture_output=True, text=True, check=True).stdout
    addresses = [int(m.group(1), 16) for m in re.finditer(r"^\s*([0-9a-f]+):\s+xgetbv\s*$", out, re.M)]
    offsets = []
    for address in addresses:
        for vaddr, offset, filesz in load_segments(path):
            if vaddr <= address < vaddr + filesz:
                offsets.append(address - vaddr + offset)
                break
    return offsets


def patch_library(path: Path) -> int:
    data = bytearray(path.read_bytes())
    if XGETBV not in data:
        return 0
    patched = 0
    for offset in xgetbv_offsets(path):
        if data[offset:offset + 3] == XGETBV:
            data[offset:offset + 3] = TRAP
            patched += 1
    if patched:
        tmp = path.with_name(path.name + ".hide_avx512")
        tmp.write_bytes(data)
        os.chmod(tmp, path.stat().st_mode)
        os.replace(tmp, path)   # a new inode: files hard-linked elsewhere stay as they were
    return patched


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        sys.exit(f"{venv}: no lib/python3*/site-packages; pass the root of a virtual environment")
    return found[0]


def patch_venv(venv: Path) -> dict:
    site = site_packages(venv)
    trap = venv / "lib" / "libxgetbv_trap.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(HERE / "xgetbv_trap.c"), "-o", str(trap)], check=True)
    # Loaded before anything imports a patched library; without it their xgetbv would trap fatally.
    (site / "00_hide_avx512.pth").write_text(f"import ctypes; ctypes.CDLL({str(trap)!r})\n")
    manifest_path = venv / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"patched": {}}
    for lib in sorted(site.rglob("*.so*")):
        if lib.is_symlink() or not lib.is_file() or str(lib.relative_to(site)) in manifest["patched"]:
            continue
        count = patch_library(lib)
        if count:
            manifest["patched"][str(lib.relative_to(site))] = count
            print(f"{lib.relative_to(site)}: {count} xgetbv", flush=True)
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


CHECK = """
import json, torch, numpy, onnxruntime
print(json.dumps({"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "mkldnn_bf16_supported": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                  "numpy_avx512f": numpy._core._multiarray_umath.__cpu_features__.get("AVX512F"),
                  "onnxruntime": onnxruntime.__version__}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("venv", type=Path)
    parser.add_argument("--check", action="store_true", help="only print what the venv's libraries see")
    args = parser.parse_args()
    if not args.check:
        patch_venv(args.venv.resolve())
    subprocess.run([str(args.venv / "bin" / "python"), "-c", CHECK], check=True)


if __name__ == "__main__":
    main()
