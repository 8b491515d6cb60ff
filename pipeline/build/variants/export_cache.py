"""The torch → ONNX export, done once per model and shared by the ONNX variants built from it.

`onnx`, `onnx-fp16`, `onnx-int8-dynamic` and `onnx-int8-static` are four DVC stages, four processes,
and each began with the same fp32 export, for a big model a large share of their time. The first
build keeps its exported files here; the next ones copy them, far faster than exporting again.

The key is what the export is a function of, read from the module itself, so a stale entry cannot
be hit: every state_dict tensor's name, dtype, shape and bytes (sha256), the module
tree (repr) and the configs of Hugging Face sub-modules, the source files of every module class in
it, the input/output names, dtypes, example shapes and dynamic axes, the exporter and its options,
this package's export code, and the torch / onnx / onnxscript / transformers versions.

Where: $PIPELINE_CACHE_DIR/onnx-export (default ~/.cache/model-pipeline), outside the repository
and outside DVC's outputs, like the inductor and Hugging Face caches. Graph files go in and out as
hard links where the cache and the build share a filesystem (else as copies); external data is
copied, because onnx's checker refuses a data file with more than one link. No ONNX step writes into
an export file in place — each rewrite (fp16 conversion, one-file form) is a new file, the old name
unlinked first (`onnx._save`) — so a linked build cannot reach the cached bytes.

An entry is as big as the model's fp32 weights, and only the run's other ONNX builds read it again,
so it is kept only for them: the convert stage names them ($PIPELINE_EXPORT_READERS: the later ONNX
variants of params.yaml `variants`, each tagged with its workspace), the entry holds one mark per
reader (`.readers/`), each ONNX convert stage removes its own mark when it ends (`finished`, whatever
its outcome), and the last one removes the entry. A run with one ONNX variant keeps nothing. A
reader that never comes (its stage did not re-run) leaves its entry behind: at most the newest
MAX_ENTRIES are kept, and scripts/disk_account.py counts them. Without $PIPELINE_EXPORT_READERS (a
build outside the convert stage) an entry is kept until evicted.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Optional

log = logging.getLogger(__name__)

MAX_ENTRIES = 2            # one model's dynamo and legacy exports
CHUNK = 64 << 20
READERS = ".readers"       # one empty file per build still to read an entry
READERS_ENV = "PIPELINE_EXPORT_READERS"


def cache_root() -> Path:
    base = os.environ.get("PIPELINE_CACHE_DIR") or str(Path.home() / ".cache" / "model-pipeline")
    return Path(base) / "onnx-export"


def export_key(module, inputs: dict, options: dict, code_files: Iterable[Path]) -> str:
    """sha256 of everything the exported files depend on (see the module docstring). `inputs`: the
    input/output names, dtypes, example shapes and dynamic axes; `options`: the exporter's."""
    import torch
    h = hashlib.sha256()

    def add(text: str) -> None:
        h.update(text.encode())
        h.update(b"\0")

    versions = {name: _version(name) for name in ("torch", "onnx", "onnxscript", "transformers")}
    add(repr(sorted(versions.items())))
    add(repr(sorted(options.items())))
    add(repr(inputs))
    add(repr(module))
    sources = {Path(__file__), *(Path(p) for p in code_files)}     # this key's own code too
    for m in module.modules():
        config = getattr(m, "config", None)
        if hasattr(config, "to_json_string"):
            add(config.to_json_string())
        try:
            sources.add(Path(inspect.getsourcefile(type(m))))
        except (TypeError, OSError):
            pass                        # a class without a Python source (builtin)
    for path in sorted(sources):
        add(str(path.name))
        h.update(path.read_bytes() if path.is_file() else b"")
    with torch.no_grad():
        for name, t in module.state_dict().items():
            add(f"{name}:{t.dtype}:{tuple(t.shape)}")
            flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            for i in range(0, flat.size, CHUNK):
                h.update(memoryview(flat[i:i + CHUNK]))
    return h.hexdigest()[:32]


