"""`dvc push --run-cache` of some stages, plus the uncached outputs of run-cached stages, which
DVC's push leaves behind. One process for both (each DVC start-up costs a second or two).

A stage's uncached metric (here each stage's record, metrics/stages/<stage>.json, kept in git) is
committed into the local cache when DVC saves the run-cache entry, but DVC pushes only cached
outputs' objects: on another node the entry then cannot be restored ("missing cache files") and the
stage runs again. Run on the node, in its clone:

    python -m pipeline.fleet.dvc_push prepare convert --records prepare convert
    python -m pipeline.fleet.dvc_push report --with-deps --records benchmark
"""
from __future__ import annotations

import argparse
import sys


def uncached_objects(repo, groups: list[str]) -> set:
    """The hashes of the uncached outputs of the stages named (a foreach group by its name)."""
    objs = set()
    for stage in repo.index.stages:
        if stage.addressing.split("@")[0] not in groups:
            continue
        for out in stage.outs:
            if not out.use_cache and out.hash_info and out.hash_info.value:
                objs.add(out.hash_info)
    return objs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.fleet.dvc_push")
    parser.add_argument("targets", nargs="+")
    parser.add_argument("--with-deps", action="store_true")
    parser.add_argument("--records", nargs="*", default=[], help="run-cached stages whose uncached records to push")
    args = parser.parse_args(argv)
    from dvc.repo import Repo
    with Repo(".") as repo:
        pushed = repo.push(targets=args.targets, with_deps=args.with_deps, run_cache=True)
        objs = uncached_objects(repo, args.records)
        records = repo.cloud.push(objs) if objs else None
    failed = len(records.failed) if records is not None else 0
    print(f"fleet: pushed {pushed} file(s) and the run-cache of {', '.join(args.targets)}, and {len(objs)} "
          f"uncached record(s) of {', '.join(args.records) or 'no stage'}" + (f" ({failed} failed)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
