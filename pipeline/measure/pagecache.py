"""The page cache, for measuring a load from disk: how much of a file is cached (mincore) and
dropping a file's cached pages (posix_fadvise DONTNEED) without root or touching other files.

A cold start on a host that has not read the model yet (a fresh deployment, a rebooted node, a
cache pushed out by other work) reads from the disk; every other start reads from memory. The
benchmark measures both, and this module is how it gets the first one on demand.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from handlers.prefetch import libc, resident_bytes


def supported() -> Optional[str]:
    """None when this OS can both tell and drop a file's cached pages; else why not."""
    if not hasattr(os, "posix_fadvise"):
        return "this OS has no posix_fadvise (the page cache cannot be dropped per file)"
    try:
        getattr(libc(), "mincore")
    except (OSError, AttributeError) as e:
        return f"mincore is not available here ({e})"
    return None


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
