"""Pack the winning variant into a TorchServe .mar, and lay out the naive baseline's for comparison.

The optimised archive (`artifacts/model_store/<name>.mar`, zip-store = uncompressed so a big model
unpacks fast) holds:
- the winner's variant folder files (variant.json "files" + its artifact), as they are;
- the entry handler of its runtime family at the root (`torch_handler.py` | `onnx_handler.py`) and the
  `handlers/` package it imports (serving, tasks, runtime*), laid out as in the repo so the same
  imports work in both places;
- `model-config.yaml` from the configure stage (`--config-file`: TorchServe reads it, the handler
  reads its `handler:` section);
- `provenance.json`: source checkpoint sha256, variant, verification figures, selection,
  environment, config derivation, git revision, and the sha256 of every other file in the archive.

The baseline is the common hand-written setup: the original checkpoint, `baseline_handler.py`
(eager fp32, no warm-up), no model-config.yaml, TorchServe's default settings except `model_store`
and `load_models`. Its files are laid out here (`baseline_packing`); the archive stage keeps them as a
recipe and serve_check packs the .mar only while it serves it (pipeline/serve/reference/reference_archives.py).

Packed by pipeline/serve/mar.py: the same inputs give the same archive contents.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from handlers.tasks import TASK_MODULES
from pipeline.core.params import REPO_ROOT, Params, checkpoint_path, resolve_path
from pipeline.serve.mar import MODEL_CONFIG, ArchiveError, _archiver_version, package, sha256_file

log = logging.getLogger(__name__)

HANDLERS_DIR = REPO_ROOT / "handlers"
# The handler modules an archive needs besides its entry module: the serving core, tasks, runtimes.
# handlers/tasks/ imports each task's module on first use (handlers.tasks.TASK_MODULES): all are packed,
# with tasks/text.py, the text tasks' shared base. A runtime family is imported by the variant's need.
TASK_FILES = ("tasks/__init__.py", *(f"tasks/{module}.py" for module, _ in TASK_MODULES.values()), "tasks/text.py")
RUNTIME_FILES = ("runtimes/__init__.py", "runtimes/torch_family.py", "runtimes/onnx_family.py")
SERVING_MODULES = ("__init__.py", "serving.py", *TASK_FILES, "encode.py", "profile.py", *RUNTIME_FILES)
ENTRY_HANDLERS = {"torch": "torch_handler.py", "onnx": "onnx_handler.py"}
BASELINE_HANDLER = "baseline_handler.py"
BASELINE_MODULES = ("__init__.py", *TASK_FILES, "encode.py", "pooling.py")
PROVENANCE = "provenance.json"
BASELINE_SPEC = "baseline.json"
# The transformers class the baseline builds an hf folder with: the task's head (AutoModel has none
# and would drop the classifier's weights), the bare encoder for embeddings.
HF_CLASSES = {"image-classification": "AutoModelForImageClassification",
              "text-classification": "AutoModelForSequenceClassification",
              "rerank": "AutoModelForSequenceClassification",
              "token-classification": "AutoModelForTokenClassification"}


@dataclass
class ArchiveResult:
    path: Path
    model_name: str
    handler: str
    files: dict[str, str] = field(default_factory=dict)   # name in archive -> sha256 (MANIFEST excluded)
    bytes: int = 0
    # The variant's files by their names in the archive, packed as they are: the unpacked folder links
    # them. Never the repo's handlers/: a link shares the inode, and DVC makes its cached files read-only.
    sources: dict[str, Path] = field(default_factory=dict)


@dataclass
class Packing:
    """What one .mar holds, before torch-model-archiver packs it: the entry handler at the root,
    `files` by their names in the archive (a source file or generated content), model-config.yaml,
    and the root entry the manifest names as the model. `contents`: sha256 of every file."""
    model_name: str
    entry_handler: Path
    files: dict[str, Path | bytes]
    config_file: Optional[Path] = None
    serialized_file: Optional[str] = None
    contents: dict[str, str] = field(default_factory=dict)
    model_files: tuple[str, ...] = ()      # the variant's files: DVC outputs, safe to hard-link to

    def pack(self, export_dir: Path, archive_format: str = "zip-store") -> ArchiveResult:
        mar = package(self.model_name, self.entry_handler, self.files, export_dir, config_file=self.config_file,
                      serialized_file=self.serialized_file, archive_format=archive_format)
        size = mar.stat().st_size if mar.is_file() else 0
        return ArchiveResult(mar, self.model_name, self.entry_handler.name, dict(self.contents), size,
                             {k: Path(self.files[k]) for k in self.model_files})


# --------------------------------------------------------------------------- small helpers
def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ArchiveError(f"{path} is missing ({what}); run the earlier stages first (dvc repro)") from None
    except json.JSONDecodeError as e:
        raise ArchiveError(f"{path}: not valid JSON ({e}); re-run the stage that writes it") from None


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode("utf-8")


def git_revision(repo: Path = REPO_ROOT) -> dict:
    """`git rev-parse HEAD` and whether tracked files differ from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True, check=True).stdout
        return {"revision": rev, "dirty": bool(status.strip())}
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("git revision unavailable: %s", e)
        return {"revision": None, "dirty": None}


