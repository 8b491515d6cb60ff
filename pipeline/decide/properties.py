"""Writers for TorchServe's config.properties, the .mar's model-config.yaml and the start command.

config.properties is read by TWO parsers (torchserve-0.12.md):
  1. the Java frontend: java.util.Properties.load(InputStream) — ISO-8859-1, backslash escapes
     (`C:\\models` would lose its backslashes), `\\uXXXX` for anything else;
  2. ts/model_server.py `load_properties()` (v0.12.0, the lines reimplemented in
     tests/decide/test_properties.py): `line.strip()`, skip lines starting with `#`, `split("=", 1)`, strip —
     no escapes at all. It reads `model_store`, `vmargs` and `plugins_path`.
Every key except those three is escaped the way Properties.store() does, so Java reads back any
string (Windows paths, Unicode) unchanged. For the three naive-parser keys no escaped spelling can
satisfy both parsers, so their values are written so that they need no escaping at all: Windows
paths with forward slashes (`C:/models/store`, which Windows and Java accept as the same path), and a
clear error for what cannot be written that way (non-ASCII, backslashes in a POSIX path, edge
whitespace, line breaks).

All functions take plain dicts so tests (and pipeline/serve/server/torchserve.py) can call them directly.
"""
from __future__ import annotations

import shlex
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterable, Optional

import yaml

from pipeline.decide.store_form import models_arg

# Keys that ts/model_server.py also reads with its naive parser.
NAIVE_PARSER_KEYS = frozenset({"model_store", "vmargs", "plugins_path"})

# Derivation keys → model-config.yaml keys (frontend keys; TorchServe wants native YAML ints).
YAML_KEYS = {
    "batch_size": "batchSize",
    "max_batch_delay_ms": "maxBatchDelay",
    "response_timeout_s": "responseTimeout",
    "startup_timeout_s": "startupTimeout",
    "job_queue_size": "jobQueueSize",
}


class ConfigWriteError(ValueError):
    """A value cannot be written so that TorchServe reads it back unchanged; says why and the fix."""


# --------------------------------------------------------------------------- java.util.Properties
def _escape(text: str, *, is_key: bool) -> str:
    """Properties.store()'s escaping (saveConvert): \\ \\t \\n \\r \\f, spaces (all in keys, the leading
    one in values), `= : # !` in keys, and \\uXXXX for everything outside printable ASCII."""
    out = []
    for i, ch in enumerate(text):
        o = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == " ":
            out.append("\\ " if is_key or i == 0 else " ")
        elif ch in "\t\n\r\f":
            out.append({"\t": "\\t", "\n": "\\n", "\r": "\\r", "\f": "\\f"}[ch])
        elif ch in "=:#!" and is_key:
            # In a value these are literal to load() (only the first unescaped separator after the
            # key counts, comments only start a line), so values stay readable: http://host:8080.
            out.append("\\" + ch)
        elif o < 0x20 or o > 0x7E:
            # Characters beyond the BMP become surrogate pairs, as Java strings hold them.
            for unit in (ch.encode("utf-16-be")[j:j + 2] for j in range(0, len(ch.encode("utf-16-be")), 2)):
                out.append("\\u%04X" % int.from_bytes(unit, "big"))
        else:
            out.append(ch)
    return "".join(out)


def escape_key(key: str) -> str:
    return _escape(key, is_key=True)


def escape_value(value: str) -> str:
    return _escape(value, is_key=False)


def naive_safe_value(key: str, value: str) -> str:
    """`value` unchanged if both parsers read it identically, else ConfigWriteError."""
    problems = []
    if value != value.strip():
        problems.append("leading/trailing whitespace (the Python parser strips it)")
    if "\\" in value:
        problems.append("a backslash (an escape to Java, a literal to the Python parser)")
    if any(ord(c) > 0x7E for c in value):
        problems.append("non-ASCII characters (Java needs \\uXXXX escapes, which the Python parser keeps literally)")
    if any(ord(c) < 0x20 for c in value):
        problems.append("control characters / line breaks")
    if problems:
        raise ConfigWriteError(
            f"config.properties `{key}` = {value!r} cannot be written so that both of TorchServe's parsers "
            f"(java.util.Properties and ts/model_server.py) read it back unchanged: it contains "
            f"{'; '.join(problems)}. Choose a path without them (for Windows, forward slashes are fine: "
            f"C:/models/store).")
    return value


def format_properties(entries: Iterable[tuple[str, Any]] | dict, header: Iterable[str] = ()) -> str:
    """ASCII text of a .properties file; values of NAIVE_PARSER_KEYS are checked, not escaped."""
    items = entries.items() if isinstance(entries, dict) else entries
    lines = [("# " + h).rstrip() if h else "#" for h in header]
    for h in lines:
        if any(ord(c) > 0x7E for c in h):
            raise ConfigWriteError(f"header line {h!r} must be ASCII")
    for key, value in items:
        value = _str(value)
        if key in NAIVE_PARSER_KEYS:
            lines.append(f"{key}={naive_safe_value(key, value)}")
        else:
            lines.append(f"{escape_key(key)}={escape_value(value)}")
    return "\n".join(lines) + "\n"


