"""The checkpoint as an input: which files make it up, whether they are there and of the kind the
task needs, and their content hash.

`check_checkpoint` reads only what is cheap (paths, config.json, file headers' existence) and
returns `Problem`s in params.yaml's terms, so the first stage refuses a wrong checkpoint with the
other mistakes, before any work. `fingerprint` hashes every file the stages read (an HF folder's
config, weights and shards, tokenizer, sentence-transformers modules; a state_dict and its
factory's source; a TorchScript file; the labels file): a changed byte changes
artifacts/checkpoint.json, which re-runs prepare and everything after it. Hashes are kept per file
by (size, mtime, inode), as DVC's state does, so an unchanged multi-GB folder is not read again.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import zipfile
from pathlib import Path
from typing import Iterator, Optional

from pipeline.core.params import ParamsError, Params, Problem, resolve_path
from pipeline.core.params_schema import TEXT_TASKS

# config.json `architectures` of a model that has the head the task computes with
HEADS = {"text-classification": "ForSequenceClassification", "rerank": "ForSequenceClassification",
         "token-classification": "ForTokenClassification", "image-classification": "ForImageClassification"}
SAVED_WITH = {"ForSequenceClassification": "AutoModelForSequenceClassification",
              "ForTokenClassification": "AutoModelForTokenClassification",
              "ForImageClassification": "AutoModelForImageClassification"}
CACHE_ENV = "PIPELINE_HASH_CACHE"          # the per-file hash cache (default: ~/.cache/model-pipeline)
SKIPPED = ("__pycache__",)


# --------------------------------------------------------------------------- checks
def check_checkpoint(params: Params) -> list[Problem]:
    """Every problem with the files params.yaml points at (the checkpoint, the factory, the labels)."""
    return list(_checkpoint_problems(params)) + list(_factory_problems(params)) + list(_labels_problems(params))


def _resolved(spec: str, key: str) -> tuple[Optional[Path], Optional[Problem]]:
    try:
        path = resolve_path(spec)
    except ParamsError as e:                  # pkg:<package>/... whose package is not installed
        return None, Problem(key, spec, str(e).split(": ", 1)[-1])
    if not path.exists():
        return None, Problem(key, spec, f"an existing path; {path} does not exist (a path is relative to the repo "
                                        f"root, or absolute, or pkg:<package>/<path> inside an installed package)")
    return path, None


def _checkpoint_problems(params: Params) -> Iterator[Problem]:
    m = params.model
    path, problem = _resolved(m.checkpoint, "model.checkpoint")
    if problem:
        yield problem
        return
    from pipeline.model.weights import CheckpointError, find_hf_weights, state_dict_files
    if m.source == "hf":
        if not path.is_dir():
            yield Problem("model.checkpoint", m.checkpoint, f"a Hugging Face model folder for source 'hf'; {path} is "
                          f"a file (a state_dict file needs source: state_dict and model.factory)")
            return
        config = path / "config.json"
        if not config.is_file():
            yield Problem("model.checkpoint", m.checkpoint, f"a Hugging Face model folder: {path} has no config.json "
                          f"(save the model with model.save_pretrained(folder))")
            return
        try:
            find_hf_weights(path)
        except CheckpointError as e:
            yield Problem("model.checkpoint", m.checkpoint, str(e))
        if m.task in TEXT_TASKS and not (path / "tokenizer.json").is_file():
            yield Problem("model.checkpoint", m.checkpoint, f"a folder with tokenizer.json for task {m.task!r}: save "
                          f"the fast tokenizer beside the model (tokenizer.save_pretrained(folder))")
        yield from _head_problems(params, config)
        if m.task == "text-embedding":
            # The pooling, modules and prompts the folder asks for: refused here, before any work.
            from pipeline.model.sentence_folder import read_sentence_folder
            try:
                read_sentence_folder(path)
            except CheckpointError as e:
                yield Problem("model.checkpoint", m.checkpoint, f"a folder whose sentence-transformers files the "
                              f"pipeline serves: {e}")
    elif m.source == "state_dict":
        try:
            state_dict_files(path)
        except CheckpointError as e:
            yield Problem("model.checkpoint", m.checkpoint, str(e))
    elif m.source == "torchscript":
        if path.is_dir() or not zipfile.is_zipfile(path):
            yield Problem("model.checkpoint", m.checkpoint, f"a TorchScript file for source 'torchscript' (saved with "
                          f"torch.jit.save); {path} is not one")


def _head_problems(params: Params, config: Path) -> Iterator[Problem]:
    """A folder whose config names its architecture must have the head the task computes with."""
    task = params.model.task
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        yield Problem("model.checkpoint", params.model.checkpoint, f"a readable config.json: {config}: {e}")
        return
    archs = cfg.get("architectures") or []
    head = HEADS.get(task)
    if head and archs and not any(a.endswith(head) for a in archs):
        yield Problem("model.task", task, f"a task the checkpoint has the head for: its config.json names "
                      f"{', '.join(archs)}, without the {head} head {task!r} computes with. Use a checkpoint saved "
                      f"from transformers' {SAVED_WITH[head]} (model.save_pretrained after fine-tuning)"
                      + (", or task 'text-embedding' for this encoder" if task in TEXT_TASKS else ""))
    labels = cfg.get("id2label")
    if task == "rerank" and isinstance(labels, dict) and len(labels) != 1:
        yield Problem("model.task", task, f"a cross-encoder with ONE output logit for 'rerank'; this config has "
                      f"{len(labels)} labels: use task 'text-classification'")


def _factory_problems(params: Params) -> Iterator[Problem]:
    spec = params.model.factory
    if params.model.source != "state_dict" or not spec or ":" not in spec:
        return                                       # the schema's rules name these
    target = spec.rpartition(":")[0]
    if target.endswith(".py"):
        file, problem = _resolved(target, "model.factory")
        if problem:
            yield Problem("model.factory", spec, problem.fix)
        return
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError) as e:
        found, error = None, f" ({type(e).__name__}: {e})"
    else:
        error = ""
    if found is None:
        yield Problem("model.factory", spec, f"an importable module: `{target}` is not installed{error}; install it, "
                      f"or give a file: path/to/file.py:function")


def _labels_problems(params: Params) -> Iterator[Problem]:
    if params.model.task == "image-classification" and params.model.image.labels:
        _, problem = _resolved(params.model.image.labels, "model.image.labels")
        if problem:
            yield problem


# --------------------------------------------------------------------------- files and fingerprint
def checkpoint_files(params: Params) -> dict[str, list[tuple[str, Path]]]:
    """Per role, (name as recorded, path) of every file the stages read from the checkpoint."""
    m = params.model
    root = resolve_path(m.checkpoint)
    out: dict[str, list[tuple[str, Path]]] = {}
    if root.is_dir():
        out["checkpoint"] = [(f.relative_to(root).as_posix(), f) for f in sorted(root.rglob("*"))
                             if f.is_file() and not _hidden(f.relative_to(root))]
    else:
        from pipeline.model.weights import state_dict_files
        files = state_dict_files(root).paths if m.source == "state_dict" else [root]
        out["checkpoint"] = [(f.name, f) for f in files]
    if m.source == "state_dict" and m.factory:
        source = _factory_source(m.factory)
        if source is not None:
            out["factory"] = [(source.name, source)]
    if m.task == "image-classification" and m.image.labels:
        labels = resolve_path(m.image.labels)
        out["labels"] = [(labels.name, labels)]
    return out


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") or part in SKIPPED for part in rel.parts)


def _factory_source(spec: str) -> Optional[Path]:
    target = spec.rpartition(":")[0]
    if target.endswith(".py"):
        return resolve_path(target)
    found = importlib.util.find_spec(target)
    return Path(found.origin) if found is not None and found.origin and found.origin != "built-in" else None


def fingerprint(params: Params, cache: Optional["HashCache"] = None) -> dict:
    """The checkpoint's content as plain data: per file its name, size and sha256 (no machine paths,
    no times: the same bytes give the same record on every host)."""
    cache = cache or HashCache.default()
    record: dict = {"checkpoint": params.model.checkpoint, "source": params.model.source}
    total = 0
    for role, files in checkpoint_files(params).items():
        entries = []
        for name, path in files:
            size, digest = cache.digest(path)
            entries.append({"name": name, "bytes": size, "sha256": digest})
            total += size
        record[role] = entries
    record["total_bytes"] = total
    cache.save()
    return record


class HashCache:
    """sha256 per file, valid while its (size, mtime_ns, inode) is unchanged; one JSON file per user."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.entries: dict = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.hashed_bytes = 0             # bytes read this run (0 when every file was cached)
        self._dirty = False

    @classmethod
    def default(cls) -> "HashCache":
        base = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
            "model-pipeline"
        return cls(Path(base) / "file-hashes.json")

    def digest(self, path: Path) -> tuple[int, str]:
        st = path.stat()
        key, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self.entries.get(key)
        if hit and hit[:3] == stamp:
            return st.st_size, hit[3]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        self.hashed_bytes += st.st_size
        self.entries[key] = stamp + [h.hexdigest()]
        self._dirty = True
        return st.st_size, h.hexdigest()

    def save(self) -> None:
        if not self._dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")     # two experiments may save at once
        tmp.write_text(json.dumps(self.entries))
        os.replace(tmp, self.path)
        self._dirty = False

