"""params.yaml `fleet`: the targets `make fleet` builds for (pipeline/fleet), validated with the rest.

Kept apart from params.py: only the fleet reads it, and no DVC stage declares it, so editing it
re-runs nothing in `make repro`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator, Optional

from pipeline.core.params_typed import Problem


@dataclass(frozen=True)
class Requires:
    """What a node must have for its benchmark to stand for the target (checked on the node against
    its probe, artifacts/env.json): a benchmark of the wrong hardware is worse than none."""
    cpu_flags: list[str] = field(default_factory=list)   # ISA flags usable there (env.json cpu.isa), e.g. [avx512f]
    gpu: Optional[str] = None                  # part of the GPU's name, e.g. "H100"; null: no GPU needed
    gpu_memory_mb: Optional[int] = None        # at least this much GPU memory
    memory_mb: Optional[int] = None            # at least this much host memory
    cpus: Optional[int] = None                 # at least this many usable CPUs


@dataclass(frozen=True)
class RayPlacement:
    """How Ray finds the target's nodes. Empty: a node labelled `target=<name>`, else one offering
    the custom resource `target:<name>` (docs/fleet.md)."""
    label_selector: dict[str, str] = field(default_factory=dict)   # Ray node labels the target's nodes carry
    resources: dict[str, float] = field(default_factory=dict)      # or: custom Ray resources they offer


@dataclass(frozen=True)
class Target:
    name: str                                  # the target's name (Ray label target=<name>, its figures in the fleet report)
    requires: Requires = field(default_factory=Requires)
    ray: RayPlacement = field(default_factory=RayPlacement)


@dataclass(frozen=True)
class FleetParams:
    targets: list[Target] = field(default_factory=list)          # the hardware classes to build for
    # A Ray task no node can take waits forever: past this, the target is reported unschedulable.
    # Long enough for an autoscaler (KubeRay minReplicas 0) to bring a node up.
    schedule_timeout_s: float = 600.0
    repo: Optional[str] = None                 # git URL the nodes clone; null: `origin`, else this checkout (one machine)
    workdir: str = "~/.cache/pipeline-fleet"   # on each node: one clone per target, kept between runs


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-.]*")


def check_fleet(fleet: FleetParams) -> Iterator[Problem]:
    """Every invalid value, each naming what is allowed (the numeric ranges: params_checks.RANGES)."""
    names = [t.name for t in fleet.targets]
    for i, t in enumerate(fleet.targets):
        key = f"fleet.targets[{i}]"
        if not _NAME.fullmatch(t.name):
            yield Problem(f"{key}.name", t.name, "letters, digits, '_', '-', '.', starting with a letter or digit")
        if t.name in names[:i]:
            yield Problem(f"{key}.name", t.name, "a name no other target has")
        if t.requires.gpu_memory_mb is not None and not t.requires.gpu:
            yield Problem(f"{key}.requires.gpu", t.requires.gpu, "a GPU name (e.g. H100) when gpu_memory_mb is set")
        if t.ray.label_selector and t.ray.resources:
            yield Problem(f"{key}.ray", "label_selector and resources", "one of them (or neither: the defaults)")
