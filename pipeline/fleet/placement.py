"""Where Ray may run a target: the task options that pick its nodes, and, when none takes it, what
is missing in words (a task nobody can take otherwise waits forever, silently)."""
from __future__ import annotations

from pipeline.core.fleet_params import Target


def label_of(target: Target) -> dict[str, str]:
    return dict(target.ray.label_selector) or {"target": target.name}


def resource_of(target: Target) -> dict[str, float]:
    return dict(target.ray.resources) or {f"target:{target.name}": 1.0}


def _offers_label(node: dict, labels: dict[str, str]) -> bool:
    have = node.get("Labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


def _offers_resources(node: dict, resources: dict[str, float]) -> bool:
    have = node.get("Resources") or {}
    return all(have.get(k, 0) >= v for k, v in resources.items())


def offering(target: Target, nodes: list[dict]) -> list[dict]:
    """Alive nodes that offer the target (by its label or its resource)."""
    label, resources = label_of(target), resource_of(target)
    return [n for n in nodes if n.get("Alive") and (
        (not target.ray.resources and _offers_label(n, label)) or
        (not target.ray.label_selector and _offers_resources(n, resources)))]


def task_options(target: Target, nodes: list[dict]) -> dict:
    """Ray options placing the task: the label when a node offers it (or it was asked for), else
    the custom resource, which is also what an autoscaler can start a node for."""
    if target.ray.label_selector:
        return {"label_selector": dict(target.ray.label_selector)}
    if target.ray.resources:
        return {"resources": dict(target.ray.resources)}
    label = label_of(target)
    if any(n.get("Alive") and _offers_label(n, label) for n in nodes):
        return {"label_selector": label}
    return {"resources": resource_of(target)}


def _describe(node: dict) -> str:
    labels = {k: v for k, v in (node.get("Labels") or {}).items() if not k.startswith("ray.io/")}
    targets = sorted(k for k in (node.get("Resources") or {}) if k.startswith("target:"))
    offers = [f"{k}={v}" for k, v in sorted(labels.items())] + targets
    return f"{node.get('NodeManagerAddress')} ({str(node.get('NodeID'))[:8]}): {', '.join(offers) or 'no target'}"


def missing_reason(target: Target, nodes: list[dict], timeout_s: float) -> str:
    alive = [n for n in nodes if n.get("Alive")]
    fit = offering(target, alive)
    if fit:
        return (f"no node took it within fleet.schedule_timeout_s = {timeout_s:g} s: the nodes offering it "
                f"({', '.join(_describe(n) for n in fit)}) stayed busy or lacked CPUs")
    wanted = (f"label {label_of(target)}" if target.ray.label_selector else
              f"resource {resource_of(target)}" if target.ray.resources else
              f"label target={target.name} or resource target:{target.name}")
    return (f"no node offers {wanted} (waited fleet.schedule_timeout_s = {timeout_s:g} s); nodes: "
            f"{'; '.join(_describe(n) for n in alive) or 'none'}. Add a node (group) for it, see docs/fleet.md")
