"""Reading a model's weights file ahead of the loader that maps it, when it is not in memory yet.

ONNX Runtime memory-maps external data and reads it by page faults as the session touches each
weight: from a disk, a fault-driven read of the served bert-large int8 (741 MB) took 545 ms where a
sequential read of the same bytes took 320–500 ms. A thread that reads the file sequentially while the
session is being created (ORT releases the GIL while it builds the session) turns those faults into
page-cache hits: the same session from disk in 370–400 ms. From memory there is nothing to read, so
a file already mostly in the page cache is not read again (that would only take a core from the
loader, and from the other workers starting beside it).

Standard library only: packed into the .mar with the handlers; pipeline/measure/pagecache.py uses
`resident_bytes` from here.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from pathlib import Path
from typing import Optional, Sequence

READ_CHUNK = 16 * 2**20
RESIDENT_ENOUGH = 0.5          # a file at least this much in memory is not read ahead
_PROT_READ, _MAP_SHARED = 0x1, 0x01
_libc = None


def libc():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long)
        lib.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        lib.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
        _libc = lib
    return _libc


def resident_bytes(path: Path) -> int:
    """Bytes of `path` now in the page cache (whole pages, capped at the file's size)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    lib = libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = lib.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if lib.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return min(size, sum(b & 1 for b in vec) * mmap.PAGESIZE)
        finally:
            lib.munmap(addr, size)
    finally:
        os.close(fd)


def _read(paths: Sequence[Path]) -> None:
    view = memoryview(bytearray(READ_CHUNK))
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass


class Prefetch:
    """`with Prefetch(files):` around a load that maps `files` — they are read sequentially in a
    background thread unless already (mostly) in memory; leaving the block waits for that read, so
    the load it wraps is timed with it. `bytes` says how much was read ahead (0: nothing was)."""

    def __init__(self, paths: Sequence[Path]):
        self.paths = [Path(p) for p in paths]
        self.bytes = 0
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Prefetch":
        try:
            cold = [p for p in self.paths if resident_bytes(p) < RESIDENT_ENOUGH * os.path.getsize(p)]
        except (OSError, AttributeError):          # no mincore here: read nothing rather than guess
            cold = []
        if cold:
            self.bytes = sum(os.path.getsize(p) for p in cold)
            self._thread = threading.Thread(target=_read, args=(cold,), name="prefetch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._thread.join()