def _str(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def host_path(path: str | Path, platform: str) -> str:
    """A path as the deployment host should read it from config.properties.

    windows: `C:\\models\\store` → `C:/models/store` (the same path to Windows and to Java, and
    needing no escapes); linux: the POSIX path as is."""
    if platform == "windows":
        return PureWindowsPath(str(path)).as_posix()
    if platform == "linux":
        return str(PurePosixPath(str(path)))
    raise ConfigWriteError(f"serve.platform {platform!r} unknown; use 'linux' or 'windows'")


# --------------------------------------------------------------------------- config.properties
def config_properties_entries(values: dict, *, model_name: str, model_store: str | Path,
                              bind_address: str = "127.0.0.1", platform: str = "linux",
                              ports: Optional[dict] = None) -> list[tuple[str, Any]]:
    """The entries, in file order. `values`: derivation values (see pipeline/decide/serve_config.py) — at
    least workers, startup_timeout_s, response_timeout_s, job_queue_size, max_request_size,
    max_response_size. `ports`: inference, management, metrics, and optionally grpc_inference,
    grpc_management (own ports so parallel servers don't collide)."""
    p = {"inference": 8080, "management": 8081, "metrics": 8082, **(ports or {})}
    host = bind_address if ":" not in bind_address else f"[{bind_address}]"   # IPv6 literal
    entries: list[tuple[str, Any]] = [
        # Security: token authorization stays on (the default; never written as disabled), the model
        # registration API off, every listener on serve.bind_address (loopback by default).
        ("enable_model_api", False),
        ("inference_address", f"http://{host}:{p['inference']}"),
        ("management_address", f"http://{host}:{p['management']}"),
        ("metrics_address", f"http://{host}:{p['metrics']}"),
        ("grpc_inference_address", bind_address),
        ("grpc_management_address", bind_address),
    ]
    for key in ("grpc_inference", "grpc_management"):
        if key in p:
            entries.append((f"{key}_port", p[key]))
    entries += [
        ("install_py_dep_per_model", False),      # no pip at registration
        ("model_store", host_path(model_store, platform)),
        # The .mar, or the folder it is unpacked into (derivation `store_form`; pipeline/decide/store_form.py).
        ("load_models", models_arg(model_name, values.get("store_form") or "mar")),
        # Explicit: TorchServe's default is one worker per CPU core, each oversubscribing threads.
        ("default_workers_per_model", int(values["workers"])),
        # Same figures as the model-config.yaml, which wins whenever the .mar carries one.
        ("default_response_timeout", int(values["response_timeout_s"])),
        ("default_startup_timeout", int(values["startup_timeout_s"])),
        ("job_queue_size", int(values["job_queue_size"])),
        ("max_request_size", int(values["max_request_size"])),
        ("max_response_size", int(values["max_response_size"])),
    ]
    return entries


def write_config_properties(path: str | Path, derivation: dict, *, model_name: str, model_store: str | Path,
                            bind_address: str = "127.0.0.1", platform: str = "linux",
                            ports: Optional[dict] = None, source: str = "") -> Path:
    """Write config.properties from a derivation (Derived records, their dicts or plain values)."""
    from pipeline.decide.serve_config import values as derivation_values
    vals = derivation_values(derivation)
    header = ["Generated by the model-optimization pipeline (stages/configure.py); do not edit by hand.",
              f"Model: {model_name}. {source}".rstrip(),
              "Every figure is explained in derivation.json beside this file.",
              "Token authorization is ON: clients need the keys from key_file.json in the server's cwd."]
    text = format_properties(config_properties_entries(vals, model_name=model_name, model_store=model_store,
                                                       bind_address=bind_address, platform=platform,
                                                       ports=ports), header)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="ascii")
    return path