def _version(package: str) -> Optional[str]:
    """The installed version, whether or not this process has imported the package yet (the key
    must not depend on import order)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def place(src: Path, dst: Path) -> None:
    """`dst` := `src`'s bytes: the graph (`.onnx`) as a hard link on one filesystem (no copy, nothing
    written back), else a copy. External data is always copied: onnx's checker refuses a data file
    with more than one link (its guard against hard-link attacks), so a linked one fails every build."""
    dst.unlink(missing_ok=True)
    if src.suffix == ".onnx":
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)


def restore(key: str, dest_dir: Path) -> Optional[list[str]]:
    """Place the entry's files into `dest_dir` (`place`); their names, or None on a miss."""
    entry = cache_root() / key
    if not entry.is_dir():
        return None
    names = sorted(p.name for p in entry.iterdir() if p.is_file())
    if not names:
        return None
    try:
        for name in names:
            place(entry / name, dest_dir / name)
    except OSError as e:          # evicted by another build meanwhile, disk full: export instead
        log.warning("ONNX export cache: could not copy %s (%s); exporting again", entry, e)
        for name in names:
            (dest_dir / name).unlink(missing_ok=True)
        return None
    os.utime(entry)               # recently used: evicted last
    return names


def reader_id(variant: str) -> str:
    """`variant` in this workspace: the builds of parallel experiments (each in its own workspace)
    mark and unmark entries apart."""
    from pipeline.core.params import REPO_ROOT
    return f"{variant}@{hashlib.sha256(str(REPO_ROOT.resolve()).encode()).hexdigest()[:12]}"


def later_readers(variants: list[str], variant: str, onnx_variants) -> list[str]:
    """The ONNX variants that build after `variant` in this run: `dvc repro` builds the foreach items in
    `variants` order. An earlier one never reads an entry this build stores (an entry marked for it
    stayed behind, a 2 GB export); one that re-runs later, alone, exports again."""
    after = variants[variants.index(variant) + 1:] if variant in variants else []
    return [v for v in after if v in onnx_variants]


def expected_readers() -> Optional[list[str]]:
    """The builds that will read this run's export again ($PIPELINE_EXPORT_READERS, comma-separated);
    None when nobody said (keep the entry until evicted)."""
    raw = os.environ.get(READERS_ENV)
    return None if raw is None else [r for r in raw.split(",") if r.strip()]


def store(key: str, files: list[Path], readers: Optional[list[str]] = None) -> None:
    """Keep `files` (linked or copied: `place`) under `key` (written aside, then renamed: a reader never sees half an
    entry) with a mark per reader still to come (`readers`, default `expected_readers()`; none: not
    kept at all), then drop the oldest entries beyond MAX_ENTRIES. Failure to cache never fails a build."""
    readers = expected_readers() if readers is None else readers
    root = cache_root()
    entry = root / key
    if readers is not None and not readers:
        log.info("ONNX export cache: no other build of this run reads the export; not kept")
        return
    if entry.is_dir():
        return
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    try:
        tmp.mkdir(parents=True)
        for f in files:
            place(f, tmp / f.name)
        if readers:
            (tmp / READERS).mkdir()
            for r in readers:
                (tmp / READERS / r).touch()
        tmp.rename(entry)
    except OSError as e:
        log.warning("ONNX export cache: could not keep the export (%s); the next ONNX variant exports again", e)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".tmp-")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        shutil.rmtree(old, ignore_errors=True)


def finished(reader: str) -> list[Path]:
    """`reader` reads no export again: its mark leaves every entry, and an entry no reader is
    marked on any more is removed. → the entries removed."""
    root = cache_root()
    removed = []
    if not root.is_dir():
        return removed
    for entry in sorted(root.iterdir()):
        marks = entry / READERS
        if entry.name.startswith(".tmp-") or not marks.is_dir():
            continue
        (marks / reader).unlink(missing_ok=True)
        if not any(marks.iterdir()):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def cached_export(key: str, dest: Path, export: Callable[[], None], outputs: Callable[[], list[Path]]) -> dict:
    """Restore the export `key` into `dest`'s folder, or run `export()` and keep `outputs()`.
    → the record for variant.json: {"reused": bool, "seconds": float, "key": key}."""
    t0 = time.perf_counter()
    reused = restore(key, dest.parent) is not None and dest.is_file()
    if not reused:
        export()
        store(key, outputs())
    seconds = round(time.perf_counter() - t0, 2)
    log.info("ONNX export %s in %.1f s (%s)", "reused" if reused else "done", seconds, cache_root() / key)
    return {"reused": reused, "seconds": seconds, "key": key}
