"""Push the uncached outputs of run-cached stages, which `dvc push --run-cache` leaves behind.

A stage's uncached metric (here each stage's record, metrics/stages/<stage>.json, kept in git) is
committed into the local cache when DVC saves the run-cache entry, but DVC pushes only cached
outputs' objects: on another node the entry then cannot be restored ("missing cache files") and the
stage runs again. Run on the node, in its clone, after `dvc push --run-cache`:

    python -m pipeline.fleet.push_records prepare convert
"""
from __future__ import annotations

import sys


def uncached_objects(repo, prefixes: list[str]) -> set:
    """The hashes of the uncached outputs of the stages named (a foreach group by its name)."""
    objs = set()
    for stage in repo.index.stages:
        if stage.addressing.split("@")[0] not in prefixes:
            continue
        for out in stage.outs:
            if not out.use_cache and out.hash_info and out.hash_info.value:
                objs.add(out.hash_info)
    return objs


def main(argv: list[str]) -> int:
    from dvc.repo import Repo
    with Repo(".") as repo:
        objs = uncached_objects(repo, argv)
        pushed = repo.cloud.push(objs) if objs else None
    print(f"fleet: pushed {len(objs)} uncached record(s) of {', '.join(argv)} for the run-cache"
          + (f" ({len(pushed.failed)} failed)" if pushed is not None and pushed.failed else ""))
    return 1 if pushed is not None and pushed.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
