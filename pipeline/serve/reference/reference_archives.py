"""The references' archives (naive baseline, hand-tuned): kept as recipes, packed only while
serve_check serves them, in a scratch directory that is removed after, whatever happens.

serve_check serves each reference as a `.mar`, as they were measured by hand (docs/handtuned.md:
TorchServe's READY of a `.mar` includes copying it out of its archive). Kept as archives, they were
the two biggest things the pipeline wrote besides the variants: the naive baseline packs the
checkpoint, the hand-tuned one the onnx variant (3.3 + 2.1 GB for a 2.2 GB model), bytes already
in the workspace. So the archive stage writes a recipe instead:

    <recipe dir>/recipe.json          what the .mar packs: every file by its name in the archive, either
                                      stored beside the recipe (generated, small or the serving code:
                                      provenance.json, baseline.json, configs, handlers/) or named where
                                      it lies (the variant's or the checkpoint's files from 1 MiB up,
                                      with bytes and sha256)
    <recipe dir>/<entry handler>.py   the handler at the archive's root
    <recipe dir>/files/...            the stored files, by their names in the archive
    <recipe dir>/config.properties    the server settings, without model_store

and serve_check packs each recipe with the same torch-model-archiver call into `scratch_dir()`
(on the workspace's filesystem, where the archives used to be), serves it, and removes it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from pipeline.core.params import REPO_ROOT, Params
from pipeline.serve.archive import HANDLERS_DIR, ArchiveError, Packing, baseline_packing
from pipeline.serve.mar import package

log = logging.getLogger(__name__)

RECIPE = "recipe.json"
STORED = "files"
PROPERTIES = "config.properties"
STORE_MAX_BYTES = 1 << 20          # files below this are stored with the recipe; bigger ones are named
FORMAT = "zip-store"
SCRATCH_PREFIX = "serve_check-"
BASELINE_PROPERTIES = "# Naive baseline: TorchServe defaults, only what is needed to run.\nload_models={name}={name}.mar\n"


@dataclass(frozen=True)
class Recipe:
    """A written recipe: its folder, the .mar it packs and that archive's size."""
    dir: Path
    model_name: str
    mar: str
    bytes: int                     # what the packed .mar will hold (the files' bytes)
    named_bytes: int               # of which named where they lie (not stored with the recipe)


@dataclass(frozen=True)
class BuiltReference:
    """A recipe packed into `store`: `<store>/<mar>` and `<store>/config.properties`."""
    store: Path
    mar: Path
    config: Path
    bytes: int
    seconds: float

    def as_record(self, recipe_dir: Path) -> dict:
        return {"recipe": _portable(recipe_dir / RECIPE), "mar_bytes": self.bytes, "build_s": round(self.seconds, 2)}


# --------------------------------------------------------------------------- writing (archive stage)
def _portable(path: Path) -> str:
    """Relative to the repository when inside it (a DVC run-cache restore or a moved clone still
    finds it), else absolute."""
    path = Path(os.path.abspath(path))
    try:
        return path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def _resolve(name: str) -> Path:
    p = Path(name)
    return p if p.is_absolute() else REPO_ROOT / p


def _without_model_store(text: str, model_name: str) -> str:
    lines = [line for line in text.splitlines() if not line.strip().startswith("model_store=")]
    lines.append(f"# model_store: the scratch directory serve_check packs {model_name}.mar in (set when it is built)")
    return "\n".join(lines) + "\n"


def write_recipe(out_dir: Path, packing: Packing, *, config_properties: str) -> Recipe:
    """`out_dir` := the recipe of `packing`'s .mar (see the module docstring), replacing any earlier one."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in (out_dir / STORED, out_dir / RECIPE):
        shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
    for old in out_dir.glob("*.mar"):
        old.unlink()
    entries: dict[str, dict] = {}
    for name, src in sorted(packing.files.items()):
        if not isinstance(src, bytes):
            src = Path(src)
            if not src.is_file():
                raise ArchiveError(f"{src} is missing; it must be packed as {name}")
            size = src.stat().st_size
            if size >= STORE_MAX_BYTES and HANDLERS_DIR.resolve() not in src.resolve().parents:
                entries[name] = {"path": _portable(src), "bytes": size, "sha256": packing.contents.get(name)}
                continue
        dst = out_dir / STORED / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, bytes):
            dst.write_bytes(src)
        else:
            shutil.copyfile(src, dst)
        entries[name] = {"stored": dst.relative_to(out_dir).as_posix(), "bytes": dst.stat().st_size}
    handler = out_dir / packing.entry_handler.name
    if handler.resolve() != packing.entry_handler.resolve():
        shutil.copyfile(packing.entry_handler, handler)
    config = None
    if packing.config_file is not None:
        config = Path(packing.config_file)
        if out_dir.resolve() not in config.resolve().parents:
            shutil.copyfile(config, out_dir / "model-config.yaml")
            config = out_dir / "model-config.yaml"
        config = config.resolve().relative_to(out_dir.resolve()).as_posix()
    (out_dir / PROPERTIES).write_text(_without_model_store(config_properties, packing.model_name))
    mar = f"{packing.model_name}.mar"
    recipe = {"model_name": packing.model_name, "mar": mar, "archive_format": FORMAT,
              "handler": handler.name, "config_file": config, "serialized_file": packing.serialized_file,
              "config_properties": PROPERTIES, "files": entries,
              "what": "serve_check packs these files into <mar> in a scratch directory while it serves it "
                      "(pipeline/serve/reference/reference_archives.py)"}
    (out_dir / RECIPE).write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    total = sum(e["bytes"] for e in entries.values())
    named = sum(e["bytes"] for e in entries.values() if "path" in e)
    return Recipe(out_dir, packing.model_name, mar, total, named)


def write_baseline(params: Params, *, variants_dir: Path, baseline_dir: Path) -> Recipe:
    """artifacts/baseline/: the naive baseline's recipe (the checkpoint named where it lies)."""
    if baseline_dir.exists():
        shutil.rmtree(baseline_dir)         # the stage owns the folder: nothing stale survives
    packing = baseline_packing(params, variants_dir=variants_dir)
    return write_recipe(baseline_dir, packing, config_properties=BASELINE_PROPERTIES.format(name=params.model.name))


