"""After `dvc repro`: the clone's disk (workspace outputs + DVC cache, each inode once) against the
checkpoint's weights, and a check that every cached output really is linked into the cache.

DVC may leave workspace files as copies of their cache entries: a link type it could not use first
(treeverse/dvc#10549), or a file whose content was already in the cache when its stage committed it
(a tokenizer file every variant folder carries: DVC skips the transfer and keeps the workspace copy).
The check finds cached output files with a single name and links each to its cache entry by content
(md5, DVC's file hash) — only those files, not a `dvc checkout --relink` of every output — and counts
again. The ONNX export cache outside the
clone (pipeline/build/variants/export_cache.py: $PIPELINE_CACHE_DIR/onnx-export) counts too when a
run left entries there. Writes metrics/disk.json:

    {"checkpoint_weight_bytes", "workspace_on_disk_bytes", "cache_extra_bytes", "export_cache_bytes",
     "export_cache_dir", "total_on_disk_bytes", "ratio_to_checkpoint", "unlinked_files": {"before", "after"},
     "relinked": how many copies were linked, "unlinked_examples": [path, ...], "outputs": {path: bytes}}

Usage: python scripts/disk_account.py [--repo DIR] [--no-relink]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def cached_outputs(repo: Path) -> list[Path]:
    """dvc.yaml outputs that DVC caches (the `cache: false` ones are plain files of the repo)."""
    import yaml
    spec = yaml.safe_load((repo / "dvc.yaml").read_text())
    lock = yaml.safe_load((repo / "dvc.lock").read_text()) if (repo / "dvc.lock").exists() else {"stages": {}}
    uncached = set()
    for body in spec["stages"].values():
        stage = body.get("do", body)
        for entry in [e for key in ("outs", "metrics", "plots") for e in stage.get(key) or []]:
            if isinstance(entry, dict):
                path, opts = next(iter(entry.items()))
                if (opts or {}).get("cache") is False:
                    uncached.add(path.split("${")[0])
    paths = []
    for stage in (lock.get("stages") or {}).values():
        for out in stage.get("outs") or []:
            p = out["path"]
            if not any(p == u or p.startswith(u) for u in uncached) and (repo / p).exists():
                paths.append(repo / p)
    return sorted(set(paths))


def unlinked_files(paths: list[Path]) -> list[Path]:
    found = []
    for top in paths:
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file() and not p.is_symlink()]
        # DVC does not link empty files (nothing to share).
        found += [f for f in files if f.stat().st_nlink == 1 and f.stat().st_size > 0]
    return found


def cache_entry(cache_dir: Path, path: Path) -> Path:
    """Where DVC 3 keeps a file of this content: files/md5/<first 2 hex>/<other 30>."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    return cache_dir / "files" / "md5" / digest[:2] / digest[2:]


def relink(files: list[Path], cache_dir: Path) -> int:
    """Replace each copy by a hard link to its cache entry (same bytes, same size); returns how many.
    A file with no entry (not committed by DVC) is left as it is and stays counted as unlinked."""
    done = 0
    for f in files:
        entry = cache_entry(cache_dir, f)
        if not entry.is_file() or entry.stat().st_size != f.stat().st_size:
            continue
        tmp = f.with_name(f".{f.name}.relink")
        tmp.unlink(missing_ok=True)
        os.link(entry, tmp)
        os.replace(tmp, f)          # atomic: the path always holds the same bytes
        done += 1
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=REPO_ROOT)
    ap.add_argument("--no-relink", action="store_true")
    args = ap.parse_args(argv)
    repo = args.repo.resolve()

    from pipeline.build.disk_plan import dvc_cache_settings, weight_bytes
    from pipeline.build.variants.export_cache import cache_root
    from pipeline.core.disk import footprint
    from pipeline.core.params import checkpoint_path, load_params

    outs = cached_outputs(repo)
    cache_dir, _types = dvc_cache_settings(repo)
    copies = unlinked_files(outs)
    before = len(copies)
    relinked = relink(copies, cache_dir) if copies and not args.no_relink else 0
    after = len(unlinked_files(outs)) if relinked else before

    seen: set = set()
    per_output = {str(p.relative_to(repo)): footprint([p], seen).on_disk_bytes for p in outs}
    # .scratch/: serve_check's reference archives, there only if a killed run left them
    uncached = [p for p in (repo / "artifacts", repo / "metrics", repo / "reports", repo / ".scratch") if p.exists()]
    workspace = sum(per_output.values()) + footprint(uncached, seen).on_disk_bytes
    cache_extra = footprint([cache_dir], seen).on_disk_bytes if cache_dir.exists() else 0
    export_dir = cache_root()
    export_cache = footprint([export_dir], seen).on_disk_bytes if export_dir.exists() else 0
    weights = weight_bytes(checkpoint_path(load_params(repo / "params.yaml")))
    total = workspace + cache_extra + export_cache
    rec = {"checkpoint_weight_bytes": weights, "workspace_on_disk_bytes": workspace,
           "cache_extra_bytes": cache_extra, "export_cache_bytes": export_cache, "export_cache_dir": str(export_dir),
           "total_on_disk_bytes": total,
           "ratio_to_checkpoint": round(total / weights, 2) if weights else None,
           "unlinked_files": {"before": before, "after": after}, "relinked": relinked,
           "unlinked_examples": [str(f.relative_to(repo)) for f in copies[:10]],
           "outputs": per_output}
    out = repo / "metrics" / "disk.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=2) + "\n")
    print(f"disk: {total / 2**30:.2f} GB on disk (workspace {workspace / 2**30:.2f} + cache {cache_extra / 2**30:.2f}"
          f" + ONNX export cache {export_cache / 2**30:.2f}), "
          f"{rec['ratio_to_checkpoint']}x the checkpoint's weights as fp32; unlinked cached files {before} -> {after}")
    return 0 if after == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
