"""The tuner's side-by-side servers (pipeline/serve/tune/tuner.py, tuning.py) without a real TorchServe:
which servers start, which serve again, and that every one is stopped (issue 30: a 2 GB model's
tune stage spent most of its 132 s starting and stopping 8 servers)."""
from __future__ import annotations

import types

import pytest

from pipeline.serve.tune import tuner as tuner_mod
from pipeline.serve.tune.candidates import OperatingCandidate
from pipeline.serve.checks.load import LoadResult
from pipeline.serve.tune.tuner import ServedModel, Tuner
from pipeline.serve.tune.tuning import TuneSettings, tune


class FakeServer:
    """Stands in for pipeline.serve.server.torchserve.TorchServe: records its life, serves nothing."""
    all: list = []

    def __init__(self, config, model_store, model_name, *, models=None, workdir=None, extra_properties=None,
                 env=None, **_):
        self.workdir, self.frontend = workdir, dict(extra_properties or {})
        self.events: list = []
        self.readiness = None
        FakeServer.all.append(self)

    def start(self):
        self.events.append("start")
        self.readiness = types.SimpleNamespace(ready_s=1.0)
        return self.readiness

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop(check=False)

    def request_stop(self):
        self.events.append("request_stop")

    def stop(self, check=True):
        self.events.append("stop")


def _load(ts, cases, requests, concurrency, time_cap_s, request_timeout_s=None):
    """Throughput by server: the one without system metrics serves more; p99 past any SLO."""
    tp = 60.0 if ts.frontend.get("disable_system_metrics") else 50.0
    ts.events.append(("load", concurrency))
    return LoadResult(requests, 100, 100, 100, 0, 0, 0, 200.0, 500.0, 250.0, tp, 2.0, concurrency, True,
                      batch_sizes_seen={"4": 25})


@pytest.fixture
def served(tmp_path, monkeypatch):
    FakeServer.all = []
    monkeypatch.setattr(tuner_mod, "TorchServe", FakeServer)
    monkeypatch.setattr(tuner_mod, "run_load", _load)
    (tmp_path / "store" / "m").mkdir(parents=True)
    return ServedModel(tmp_path / "store", "m", "m", tmp_path / "config.properties", {"handler": {}})


def _cand(name, batch):
    return OperatingCandidate(name, batch, 5, 2, 1, "offline" if name == "offline choice" else "larger batch",
                              predicted={"request_p99_ms": 150.0, "throughput_rps": 100.0})


def test_side_by_side_the_capacity_is_measured_on_the_chosen_server_and_every_server_stops(served, tmp_path):
    s = TuneSettings(latency_slo_ms=200, expected_concurrency=16, rounds=2, max_rounds=2, side_by_side=True)
    record = tune(served, [], [_cand("offline choice", 4), _cand("batch 8", 8)], s, workroot=tmp_path / "w")
    # 2 candidates + the 3 frontend setups, all fresh (a server warmed by the first phase would have
    # the JVM's compiled code ahead of the fresh ones); the capacity measurement is served by the
    # chosen setup's server (before: one more start)
    assert record["server_starts"] == 5 == len(FakeServer.all)
    assert record["servers_reused"] == 1
    assert record["frontend"]["chosen"] == {"disable_system_metrics": True}
    assert record["inflight_within_slo"] is None and record["capacity"]["levels"]
    for ts in FakeServer.all:                                  # each started once, stopped once
        assert ts.events[0] == "start" and ts.events.count("start") == 1
        assert ts.events[-2:] == ["request_stop", "stop"]
    (chosen,) = [ts for ts in FakeServer.all if ts.frontend.get("disable_system_metrics")]
    capacity = [e[1] for e in chosen.events if isinstance(e, tuple)][-4:]
    assert capacity == [8, 4, 2, 1]                            # the capacity levels, on the chosen server
    assert FakeServer.all[0].events[-1] == "stop"               # the first phase's were stopped before


def test_release_stops_the_servers_not_kept_all_asked_before_any_is_waited_for(served, tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(FakeServer, "request_stop", lambda self: order.append(("ask", id(self))))
    monkeypatch.setattr(FakeServer, "stop", lambda self, check=True: order.append(("wait", id(self))))
    t = Tuner(served, [], concurrency=4, measure_s=1.0, warmup_requests=0, workroot=tmp_path / "w", side_by_side=True)
    a, b, c = _cand("offline choice", 4), _cand("batch 8", 8), _cand("batch 16", 16)
    t.run_rounds([a, b, c], 1)
    t.release(keep=(b,))
    assert [k for k, _ in order] == ["ask", "ask", "wait", "wait"] and len(t._live) == 1
    t.run_rounds([b], 1)                                       # an extra round: no new start
    assert t.starts == 3 and t.reused == 1
    t.close()
    assert not t._live and len(order) == 6