# --------------------------------------------------------------------------- model-config.yaml
def _native_int(key: str, value: Any) -> int:
    """TorchServe ignores quoted numbers ("300") with only a warning: insist on real integers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ConfigWriteError(f"model-config.yaml `{key}` = {value!r}: must be a whole number")
    return int(value)


def warmup_rows(device: str | None, rows: int) -> int:
    """Rows of the worker's warm-up call(s) before it reports ready. On a CPU one row warms what the
    first request needs (kernels chosen, weights paged in, TorchScript's executor settled): after a
    1-row warm-up the first 1-row request and the first 8-row batch were as fast as after an 8-row
    one (bf16 TorchScript, ONNX int8 and fp16 XLM-R-large), and a worker started ~0.3 s sooner. On a
    GPU the warm-up stays at the rows of a model call (its allocator's blocks and kernels for that
    size; not measured smaller)."""
    return rows if device == "cuda" else 1


def model_config_dict(derivation: dict) -> dict:
    """The yaml content. Both timeouts are always present: a yaml in the .mar silently overrides every
    other timeout setting, with 120 s defaults for whichever it lacks."""
    from pipeline.decide.serve_config import values as derivation_values
    vals = derivation_values(derivation)
    workers = _native_int("workers", vals["workers"])
    if workers < 1:
        raise ConfigWriteError(f"workers = {workers}: TorchServe ignores min/maxWorkers unless min > 0")
    delay = _native_int("maxBatchDelay", vals["max_batch_delay_ms"])
    if delay < 1:
        raise ConfigWriteError(f"maxBatchDelay = {delay}: TorchServe turns 0 into 100 ms; use 1 for 'no wait'")
    device = vals.get("device") or "cpu"
    cfg: dict[str, Any] = {"minWorkers": workers, "maxWorkers": workers}
    for dkey, ykey in YAML_KEYS.items():
        cfg[ykey] = _native_int(ykey, vals[dkey])
    cfg["deviceType"] = "gpu" if device == "cuda" else "cpu"
    # Rows per model call: the handler's own setting where a request is many rows (rerank), else it
    # follows batchSize. The warm-up call runs at warmup_rows (one row on a CPU).
    rows = _native_int("handler.batch_rows", vals.get("batch_rows") or cfg["batchSize"])
    cfg["handler"] = {
        "threads": _native_int("handler.threads", vals["threads_per_worker"]),
        "device": device,
        "warmup_batch_size": warmup_rows(device, rows),
        "max_request_bytes": _native_int("handler.max_request_bytes", vals["max_request_bytes"]),
        **({"batch_rows": rows} if rows != cfg["batchSize"] else {}),
    }
    return cfg


def write_model_config(path: str | Path, derivation: dict, source: str = "") -> Path:
    cfg = model_config_dict(derivation)
    text = ("# Generated by stages/configure.py; read by TorchServe's frontend (top-level keys) and the handler\n"
            "# (`handler:`). Each figure is explained in derivation.json." + (f" {source}" if source else "") + "\n"
            + yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- start command
def start_command(*, model_name: str, model_store: str | Path, config_path: str | Path, threads: int,
                  platform: str = "linux", store_form: str = "mar") -> dict:
    """argv + env for starting TorchServe with this config. `--ncs`: never restore an old config
    snapshot from logs/config/. The thread variables stop any library in the worker from spawning
    one thread per core on top of the handler's intra-op threads."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    argv = ["torchserve", "--start", "--ncs", "--model-store", host_path(model_store, platform),
            "--models", models_arg(model_name, store_form), "--ts-config", host_path(config_path, platform)]
    return {"argv": argv, "env": env}


def format_start_command(cmd: dict, platform: str = "linux") -> str:
    if platform == "windows":
        lines = [f"set {k}={v}" for k, v in cmd["env"].items()]
        lines.append(" ".join(f'"{a}"' if " " in a else a for a in cmd["argv"]))
    else:
        lines = [" ".join(f"{k}={shlex.quote(v)}" for k, v in cmd["env"].items()) + " "
                 + " ".join(shlex.quote(a) for a in cmd["argv"])]
    return "\n".join(lines) + "\n"


def write_start_command(path: str | Path, cmd: dict, platform: str = "linux") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_start_command(cmd, platform))
    return path


# --------------------------------------------------------------------------- the serve folder
def write_serve_files(out: str | Path, derivation: dict, *, model_name: str, serve: Any, model_store: str | Path,
                      source: str = "", frontend: Optional[dict] = None) -> Path:
    """derivation.json, model-config.yaml, config.properties and start_command.txt into `out` (the
    configure stage's proposal, then the tune stage's served choice). `serve`: ServeParams.
    `frontend`: extra config.properties settings (e.g. disable_system_metrics) the tuner kept."""
    import json

    from pipeline.decide.serve_config import derivation_as_dict, values
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plain = derivation_as_dict(derivation)
    (out / "derivation.json").write_text(json.dumps(plain, indent=2) + "\n")
    write_model_config(out / "model-config.yaml", derivation, source=source)
    ports = {"inference": serve.inference_port, "management": serve.management_port, "metrics": serve.metrics_port}
    config_path = write_config_properties(out / "config.properties", derivation, model_name=model_name,
                                          model_store=model_store, bind_address=serve.bind_address,
                                          platform=serve.platform, ports=ports, source=source)
    if frontend:
        with open(config_path, "a", encoding="ascii") as f:
            f.write(format_properties(frontend, ["Frontend settings kept by the tune stage (measured: derivation.json)"]))
    vals = values(derivation)
    cmd = start_command(model_name=model_name, model_store=model_store, config_path=config_path.resolve(),
                        threads=int(vals["threads_per_worker"]), platform=serve.platform,
                        store_form=vals.get("store_form") or "mar")
    write_start_command(out / "start_command.txt", cmd, serve.platform)
    return config_path