def checkpoint_sha256(path: Path) -> dict:
    """sha256 of the source checkpoint: the file, or every (non-hidden) file of a folder."""
    path = Path(path)
    if path.is_file():
        return {"path": path.name, "sha256": sha256_file(path)}
    if not path.is_dir():
        raise ArchiveError(f"checkpoint {path} does not exist; check `model.checkpoint` in params.yaml")
    files = {rel: sha256_file(path / rel) for rel in _visible_files(path)}
    combined = hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in sorted(files.items())).encode()).hexdigest()
    return {"path": path.name, "sha256": combined, "files": files}


def _visible_files(folder: Path) -> list[str]:
    out = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for n in sorted(names):
            if not n.startswith(".") and not n.endswith(".pyc"):
                out.append(Path(root, n).relative_to(folder).as_posix())
    return out


def _handler_files(modules: tuple[str, ...]) -> dict[str, Path]:
    files = {}
    for m in modules:
        src = HANDLERS_DIR / m
        if src.is_file():
            files[f"handlers/{m}"] = src
        elif m != "__init__.py":       # handlers/ itself may be a namespace package
            raise ArchiveError(f"{src} is missing: the serving code must be in the repo")
    return files


def _digests(files: dict[str, Path | bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(src).hexdigest() if isinstance(src, bytes) else sha256_file(Path(src))
            for name, src in sorted(files.items())}


# --------------------------------------------------------------------------- the optimised archive
def variant_files(folder: Path, variant: dict) -> dict[str, Path]:
    """variant.json, its artifact and every file it lists, by name inside the archive."""
    names = ["variant.json", variant["artifact"], *(variant.get("files") or [])]
    files = {}
    for name in names:
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts:
            raise ArchiveError(f"{folder}/variant.json lists {name!r}: files must be inside the variant folder")
        if not (folder / rel).is_file():
            raise ArchiveError(f"{folder / rel} is listed in variant.json but missing; re-run convert for it")
        files[rel.as_posix()] = folder / rel
    return files


def build_archive(params: Params, *, selection_path: Path, variants_dir: Path, serve_dir: Path,
                  env_path: Path, export_dir: Path, archive_format: str = "zip-store",
                  variant_name: Optional[str] = None) -> ArchiveResult:
    """The winner's .mar with provenance.json (`variant_name`: another converted variant instead)."""
    packing = archive_packing(params, selection_path=selection_path, variants_dir=variants_dir, serve_dir=serve_dir,
                              env_path=env_path, archive_format=archive_format, variant_name=variant_name)
    result = packing.pack(export_dir, archive_format)
    log.info("archived %s (%s handler) -> %s (%.1f MB)", result.model_name, result.handler, result.path,
             result.bytes / 1e6)
    return result


def archive_packing(params: Params, *, selection_path: Path, variants_dir: Path, serve_dir: Path,
                    env_path: Path, archive_format: str = "zip-store",
                    variant_name: Optional[str] = None, reference: bool = False) -> Packing:
    """What the winner's .mar holds, provenance.json included (`variant_name`: another converted
    variant instead, e.g. the hand-tuned reference's onnx). A `reference`'s provenance leaves out the
    winner's selection and the git revision: its bytes then change only with what it serves, so a
    serve.* experiment or a new commit reuses its served record (the references stage)."""
    name = params.model.name
    selection = _read_json(selection_path, "the select stage's decision")
    winner = variant_name or selection.get("winner")
    if not winner:
        raise ArchiveError(f"{selection_path}: no winner ({selection.get('message', 'no message')}); "
                           f"nothing to archive")
    folder = variants_dir / winner
    variant = _read_json(folder / "variant.json", f"the {winner} variant")
    conversion = _read_json(folder / "conversion.json", f"the {winner} conversion record")
    if conversion.get("status") != "converted":
        raise ArchiveError(f"{folder}/conversion.json: winner {winner!r} has status {conversion.get('status')!r}; "
                           f"only a converted, verified variant can be archived")
    family = variant.get("family")
    if family not in ENTRY_HANDLERS:
        raise ArchiveError(f"{folder}/variant.json: family {family!r} has no handler (known: {', '.join(ENTRY_HANDLERS)})")
    config_file = serve_dir / MODEL_CONFIG
    if not config_file.is_file():
        raise ArchiveError(f"{config_file} is missing; run the configure stage first")
    derivation_path = serve_dir / "derivation.json"
    derivation = _read_json(derivation_path, "the configure stage's derivation") if derivation_path.exists() else None

    entry = HANDLERS_DIR / ENTRY_HANDLERS[family]
    model_files = variant_files(folder, variant)
    files: dict[str, Path | bytes] = {**model_files, **_handler_files(SERVING_MODULES)}
    contents = _digests(files)
    contents[entry.name] = sha256_file(entry)
    contents[MODEL_CONFIG] = sha256_file(config_file)
    provenance = {
        "model": name,
        "variant": winner,
        "family": family,
        "format": variant.get("format"),
        "dtype": variant.get("dtype"),
        "device": variant.get("device"),
        "handler": entry.name,
        "source": {"kind": params.model.source, "checkpoint": params.model.checkpoint,
                   **checkpoint_sha256(checkpoint_path(params))},
        "verification": {k: conversion.get(k) for k in ("status", "reason", "dtype", "tolerance", "verification",
                                                         "conversion_s", "artifact_bytes")},
        "selection": None if reference else selection,
        "environment": _read_json(env_path, "the probe stage's fingerprint") if env_path.exists() else None,
        "derivation": derivation,
        "git": None if reference else git_revision(),
        "archiver": {"torch-model-archiver": _archiver_version(), "format": archive_format},
        "files": contents,
    }
    files[PROVENANCE] = _json_bytes(provenance)
    return Packing(name, entry, files, config_file=config_file, serialized_file=variant["artifact"],
                   contents={**contents, PROVENANCE: hashlib.sha256(files[PROVENANCE]).hexdigest()},
                   model_files=tuple(model_files))


# --------------------------------------------------------------------------- the naive baseline
def baseline_files(params: Params, eager_variant: dict, eager_folder: Path) -> tuple[dict[str, Path | bytes], str]:
    """The files of the baseline .mar: the original checkpoint, the task's extra files and
    baseline.json telling baseline_handler.py how to build the model. Returns (files, weights name)."""
    m = params.model
    ckpt = checkpoint_path(params)
    files: dict[str, Path | bytes] = {}
    spec: dict = {"source": m.source, "task": eager_variant["task"],
                  "inputs": [i["name"] for i in eager_variant.get("inputs", [])],
                  "outputs": [o["name"] for o in eager_variant.get("outputs", [])]}
    if m.source == "hf":
        if not ckpt.is_dir():
            raise ArchiveError(f"`model.checkpoint` -> {ckpt}: source 'hf' needs a folder")
        for rel in _visible_files(ckpt):
            files[rel] = ckpt / rel
        weights = next((w for w in ("model.safetensors", "pytorch_model.bin") if w in files), None)
        spec["hf_class"] = HF_CLASSES.get(m.task, "AutoModel")
    else:
        weights = ckpt.name
        files[weights] = ckpt
        if m.source == "state_dict":
            target, _, function = (m.factory or "").rpartition(":")
            if target.endswith(".py"):
                factory_file = resolve_path(target)
                files[factory_file.name] = factory_file
                spec["factory"] = {"file": factory_file.name, "module": None, "function": function,
                                   "kwargs": dict(m.factory_kwargs)}
            else:
                spec["factory"] = {"file": None, "module": target, "function": function,
                                   "kwargs": dict(m.factory_kwargs)}
    spec["weights"] = weights
    # The task's extra files (tokenizer.json, labels.json...) from the eager variant folder.
    for rel in eager_variant.get("files") or []:
        if rel not in files and rel != eager_variant.get("artifact"):
            files[rel] = eager_folder / rel
    files[BASELINE_SPEC] = _json_bytes(spec)
    files.update(_handler_files(BASELINE_MODULES))
    return files, weights


def baseline_packing(params: Params, *, variants_dir: Path) -> Packing:
    """What the naive baseline .mar holds (the original checkpoint, baseline.json, the naive handler);
    its config.properties is TorchServe's defaults + model_store + load_models
    (pipeline/serve/reference/reference_archives.py writes it)."""
    name = params.model.name
    eager_folder = variants_dir / "eager"
    eager = _read_json(eager_folder / "variant.json", "the eager variant (the baseline's task settings)")
    files, weights = baseline_files(params, eager, eager_folder)
    entry = HANDLERS_DIR / BASELINE_HANDLER
    contents = _digests(files)
    contents[entry.name] = sha256_file(entry)
    log.info("baseline of %s: source %s, weights %s, %d files", name, params.model.source, weights, len(files))
    return Packing(name, entry, files, contents=contents)
