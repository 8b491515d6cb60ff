"""pipeline/serve/server/torchserve_http.py: the keep-alive Client and ServerApi against a real TorchServe 0.12
(the double model of test_torchserve.py, one server for the module), plus what needs no server:
a stale keep-alive connection (a plain local HTTP server that drops it), auth detection and
config.properties reading."""
from __future__ import annotations

import http.client
import http.server
import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from pipeline.decide.properties import write_config_properties
from pipeline.serve.server.torchserve import TorchServe
from pipeline.serve.server.torchserve_http import Client, ServerApi, TorchServeError, read_properties
from tests.serve.test_torchserve import DERIVED, assert_nothing_left, build_mar

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs Java 17 (make java)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The double model (3 numbers in, doubled out; batchSize 4, maxBatchDelay 300 ms,
    max_request_size 4096), READY, token authorization on."""
    root = tmp_path_factory.mktemp("ts_http")
    store = root / "store"
    build_mar(store, "double", {"handler": {"length": 3}}, derivation=DERIVED)
    config = write_config_properties(root / "serve" / "config.properties", DERIVED,
                                     model_name="double", model_store=store)
    ts = TorchServe(config, store, "double", workdir=root / "server")
    with ts:
        yield ts
    assert_nothing_left(ts)


# --------------------------------------------------------------------------- against TorchServe
@pytest.mark.torchserve
@needs_java
def test_keys_come_from_the_servers_key_file(server):
    keys = json.loads((server.workdir / "key_file.json").read_text())
    api = server.api
    assert api.management_key() == keys["management"]["key"]
    assert api.inference_key() == keys["inference"]["key"]
    assert api.management_key() != api.inference_key()
    assert api.ready()
    # Each key opens its own API only: the inference key on the management port is refused.
    swapped = Client(server.ports.management, api.inference_key())
    try:
        assert 400 <= swapped.request("GET", "/models").status < 500
    finally:
        swapped.close()
    listed = api.management("GET", "/models")
    assert listed.status == 200 and [m["modelName"] for m in listed.json()["models"]] == ["double"]


@pytest.mark.torchserve
@needs_java
def test_describe_model_reports_the_served_settings_and_refuses_an_unknown_model(server):
    d = server.api.describe_model()
    assert d["modelName"] == "double"
    assert (d["batchSize"], d["maxBatchDelay"], d["minWorkers"]) == (4, 300, 1)
    with pytest.raises(TorchServeError, match=r"GET /models/nope → 404"):
        server.api.describe_model("nope")


@pytest.mark.torchserve
@needs_java
def test_one_keep_alive_connection_serves_many_requests(server):
    c = server.api.client()
    try:
        first = c.request("POST", server.api.predictions_path(), b"[1, 2, 3]", "application/json")
        local_port = c._conn.sock.getsockname()[1]
        for i in range(5):
            t0 = time.perf_counter()
            r = c.request("POST", server.api.predictions_path(), f"[{i}, 0, 1]".encode(), "application/json")
            wall_ms = (time.perf_counter() - t0) * 1000.0
            assert r.status == 200 and r.json() == [2 * i, 0, 2]
            # Response.ms is the round trip itself: inside the wall time around the call.
            assert 0 < r.ms <= wall_ms
            assert c._conn.sock.getsockname()[1] == local_port     # same TCP connection
        assert first.status == 200 and first.json() == [2, 4, 6]
    finally:
        c.close()
    assert c._conn is None


@pytest.mark.torchserve
@needs_java
def test_client_reconnects_after_torchserve_closes_on_4xx(server):
    c = server.api.client()
    path = server.api.predictions_path()
    try:
        assert c.request("POST", path, b"[1, 2]", "application/json").status == 400
        # Over max_request_size (4096): refused, possibly before the body was read.
        assert c.request("POST", path, b"[" + b"1," * 4000 + b"1]", "application/json").status == 413
        r = c.request("POST", path, b"[5, 6, 7]", "application/json")
        assert r.status == 200 and r.json() == [10, 12, 14]
    finally:
        c.close()


@pytest.mark.torchserve
@needs_java
def test_request_id_names_the_batch_in_the_logs_and_unknown_model_is_404(server):
    r = server.api.predict(b"[4, 5, 6]", "application/json")
    assert r.status == 200 and r.json() == [8, 10, 12]
    assert UUID.match(r.request_id), r.request_id
    # Sent alone, it ran alone (a batch of one in the backend's metric lines).
    assert server.log.batch_sizes_for([r.request_id]) == {1: 1}
    assert server.api.predictions_path("other") == "/predictions/other"
    assert server.api.predict(b"[1, 2, 3]", "application/json", model="nope").status == 404


# --------------------------------------------------------------------------- no server needed
class _DropsKeepAlive(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 answers that promise keep-alive, then the server closes the connection anyway (what
    a client sees when a server times out an idle connection between two requests)."""
    protocol_version = "HTTP/1.1"
    connections = 0

    def setup(self):
        type(self).connections += 1
        super().setup()

    def do_GET(self):
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def dropping_server():
    _DropsKeepAlive.connections = 0
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DropsKeepAlive)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_a_stale_keep_alive_connection_is_retried_once_unless_under_load(dropping_server):
    c = Client(dropping_server, token=None)
    try:
        assert c.request("GET", "/a").json() == {"ok": True}
        time.sleep(0.2)                     # the server has closed its end by now
        assert c.request("GET", "/b").status == 200
        assert _DropsKeepAlive.connections == 2        # the retry opened a fresh connection
    finally:
        c.close()
    # Under load a dropped request must count as lost, not be sent again.
    strict = Client(dropping_server, token=None, retry_stale=False)
    try:
        assert strict.request("GET", "/a").status == 200
        time.sleep(0.2)
        with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
            strict.request("GET", "/b")
        assert strict._conn is None         # and the next request starts afresh
        assert strict.request("GET", "/c").status == 200
    finally:
        strict.close()


def test_server_api_knows_when_management_calls_can_be_made(tmp_path):
    api = ServerApi(tmp_path, 1, 2, "m")
    assert not api.ready() and api.management_key() is None
    # Half-written key file: not ready, and not remembered as empty.
    (tmp_path / "key_file.json").write_text('{"management": {"key": "ab')
    assert api.management_key() is None and not api.ready()
    (tmp_path / "key_file.json").write_text(json.dumps({"management": {"key": "mk", "expiration time": "x"},
                                                        "inference": {"key": "ik"}, "API": {"key": "ak"}}))
    assert (api.management_key(), api.inference_key(), api.ready()) == ("mk", "ik", True)


def test_server_api_without_keys_is_ready_only_when_auth_is_off(tmp_path):
    api = ServerApi(tmp_path, 1, 2, "m")
    (tmp_path / "config.properties").write_text("disable_token_authorization=true\n"
                                                "disable_token_authorization=false\n")
    assert not api.ready()                  # the later duplicate wins, as in TorchServe
    (tmp_path / "config.properties").write_text("disable_token_authorization = TRUE\n")
    assert api.ready() and api.inference_key() is None


def test_read_properties_last_wins_and_skips_comments(tmp_path):
    path = tmp_path / "config.properties"
    path.write_text("# a comment=with equals\n"
                    "! another comment\n"
                    "\n"
                    "max_request_size=4096\n"
                    "  inference_address = http://127.0.0.1:8080  \n"
                    "not a pair\n"
                    "load_models=double=double.mar\n"
                    "max_request_size=8192\n")
    assert read_properties(path) == {"max_request_size": "8192", "inference_address": "http://127.0.0.1:8080",
                                     "load_models": "double=double.mar"}