# --------------------------------------------------------------------------- building (serve_check)
def read_recipe(recipe_dir: Path) -> dict:
    try:
        return json.loads((Path(recipe_dir) / RECIPE).read_text())
    except FileNotFoundError:
        raise ArchiveError(f"{Path(recipe_dir) / RECIPE} is missing; run the archive stage (dvc repro archive)") from None
    except json.JSONDecodeError as e:
        raise ArchiveError(f"{Path(recipe_dir) / RECIPE}: not valid JSON ({e}); re-run the archive stage") from None


def build_reference(recipe_dir: Path, store: Path, model_name: Optional[str] = None) -> BuiltReference:
    """Pack the recipe in `recipe_dir` into `<store>/<name>.mar` + `<store>/config.properties`
    (model_store = `store`). A recipe of another model than `model_name`, or a named file that is
    gone or changed size since the archive stage wrote the recipe, is an ArchiveError."""
    recipe_dir, store = Path(recipe_dir), Path(store)
    recipe = read_recipe(recipe_dir)
    if model_name is not None and recipe.get("model_name") != model_name:
        raise ArchiveError(f"{recipe_dir / RECIPE} packs model {recipe.get('model_name')!r}, not {model_name!r}; "
                           f"re-run the archive stage (dvc repro archive)")
    t0 = time.perf_counter()
    files: dict[str, Path | bytes] = {}
    for name, entry in recipe["files"].items():
        if "stored" in entry:
            files[name] = recipe_dir / entry["stored"]
            continue
        src = _resolve(entry["path"])
        size = src.stat().st_size if src.is_file() else None
        if size != entry["bytes"]:
            found = "missing" if size is None else f"{size} bytes, not {entry['bytes']}"
            raise ArchiveError(f"{src} ({name} in {recipe_dir / RECIPE}) is {found}; "
                               f"re-run the archive stage (dvc repro archive)")
        files[name] = src
    config = recipe_dir / recipe["config_file"] if recipe.get("config_file") else None
    store.mkdir(parents=True, exist_ok=True)
    mar = package(recipe["model_name"], recipe_dir / recipe["handler"], files, store, config_file=config,
                  serialized_file=recipe.get("serialized_file"), archive_format=recipe.get("archive_format", FORMAT))
    properties = (recipe_dir / recipe["config_properties"]).read_text()
    config_path = store / PROPERTIES
    config_path.write_text(properties + f"model_store={store.resolve().as_posix()}\n")
    # On the disk before any server starts: its write-back must not overlap the READY measurements
    # (the archive stage's archives had minutes to settle).
    fd = os.open(mar, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    log.info("packed %s from %s in %.1f s (%.1f MB)", mar, recipe_dir / RECIPE, seconds, mar.stat().st_size / 1e6)
    return BuiltReference(store, mar, config_path, mar.stat().st_size, seconds)


def _pid_of(path: Path) -> Optional[int]:
    head = path.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def scratch_dir(parent: Path) -> Iterator[Path]:
    """A fresh directory under `parent` for this process, removed when the block ends, by an
    exception too. Directories left by a process that died without its `finally` (SIGKILL) are
    removed first."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    for old in parent.glob(f"{SCRATCH_PREFIX}*"):
        pid = _pid_of(old)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            log.info("removing %s, left by process %d", old, pid)
            shutil.rmtree(old, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            log.warning("could not remove the scratch directory %s", path)
        with contextlib.suppress(OSError):
            parent.rmdir()                  # only when empty
