"""The .mar format: pack one with torch-model-archiver (its Python API), read one back.

Deterministic: files are staged with fixed times, so the same inputs give the same archive contents
(only MANIFEST.json's createdOn differs). Each build stages in its own private temp dir (the archiver
rmtree's `$TMPDIR/<model-name>`), and the archiver's copies are hard links where the filesystem allows.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Iterator, Optional

MODEL_CONFIG = "model-config.yaml"
MODEL_VERSION = "1.0"
# Fixed file times inside the archive: zip entries then depend on content only (zip's epoch is 1980).
FIXED_MTIME = 315532800 + 86400 * 366 * 20       # 2000-01-01-ish, any constant works
_ARCHIVER_LOCK = threading.Lock()                 # tempfile.tempdir is process-global


class ArchiveError(RuntimeError):
    """The archive cannot be built from the stage outputs; the message names what is missing."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _private_tmpdir(beside: Path) -> Iterator[Path]:
    """The archiver stages in `tempfile.gettempdir()/<model-name>` after rmtree'ing it: give each
    build its own temp dir so parallel builds of the same name cannot collide. It lies in `beside`
    (the export folder), on the filesystem the archive is written to, so staging can link."""
    with _ARCHIVER_LOCK, tempfile.TemporaryDirectory(prefix=".mar-build-", dir=beside) as private:
        saved = tempfile.tempdir
        tempfile.tempdir = private
        try:
            yield Path(private)
        finally:
            tempfile.tempdir = saved


def _link_or_copy2(src: str, dst: str, *, follow_symlinks: bool = True) -> str:
    """shutil.copy2's contract, by a hard link to the source's bytes where the filesystem allows."""
    if os.path.isdir(dst):
        dst = os.path.join(dst, os.path.basename(src))
    if os.path.lexists(dst):
        # A copy overwrites; a link to the same bytes is already the copy (a folder store packed again).
        if os.path.exists(dst) and os.path.samefile(src, dst):
            return dst
        os.unlink(dst)
    try:
        os.link(os.path.realpath(src), dst)
        return dst
    except OSError:
        return shutil.copy2(src, dst, follow_symlinks=follow_symlinks)


class _LinkingShutil:
    """`shutil` as torch-model-archiver sees it while it stages an archive: its copies (copy, copy2,
    copytree) link instead. The archiver copies every file into its staging folder before zipping
    it; for a GB-sized model that is a full second write of the weights, for nothing."""
    copy = copy2 = staticmethod(_link_or_copy2)

    @staticmethod
    def copytree(src, dst, symlinks=False, ignore=None, *args, **kwargs):
        return shutil.copytree(src, dst, symlinks, ignore, *args, copy_function=_link_or_copy2,
                               **{k: v for k, v in kwargs.items() if k != "copy_function"})

    def __getattr__(self, name):
        return getattr(shutil, name)


@contextlib.contextmanager
def _archiver_links() -> Iterator[None]:
    import model_archiver.model_packaging_utils as mpu
    saved = mpu.shutil
    mpu.shutil = _LinkingShutil()
    try:
        yield
    finally:
        mpu.shutil = saved


def _stage(files: dict[str, Path | bytes], stage: Path) -> None:
    """Lay files out under `stage` (name in archive -> source file or content) with fixed mtimes.
    Source files are symlinked: the archiver copies through links, so big weights are copied once."""
    for name, src in sorted(files.items()):
        dst = stage / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, bytes):
            dst.write_bytes(src)
            os.utime(dst, (FIXED_MTIME, FIXED_MTIME))
        else:
            src = Path(src)
            if not src.is_file():
                raise ArchiveError(f"{src} is missing; it must be packed as {name}")
            os.symlink(src.resolve(), dst)


def package(model_name: str, entry_handler: Path, files: dict[str, Path | bytes], export_dir: Path, *,
            config_file: Optional[Path] = None, serialized_file: Optional[str] = None,
            archive_format: str = "zip-store") -> Path:
    """torch-model-archiver (Python API): `<export_dir>/<model_name>.mar` with `entry_handler` at the
    root, `files` laid out by their archive names, and `config_file` as model-config.yaml.
    `serialized_file` names the root-level entry of `files` the manifest records as the model."""
    from model_archiver.model_archiver_config import ModelArchiverConfig
    from model_archiver.model_packaging import generate_model_archive

    export_dir.mkdir(parents=True, exist_ok=True)
    with _private_tmpdir(export_dir) as private, _archiver_links():
        stage = private / "stage"
        stage.mkdir()
        serialized_src = None
        if serialized_file is not None:
            if "/" in serialized_file or not isinstance(files.get(serialized_file), Path):
                raise ArchiveError(f"serialized file {serialized_file!r} must be a root-level file of the archive")
            serialized_src = files[serialized_file]
        # The archiver copies serialized_file itself: keep it out of the staged extras (copied once).
        _stage({k: v for k, v in files.items() if k != serialized_file}, stage)
        config_copy = None
        if config_file is not None:
            config_copy = private / MODEL_CONFIG       # the manifest names it by its basename
            shutil.copyfile(config_file, config_copy)
        handler_copy = private / entry_handler.name
        shutil.copyfile(entry_handler, handler_copy)
        cfg = ModelArchiverConfig(
            model_name=model_name, handler=str(handler_copy), version=MODEL_VERSION,
            serialized_file=str(serialized_src) if serialized_src else None,
            extra_files=str(stage), export_path=str(export_dir), archive_format=archive_format,
            force=True, config_file=str(config_copy) if config_copy else None)
        generate_model_archive(cfg)
    # no-archive: the archiver writes the folder form <export_dir>/<model_name>/ instead of a file.
    mar = export_dir / (model_name if archive_format == "no-archive" else f"{model_name}.mar")
    if not mar.exists():
        raise ArchiveError(f"torch-model-archiver did not write {mar}")
    return mar


def archive_contents(mar: Path) -> dict[str, bytes]:
    """Every file in a .mar (zip) by name."""
    with zipfile.ZipFile(mar) as z:
        return {info.filename: z.read(info) for info in z.infolist() if not info.is_dir()}


def archive_digests(mar: Path) -> dict[str, str]:
    """sha256 of every file in a .mar, MANIFEST.json's createdOn blanked (the only varying field)."""
    out = {}
    for name, data in archive_contents(mar).items():
        if name == "MAR-INF/MANIFEST.json":
            manifest = json.loads(data)
            manifest.pop("createdOn", None)
            data = json.dumps(manifest, sort_keys=True).encode()
        out[name] = hashlib.sha256(data).hexdigest()
    return out


def _archiver_version() -> str:
    from model_archiver import __version__
    return str(__version__)
