"""The page cache, for measuring a load from disk: how much of a file is cached (mincore) and
dropping a file's cached pages (posix_fadvise DONTNEED) without root or touching other files.

A cold start on a host that has not read the model yet (a fresh deployment, a rebooted node, a
cache pushed out by other work) reads from the disk; every other start reads from memory. The
benchmark measures both, and this module is how it gets the first one on demand.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path
from typing import Optional, Sequence

_PROT_READ, _MAP_SHARED = 0x1, 0x01
_libc = None


def _c():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
        _libc = libc
    return _libc


def supported() -> Optional[str]:
    """None when this OS can both tell and drop a file's cached pages; else why not."""
    if not hasattr(os, "posix_fadvise"):
        return "this OS has no posix_fadvise (the page cache cannot be dropped per file)"
    try:
        getattr(_c(), "mincore")
    except (OSError, AttributeError) as e:
        return f"mincore is not available here ({e})"
    return None


def resident_bytes(path: Path) -> int:
    """Bytes of `path` now in the page cache (whole pages, capped at the file's size)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = _c()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return min(size, sum(b & 1 for b in vec) * mmap.PAGESIZE)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident_share(paths: Sequence[Path]) -> float:
    """Share of the files' bytes in the page cache."""
    total = sum(os.path.getsize(p) for p in paths)
    return sum(resident_bytes(p) for p in paths) / total if total else 0.0


def evict(paths: Sequence[Path]) -> float:
    """Drop the files' pages from the page cache; returns the share still cached after it (pages
    another process has mapped, or a filesystem such as tmpfs that keeps files only in memory)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)            # dirty pages (a file just written) are not dropped until written back
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_share(paths)
