"""How the model sits in TorchServe's model store: the `.mar` archive, or the same archive unpacked.

TorchServe 0.12 extracts a `.mar` into its temp dir at every start (a copy of every byte of the
model, before startupTimeout even starts counting); an unpacked model folder in the model store
(what `torch-model-archiver --archive-format no-archive` writes) is only symlinked. For a 90 MB
model the copy costs well under a second; for a GB-sized one it is seconds at every start and a
second copy of the weights on disk. So the form is a derived choice by artifact size
(`serve.folder_store_min_mb`, overridable as `serve.overrides.store_form`); the archive stage
publishes both forms (the folder is the `.mar` unpacked, byte for byte) and serve_check measures
READY of both in the same run.
"""
from __future__ import annotations

import os
import shutil
import zipfile
import zlib
from pathlib import Path
from typing import Optional

FORMS = ("mar", "folder")


def choose_store_form(artifact_bytes: Optional[int], raw_read_ms: Optional[float],
                      folder_min_mb: float) -> tuple[str, str, dict]:
    """(form, formula, evidence): `folder` when the artifact is at least `folder_min_mb` MB.

    The evidence carries the unpack cost the folder avoids at every start, estimated from the
    benchmark's raw read of the artifact (the unpack reads and writes every byte: about twice
    that read); serve_check measures the real difference."""
    mb = (artifact_bytes or 0) / 1e6
    form = "folder" if artifact_bytes and mb >= folder_min_mb else "mar"
    unpack_s = 2 * raw_read_ms / 1000.0 if raw_read_ms else None
    return form, ("folder when artifact MB >= folder_store_min_mb (TorchServe copies a .mar out of its "
                  "archive at every start; a folder in the model store is used in place), else mar"), {
        "artifact_bytes": artifact_bytes, "artifact_mb": round(mb, 1), "folder_store_min_mb": folder_min_mb,
        "raw_read_ms": raw_read_ms,
        "unpack_estimate_s": round(unpack_s, 3) if unpack_s is not None else None,
        "unpack_estimate": "2 × raw read of the artifact (the unpack reads and writes every byte)"}


def check_form(form: str) -> str:
    if form not in FORMS:
        raise ValueError(f"store form {form!r} unknown; use one of {', '.join(FORMS)}")
    return form


def store_entry(model_name: str, form: str) -> str:
    """The name TorchServe loads from the model store: `<name>.mar` or the folder `<name>`."""
    return f"{model_name}.mar" if check_form(form) == "mar" else model_name


def models_arg(model_name: str, form: str) -> str:
    """`--models` / `load_models` value for the form."""
    return f"{model_name}={store_entry(model_name, form)}"


def form_of(derivation: Optional[dict]) -> str:
    """The chosen form recorded in derivation.json (Derived records or their dicts); `mar` when
    none was recorded (a configure stage that predates the choice)."""
    entry = (derivation or {}).get("store_form")
    value = getattr(entry, "value", None) if not isinstance(entry, dict) else entry.get("value")
    return check_form(value) if value else "mar"


def unpack_mar(mar: Path, folder: Path, sources: Optional[dict[str, Path]] = None) -> Path:
    """`folder` := the `.mar` unpacked (what TorchServe would extract at start), replacing what was there.

    `sources`: name in the archive -> the file it was packed from. An entry stored uncompressed whose
    bytes are that file's (same size and CRC-32) becomes a hard link to it, not a copy: the folder
    form then takes no room besides the variant it was packed from (a copy where linking fails)."""
    mar, folder = Path(mar), Path(folder)
    if folder.exists():
        shutil.rmtree(folder)
    with zipfile.ZipFile(mar) as z:
        bad = [n for n in z.namelist() if n.startswith("/") or ".." in Path(n).parts]
        if bad:
            raise ValueError(f"{mar}: entries outside the archive root ({bad[:3]}); refusing to unpack")
        for info in z.infolist():
            src = (sources or {}).get(info.filename)
            if src is not None and not info.is_dir() and _same_bytes(Path(src), info):
                dst = folder / info.filename
                dst.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(src, dst)
                    continue
                except OSError:
                    pass
            z.extract(info, folder)
    return folder


def _same_bytes(src: Path, info: zipfile.ZipInfo, chunk: int = 8 << 20) -> bool:
    """Whether an uncompressed zip entry holds exactly `src`'s bytes (size, then CRC-32)."""
    if info.compress_type != zipfile.ZIP_STORED or not src.is_file() or src.stat().st_size != info.file_size:
        return False
    crc = 0
    with open(src, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc == info.CRC


def link_or_copy(src: Path, dst: Path) -> Path:
    """`dst` := a hard link to `src`, or a copy where the filesystem cannot link (another device)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def link_or_copy_tree(src: Path, dst: Path) -> Path:
    """Copy a folder, hard-linking files where the filesystem allows (no second copy of the weights)."""
    shutil.copytree(src, dst, copy_function=link_or_copy)
    return dst
