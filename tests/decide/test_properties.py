"""config.properties / model-config.yaml / start command writers.

The round trip goes through the JDK's own java.util.Properties (javac + java 17 on the machine) and
through a copy of TorchServe's naive Python parser, so both readers of the file are exercised.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path, PureWindowsPath

import pytest
import yaml

from pipeline.decide.properties import (NAIVE_PARSER_KEYS, ConfigWriteError, format_properties, host_path,
                                 model_config_dict, start_command, format_start_command,
                                 write_config_properties, write_model_config)

DERIVATION = {   # plain values are accepted as well as {"value": ...} records
    "device": "cpu", "batch_size": 8, "max_batch_delay_ms": 5, "workers": 2, "threads_per_worker": 1,
    "startup_timeout_s": 42, "response_timeout_s": 7, "job_queue_size": 32,
    "max_request_bytes": 65536, "max_request_size": 131072, "max_response_size": 65536,
}

JAVA_DUMP = r"""
import java.io.*;
import java.util.*;
public class Dump {
    public static void main(String[] a) throws Exception {
        Properties p = new Properties();
        // As TorchServe's ConfigManager does: Properties.load(InputStream) (ISO-8859-1 + escapes).
        try (InputStream in = new FileInputStream(a[0])) { p.load(in); }
        PrintStream out = new PrintStream(new FileOutputStream(a[1]), true, "UTF-8");
        for (String k : new TreeSet<>(p.stringPropertyNames())) {
            out.print(k); out.print('\u0000'); out.print(p.getProperty(k)); out.print('\u0001');
        }
        out.close();
    }
}
"""


@pytest.fixture(scope="module")
def java_load(tmp_path_factory):
    """load(path) -> dict read by java.util.Properties.load."""
    if not (shutil.which("javac") and shutil.which("java")):
        pytest.fail("javac/java not found: install openjdk-17-jdk-headless (TorchServe needs Java 17 anyway)")
    d = tmp_path_factory.mktemp("java")
    (d / "Dump.java").write_text(JAVA_DUMP)
    subprocess.run(["javac", "Dump.java"], cwd=d, check=True, capture_output=True)

    def load(path: Path) -> dict:
        out = d / "out.bin"
        subprocess.run(["java", "-cp", str(d), "Dump", str(path), str(out)], check=True, capture_output=True)
        text = out.read_bytes().decode("utf-8")
        return dict(item.split("\0", 1) for item in text.split("\1") if item)
    return load


def naive_load_properties(file_path) -> dict:
    """ts/model_server.py `load_properties` of TorchServe v0.12.0 (the function at the end of the file,
    used at `props = load_properties(ts_conf_file)` for vmargs / plugins_path / model_store), verbatim
    apart from the signature: strip, skip '#', split on the first '=', strip — no escapes."""
    props = {}
    with open(file_path, "rt") as f:
        for line in f:
            line = line.strip()
            if not line.startswith("#"):
                pair = line.split("=", 1)
                if len(pair) > 1:
                    key = pair[0].strip()
                    props[key] = pair[1].strip()
    return props


def test_naive_parser_copy_matches_installed_torchserve():
    """The copy above must stay the code TorchServe really runs."""
    import inspect
    import ts.model_server
    src = inspect.getsource(ts.model_server.load_properties)
    for line in ('line = line.strip()', 'if not line.startswith("#"):', 'pair = line.split("=", 1)',
                 'props[key] = pair[1].strip()'):
        assert line in src


def test_java_reads_back_every_value_unchanged(java_load, tmp_path):
    originals = {
        "win.path": r"C:\models\store",
        "win.newline.trap": r"C:\new\users\x",           # \n and \u would break a naive writer
        "unicode": "Modèles — 模型 ✓ 🚀",                  # beyond the BMP: surrogate pair
        "specials": "a=b:c #not a comment !nor this",
        "leading space": "  two leading spaces, trailing kept  ",
        "tabs\tand\nnewlines": "x\ty\nz\r\f",
        "#hash:key=": "value",
        "empty": "",
    }
    p = tmp_path / "t.properties"
    p.write_text(format_properties(originals, header=["a header"]), encoding="ascii")
    assert java_load(p) == originals


def test_windows_config_properties_through_both_parsers(java_load, tmp_path):
    store = r"C:\models\store #1=a\Übung"
    with pytest.raises(ConfigWriteError, match="non-ASCII"):
        write_config_properties(tmp_path / "bad.properties", DERIVATION, model_name="m", model_store=store,
                                platform="windows")
    store = r"C:\models\new store #1=a!"                # backslashes, a space, '#', '=', '!'
    path = write_config_properties(tmp_path / "config.properties", DERIVATION, model_name="minilm",
                                   model_store=store, platform="windows", bind_address="0.0.0.0",
                                   ports={"inference": 9080, "management": 9081, "metrics": 9082,
                                          "grpc_inference": 9070, "grpc_management": 9071})
    java = java_load(path)
    naive = naive_load_properties(path)
    # Both parsers read the same string, and it names the original Windows path.
    assert java["model_store"] == naive["model_store"] == "C:/models/new store #1=a!"
    assert PureWindowsPath(java["model_store"]) == PureWindowsPath(store)
    assert set(naive) >= NAIVE_PARSER_KEYS & set(java)
    assert java["load_models"] == "minilm=minilm.mar"
    assert java["inference_address"] == "http://0.0.0.0:9080"
    assert java["management_address"] == "http://0.0.0.0:9081"
    assert java["metrics_address"] == "http://0.0.0.0:9082"
    assert java["grpc_inference_port"] == "9070" and java["grpc_management_port"] == "9071"
    assert java["enable_model_api"] == "false"
    assert "disable_token_authorization" not in java          # token auth stays on
    assert java["default_workers_per_model"] == "2"
    assert java["default_response_timeout"] == "7" and java["default_startup_timeout"] == "42"
    assert java["job_queue_size"] == "32"
    assert java["max_request_size"] == "131072" and java["max_response_size"] == "65536"
    text = path.read_text()
    assert text.startswith("# Generated") and text.isascii()


def test_linux_paths_and_the_naive_parser(tmp_path):
    path = write_config_properties(tmp_path / "c.properties", DERIVATION, model_name="m",
                                   model_store="/srv/model store/x=y")
    assert naive_load_properties(path)["model_store"] == "/srv/model store/x=y"
    with pytest.raises(ConfigWriteError, match="backslash"):
        write_config_properties(tmp_path / "c2.properties", DERIVATION, model_name="m", model_store="/srv/a\\b")
    with pytest.raises(ConfigWriteError, match="whitespace"):
        format_properties({"vmargs": " -Xmx1g"})


def test_host_path():
    assert host_path(r"C:\models\store", "windows") == "C:/models/store"
    assert host_path("/a/b", "linux") == "/a/b"
    with pytest.raises(ConfigWriteError, match="platform"):
        host_path("/a", "macos")


def test_model_config_native_ints_and_both_timeouts(tmp_path):
    derivation = {k: {"value": v, "formula": "f", "inputs": {}, "overridden": False} for k, v in DERIVATION.items()}
    path = write_model_config(tmp_path / "model-config.yaml", derivation)
    cfg = yaml.safe_load(path.read_text())
    assert cfg == {"minWorkers": 2, "maxWorkers": 2, "batchSize": 8, "maxBatchDelay": 5, "responseTimeout": 7,
                   "startupTimeout": 42, "jobQueueSize": 32, "deviceType": "cpu",
                   "handler": {"threads": 1, "device": "cpu", "warmup_batch_size": 1, "max_request_bytes": 65536}}
    for key, value in cfg.items():
        if key not in ("deviceType", "handler"):
            assert type(value) is int, key           # quoted "300" is ignored by TorchServe
    body = [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]
    assert not any("'" in ln or '"' in ln for ln in body)
    gpu = model_config_dict({**DERIVATION, "device": "cuda"})
    assert gpu["deviceType"] == "gpu" and gpu["handler"]["device"] == "cuda"
    assert gpu["handler"]["warmup_batch_size"] == 8           # a GPU warms up at a model call's rows


@pytest.mark.parametrize("key,value,match", [("max_batch_delay_ms", 0, "100 ms"), ("workers", 0, "min > 0"),
                                             ("batch_size", 2.5, "whole number"), ("startup_timeout_s", "300", "whole")])
def test_model_config_rejects_values_torchserve_would_misread(key, value, match):
    with pytest.raises(ConfigWriteError, match=match):
        model_config_dict({**DERIVATION, key: value})


def test_start_command():
    cmd = start_command(model_name="minilm", model_store="/srv/store", config_path="/srv/config.properties",
                        threads=2)
    assert cmd["argv"] == ["torchserve", "--start", "--ncs", "--model-store", "/srv/store", "--models",
                           "minilm=minilm.mar", "--ts-config", "/srv/config.properties"]
    assert cmd["env"]["OMP_NUM_THREADS"] == "2"
    line = format_start_command(cmd)
    assert line.startswith("OMP_NUM_THREADS=2 ") and "--ncs" in line
    win = format_start_command(start_command(model_name="m", model_store=r"C:\a b\s", config_path=r"C:\c.properties",
                                             threads=1, platform="windows"), "windows")
    assert "set OMP_NUM_THREADS=1" in win and '"C:/a b/s"' in win
