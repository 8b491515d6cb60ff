"""After `dvc repro`: the clone's disk (workspace outputs + DVC cache, each inode once) against the
checkpoint's weights, and a check that every cached output really is linked into the cache.

DVC may leave workspace files as copies of their cache entries (treeverse/dvc#10549: a link type it
could not use first); the check counts cached output files with a single name, relinks them with
`dvc checkout --relink` when there are any, and counts again. The ONNX export cache outside the
clone (pipeline/build/variants/export_cache.py: $PIPELINE_CACHE_DIR/onnx-export) counts too when a
run left entries there. Writes metrics/disk.json:

    {"checkpoint_weight_bytes", "workspace_on_disk_bytes", "cache_extra_bytes", "export_cache_bytes",
     "export_cache_dir", "total_on_disk_bytes", "ratio_to_checkpoint", "unlinked_files": {"before", "after"},
     "relinked", "outputs": {path: bytes}}

Usage: python scripts/disk_account.py [--repo DIR] [--no-relink]
"""
from __future__ import annotations

import argparse
import json
import subprocess
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


def unlinked(paths: list[Path]) -> int:
    count = 0
    for top in paths:
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file() and not p.is_symlink()]
        # DVC does not link empty files (nothing to share).
        count += sum(1 for f in files if f.stat().st_nlink == 1 and f.stat().st_size > 0)
    return count


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
    before = unlinked(outs)
    relinked = False
    if before and not args.no_relink:
        beside = Path(sys.executable).parent / "dvc"        # the venv's DVC, also when it is not on PATH
        subprocess.run([str(beside) if beside.exists() else "dvc", "checkout", "--relink", "-q"], cwd=repo, check=True)
        relinked = True
    after = unlinked(outs) if relinked else before

    seen: set = set()
    per_output = {str(p.relative_to(repo)): footprint([p], seen).on_disk_bytes for p in outs}
    # .scratch/: serve_check's reference archives, there only if a killed run left them
    uncached = [p for p in (repo / "artifacts", repo / "metrics", repo / "reports", repo / ".scratch") if p.exists()]
    workspace = sum(per_output.values()) + footprint(uncached, seen).on_disk_bytes
    cache_dir, _types = dvc_cache_settings(repo)
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
           "outputs": per_output}
    out = repo / "metrics" / "disk.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=2) + "\n")
    print(f"disk: {total / 2**30:.2f} GB on disk (workspace {workspace / 2**30:.2f} + cache {cache_extra / 2**30:.2f}"
          f" + ONNX export cache {export_cache / 2**30:.2f}), "
          f"{rec['ratio_to_checkpoint']}x the checkpoint's weights; unlinked cached files {before} -> {after}")
    return 0 if after == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
