"""The disk a run needs, planned from the checkpoint's size and the variant list before converting.

A variant that dies of a full disk after minutes of work leaves the next ones to fail the same way;
the plan says up front what each stage will write, on which filesystem, against what is free there,
and which variants to drop to fit. The figures are upper bounds per byte of fp32 weights:

- a variant writes its artifact (fp32 ~1x, fp16/bf16 ~0.5x, int8 <= 0.7x: embedding tables stay
  fp32) and, while it builds, a scratch copy (ONNX export, quantizer temp) of up to 1x;
- the ONNX variants share one export in the export cache (outside the repository), removed once
  the last of them is built;
- the serving tail keeps the winner's .mar (its unpacked folder and the KServe layout are hard links
  to the variant's and the .mar's bytes) and holds, while it runs, the tune stage's served folder
  (temp) and serve_check's reference archives (the naive baseline packs the checkpoint, the
  hand-tuned one the onnx variant with its pre-packed weights; in .scratch/ on the workspace,
  removed after);
- DVC's cache adds nothing when outputs are linked into it (same filesystem, hardlink/reflink),
  a second copy of everything otherwise.

What a stage holds only while it runs (a build's scratch, the references' archives) is counted once
per filesystem, the largest: those stages run one after another.
"""
from __future__ import annotations

import json
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from pipeline.core.disk import device_of, mount_point

GB = 1 << 30

# Artifact bytes per byte of fp32 weights (upper bounds).
ARTIFACT_FACTOR = {
    "eager": 1.05, "torchscript": 1.05, "aoti": 1.05, "onnx": 1.05,
    "fp16": 0.55, "bf16": 0.55, "onnx-fp16": 0.55,
    "int8": 1.0, "onnx-int8-dynamic": 0.7, "onnx-int8-static": 0.7,
}
# Scratch a build holds at its peak besides its artifact (removed when it ends), and where: the ONNX
# quantizers work inside the variant's folder, inductor in the temp directory.
SCRATCH_FACTOR = {"onnx-int8-dynamic": (1.05, "workspace"), "onnx-int8-static": (1.05, "workspace"),
                  "aoti": (1.05, "temp")}
ONNX_VARIANTS = {"onnx", "onnx-fp16", "onnx-int8-dynamic", "onnx-int8-static"}
# Kept: the winner's .mar (its folder form and the KServe layout link the same bytes).
SERVING_TAIL_FACTOR = 1.05
# Held while tune runs (temp): the served variant as a folder-form model.
TUNE_SCRATCH_FACTOR = 1.05
# Held while serve_check runs (workspace): the naive baseline's .mar (the checkpoint) + the hand-tuned
# one when `onnx` is built (the onnx variant with ORT's pre-packed weights: 1.54x for XLM-R-large).
BASELINE_FACTOR = 1.05
HANDTUNED_FACTOR = 1.6
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".onnx", ".data")
MARGIN = 1.10


class DiskSpaceError(RuntimeError):
    """Too little free space for the planned run (raised before any conversion starts)."""


@dataclass
class Need:
    what: str            # "convert@onnx", "export cache", "serving tail", "DVC cache copy"
    bytes: int
    where: Path          # the directory it is written to
    variant: str | None = None
    scratch: bool = False  # held only while its stage runs (removed after)


@dataclass
class DiskPlan:
    weight_bytes: int
    needs: list[Need] = field(default_factory=list)
    free: dict = field(default_factory=dict)         # mount point -> free bytes
    required: dict = field(default_factory=dict)     # mount point -> bytes needed (with margin)
    replan: Optional[Callable[[list], "DiskPlan"]] = field(default=None, repr=False)  # the same run without some variants

    @property
    def short(self) -> dict:
        """Mount point -> bytes missing, for the filesystems that lack room."""
        return {m: need - self.free.get(m, 0) for m, need in self.required.items() if need > self.free.get(m, 0)}

    @property
    def ok(self) -> bool:
        return not self.short

    def drop_suggestion(self) -> list[str]:
        """The variants to drop, largest first (never eager), until the plan fits; [] when it fits
        already or when dropping every other variant is not enough."""
        if self.ok or self.replan is None:
            return []
        sizes: dict[str, int] = {}
        for n in self.needs:
            if n.variant and n.variant != "eager":
                sizes[n.variant] = sizes.get(n.variant, 0) + n.bytes
        dropped = []
        for variant in sorted(sizes, key=lambda v: -sizes[v]):
            dropped.append(variant)
            if self.replan(dropped).ok:
                return dropped
        return []

    def message(self) -> str:
        parts = [f"needs ~{human(self.required[m])} on {m}, {human(self.free.get(m, 0))} free"
                 for m in self.short]
        drop = self.drop_suggestion()
        fix = (f"drop variants {', '.join(drop)} (params.yaml `variants`) or free space" if drop
               else "free space (or point the workspace, DVC's cache or $TMPDIR at a bigger disk)")
        return "not enough disk for this run: " + "; ".join(parts) + f"; {fix}"

    def as_dict(self) -> dict:
        return {"weight_bytes": self.weight_bytes, "ok": self.ok,
                "needs": [{"what": n.what, "bytes": n.bytes, "where": str(n.where), "variant": n.variant,
                           "scratch": n.scratch} for n in self.needs],
                "required_bytes": {str(k): v for k, v in self.required.items()},
                "free_bytes": {str(k): v for k, v in self.free.items()},
                "drop": self.drop_suggestion()}


