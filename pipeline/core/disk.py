"""Bytes on disk, counted as the filesystem counts them: a file hard-linked into DVC's cache (or
anywhere else) takes its blocks once, however many names it has. Used by the stage records and the
disk plan, so a run's footprint is measured the way `df` would see it."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable


@dataclass
class Footprint:
    files: int = 0
    bytes: int = 0                 # apparent size, every name counted (what a copy would write)
    on_disk_bytes: int = 0         # allocated blocks, each inode once
    linked_files: int = 0          # files with more than one name (hard links: shared with the cache)

    def as_dict(self) -> dict:
        return asdict(self)


def _walk(path: Path) -> Iterable[Path]:
    if path.is_symlink():
        return
    if path.is_file():
        yield path
    elif path.is_dir():
        for root, _dirs, names in os.walk(path):
            for name in names:
                p = Path(root) / name
                if not p.is_symlink():
                    yield p


def footprint(paths: Iterable[Path], seen: set | None = None) -> Footprint:
    """What `paths` (files or folders) take. `seen`: inodes already counted by the caller (a shared
    set counts the workspace and the cache together, links once)."""
    seen = set() if seen is None else seen
    fp = Footprint()
    for top in paths:
        for p in _walk(Path(top)):
            try:
                st = p.stat()
            except OSError:
                continue
            fp.files += 1
            fp.bytes += st.st_size
            if st.st_nlink > 1:
                fp.linked_files += 1
            key = (st.st_dev, st.st_ino)
            if key not in seen:
                seen.add(key)
                fp.on_disk_bytes += st.st_blocks * 512
    return fp


def device_of(path: Path) -> int:
    """The filesystem `path` is on (its nearest existing ancestor's)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return p.stat().st_dev


def mount_point(path: Path) -> Path:
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p
