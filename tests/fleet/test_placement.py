"""Which nodes offer a target, the Ray options that place it, what is missing when none does, and
what a node lacks of a target's `requires` (pure functions, no Ray)."""
from __future__ import annotations

import pytest

from pipeline.core.fleet_params import RayPlacement, Requires, Target
from pipeline.core.params_typed import ParamsError
from pipeline.fleet.node_checks import environment_differences, unmet
from pipeline.fleet.placement import missing_reason, offering, task_options

NODES = [
    {"NodeID": "aaaa1111", "NodeManagerAddress": "10.0.0.1", "Alive": True, "Labels": {"target": "avx512"},
     "Resources": {"CPU": 16.0}},
    {"NodeID": "bbbb2222", "NodeManagerAddress": "10.0.0.2", "Alive": True, "Labels": {},
     "Resources": {"CPU": 8.0, "target:l4": 1.0}},
    {"NodeID": "cccc3333", "NodeManagerAddress": "10.0.0.3", "Alive": False, "Labels": {"target": "amx"},
     "Resources": {"CPU": 8.0}},
]


def test_a_label_places_by_label_and_a_resource_by_resource():
    assert task_options(Target("avx512"), NODES) == {"label_selector": {"target": "avx512"}}
    assert task_options(Target("l4"), NODES) == {"resources": {"target:l4": 1.0}}
    assert [n["NodeID"] for n in offering(Target("avx512"), NODES)] == ["aaaa1111"]
    # a target nobody offers yet asks for its resource: what an autoscaler can start a node for
    assert task_options(Target("h100"), NODES) == {"resources": {"target:h100": 1.0}}
    own = Target("x", ray=RayPlacement(label_selector={"gpu": "h100"}))
    assert task_options(own, NODES) == {"label_selector": {"gpu": "h100"}}


def test_a_dead_node_offers_nothing_and_the_reason_names_what_is_missing():
    assert offering(Target("amx"), NODES) == []
    reason = missing_reason(Target("amx"), NODES, 30)
    assert "target=amx" in reason and "target:amx" in reason and "30 s" in reason
    assert "10.0.0.1 (aaaa1111): target=avx512" in reason and "target:l4" in reason and "10.0.0.3" not in reason
    busy = missing_reason(Target("avx512"), NODES, 30)
    assert "stayed busy" in busy and "10.0.0.1" in busy


ENV = {"cpu": {"model": "Xeon", "isa": {"avx2": True, "avx512f": False}, "usable_cpus": 4},
       "gpu": {"name": "NVIDIA L4", "memory_mb": 23034}, "memory_mb": 32000}


def test_requires_names_each_thing_the_node_lacks():
    assert unmet(Requires(cpu_flags=["avx2"], gpu="L4", gpu_memory_mb=20000, cpus=4), ENV) == []
    lacks = unmet(Requires(cpu_flags=["avx512f", "avx9"], gpu="H100", gpu_memory_mb=80000, memory_mb=64000, cpus=8),
                  ENV)
    assert len(lacks) == 6, lacks
    assert lacks[0] == "CPU flag avx512f (node: Xeon)" and "unknown to the probe" in lacks[1]
    assert "GPU H100 (node: NVIDIA L4)" in lacks and "80000 MB of GPU memory (node: 23034 MB)" in lacks
    assert unmet(Requires(gpu="L4"), {"cpu": {}, "gpu": None}) == ["GPU L4 (node: no GPU)"]


def test_the_locked_environment_is_what_runs_these_tests(tmp_path):
    assert environment_differences() == []
    (tmp_path / "requirements.txt").write_text("# comment\npytest==0.0.1\nno-such-package-xyz==1.0\n")
    wrong = environment_differences(tmp_path)
    assert wrong[0].startswith("pytest==0.0.1 (installed: ") and wrong[1] == "no-such-package-xyz==1.0 (installed: none)"


def test_fleet_params_are_validated(make_params):
    ok = make_params({"name": "m", "source": "hf", "checkpoint": "x", "task": "text-embedding"},
                     fleet={"targets": [{"name": "a", "requires": {"cpu_flags": ["avx2"]}}], "schedule_timeout_s": 5})
    assert ok.fleet.targets[0].requires.cpu_flags == ["avx2"]
    for fleet, key in (({"targets": [{"name": "a"}, {"name": "a"}]}, "fleet.targets[1].name"),
                       ({"targets": [{"name": "a", "requires": {"gpu_memory_mb": 100}}]}, "fleet.targets[0].requires.gpu"),
                       ({"targets": [{"name": "a", "requires": {"cpu": 2}}]}, "fleet.targets[0].requires.cpu"),
                       ({"schedule_timeout_s": 0}, "fleet.schedule_timeout_s")):
        with pytest.raises(ParamsError, match=key.replace("[", r"\[").replace("]", r"\]")):
            make_params({"name": "m", "source": "hf", "checkpoint": "x", "task": "text-embedding"}, fleet=fleet)