def human(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / (1 << 20):.0f} MB"


def weight_bytes(checkpoint: Path) -> int:
    """Bytes of the checkpoint's weights AS FP32, the unit of the plan's factors (tokenizers and
    configs left out): a checkpoint published in bf16 or fp16 (Qwen3-Embedding ships bf16) is
    counted at twice its size, what its fp32 variants write."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_file():
        return _as_fp32(checkpoint)
    files = [p for p in checkpoint.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    return sum(_as_fp32(p) for p in files)


# Bytes of fp32 per byte of a stored floating dtype (safetensors' dtype names).
FP32_SCALE = {"F16": 2, "BF16": 2, "F8_E4M3": 4, "F8_E5M2": 4}


def _as_fp32(path: Path) -> int:
    """The file's size with its half-precision tensors counted as fp32 (safetensors' header says
    each tensor's dtype; other formats count as stored)."""
    size = path.stat().st_size
    if not path.name.endswith(".safetensors"):
        return size
    try:
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    except (OSError, ValueError, struct.error):
        return size                     # unreadable: the checkpoint stage names it
    extra = 0
    for name, tensor in header.items():
        if name != "__metadata__" and isinstance(tensor, dict):
            start, end = tensor.get("data_offsets", (0, 0))
            extra += (end - start) * (FP32_SCALE.get(tensor.get("dtype"), 1) - 1)
    return size + extra


def links_into_cache(workspace: Path, cache: Path, cache_types: Iterable[str]) -> bool:
    """Whether DVC can link outputs into its cache instead of copying them."""
    types = [t.strip() for t in cache_types]
    linkable = any(t in ("hardlink", "reflink") for t in types)
    return linkable and device_of(workspace) == device_of(cache)


def plan_run(weights: int, variants: Iterable[str], workspace: Path, cache: Path, scratch: Path,
             export_cache: Path, cache_types: Iterable[str], already_built: Iterable[str] = ()) -> DiskPlan:
    """The run's needs per filesystem. `already_built`: variants whose artifacts are already in the
    workspace (a re-run replaces them: their bytes are freed first, so they add nothing)."""
    built = set(already_built)
    variants = list(variants)
    p = DiskPlan(weight_bytes=weights, replan=lambda dropped: plan_run(
        weights, [v for v in variants if v not in dropped], workspace, cache, scratch, export_cache, cache_types, built))
    todo = [v for v in variants if v not in built]
    for v in todo:
        p.needs.append(Need(f"convert@{v}", int(weights * ARTIFACT_FACTOR.get(v, 1.05)), workspace, v))
        if v in SCRATCH_FACTOR:
            factor, place = SCRATCH_FACTOR[v]
            p.needs.append(Need(f"convert@{v} scratch", int(weights * factor),
                                workspace if place == "workspace" else scratch, v, scratch=True))
    if any(v in ONNX_VARIANTS for v in todo):
        p.needs.append(Need("ONNX export cache", int(weights * 1.05), export_cache))
    p.needs.append(Need("serving tail (the winner's .mar)", int(weights * SERVING_TAIL_FACTOR), workspace))
    p.needs.append(Need("tune: the served folder", int(weights * TUNE_SCRATCH_FACTOR), scratch, scratch=True))
    references = BASELINE_FACTOR + (HANDTUNED_FACTOR if "onnx" in variants else 0.0)
    p.needs.append(Need("serve_check: the references' archives", int(weights * references), workspace, scratch=True))
    scratch_needs = [n for n in p.needs if n.scratch]
    if not links_into_cache(workspace, cache, cache_types):
        total = sum(n.bytes for n in p.needs if n.where == workspace and n not in scratch_needs)
        p.needs.append(Need("DVC cache copy of the outputs", total, cache))
    for n in p.needs:
        if n not in scratch_needs:
            m = mount_point(n.where)
            p.required[m] = p.required.get(m, 0) + int(n.bytes * MARGIN)
    # Scratch is held by one stage at a time: per filesystem, only the largest counts.
    peak: dict = {}
    for n in scratch_needs:
        m = mount_point(n.where)
        peak[m] = max(peak.get(m, 0), n.bytes)
    for m, b in peak.items():
        p.required[m] = p.required.get(m, 0) + int(b * MARGIN)
    for m in p.required:
        p.free[m] = shutil.disk_usage(m).free
    return p


def default_scratch() -> Path:
    return Path(tempfile.gettempdir())


def built_variants(variants_dir: Path, variants: Iterable[str]) -> list[str]:
    """Variants whose folder already holds a conversion record."""
    return [v for v in variants if (variants_dir / v / "conversion.json").exists()]


def dvc_cache_settings(repo: Path) -> tuple[Path, list[str]]:
    """DVC's cache folder and link types from .dvc/config (+ config.local), DVC's defaults otherwise."""
    import configparser
    cache, types = repo / ".dvc" / "cache", ["reflink", "copy"]
    for name in ("config", "config.local"):
        cp = configparser.ConfigParser()
        try:
            cp.read(repo / ".dvc" / name)
        except configparser.Error:
            continue
        if cp.has_section("cache"):
            if cp.has_option("cache", "dir"):
                d = Path(cp.get("cache", "dir").strip('"'))
                cache = d if d.is_absolute() else (repo / ".dvc" / d).resolve()
            if cp.has_option("cache", "type"):
                types = cp.get("cache", "type").strip('"').split(",")
    return cache, types
