"""Both servers offer the seam the checks use (pipeline/serve/server/interface.py), without starting either."""
from __future__ import annotations

import inspect

from pipeline.serve.server.interface import HttpApi, Server, ServerLogView
from pipeline.serve.server.ray_server import RayServe, RayServeApi, RayServeLogs
from pipeline.serve.server.torchserve import TorchServe
from pipeline.serve.server.torchserve_http import ServerApi as TorchServeApi
from pipeline.serve.server.torchserve_logs import ServerLogs


def members(protocol) -> set[str]:
    return {n for n, v in vars(protocol).items() if not n.startswith("_") and callable(v)} | \
           set(getattr(protocol, "__annotations__", {}))


def test_torchserve_and_ray_serve_offer_every_member_of_the_seam(tmp_path):
    for protocol, classes in ((Server, (TorchServe, RayServe)), (HttpApi, (TorchServeApi, RayServeApi)),
                              (ServerLogView, (ServerLogs, RayServeLogs))):
        wanted = members(protocol)
        assert wanted, protocol
        for cls in classes:
            init = inspect.getsource(cls.__init__) if "__init__" in vars(cls) else ""
            missing = {m for m in wanted if not hasattr(cls, m) and f"self.{m}" not in init}
            assert not missing, f"{cls.__name__} lacks {sorted(missing)} of {protocol.__name__}"
    logs = RayServeLogs(tmp_path, "m")
    assert isinstance(logs, ServerLogView) and isinstance(ServerLogs(tmp_path, "m"), ServerLogView)
