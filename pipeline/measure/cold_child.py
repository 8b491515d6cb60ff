"""One cold start, in a fresh process: `python -m pipeline.measure.cold_child --model-dir DIR ...`

Imports nothing heavy before timing starts; prints one line `COLD_LOAD_RESULT {json}` with the
phases in seconds and monotonic timestamps (CLOCK_MONOTONIC is system-wide, so the parent can
subtract its spawn time and get the wall time including interpreter start).
"""
import time

_STARTED_AT = time.monotonic()

import argparse  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

MARKER = "COLD_LOAD_RESULT "
RUNTIME_PHASES = ("import", "read", "deserialize", "to_device")


def resolve_callable(spec: str):
    """'pkg.module:fn' or 'path/to/file.py:fn' → the function."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"callable spec {spec!r} must look like 'pkg.module:function' or 'file.py:function'")
    if target.endswith(".py"):
        path = Path(target)
        mod_spec = importlib.util.spec_from_file_location(f"_cold_{path.stem}", path)
        if mod_spec is None or not path.exists():
            raise ValueError(f"callable spec {spec!r}: file {path} not found")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_spec.name] = module
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"callable spec {spec!r}: {target} has no attribute {name!r}") from None


def cold_start(loader_spec: str, feeds_spec: str, model_dir: str, device: str, threads, seq_len,
               tensorrt: bool = False) -> dict:
    phases = {"interpreter": 0.0}
    t0 = time.monotonic()
    loader = resolve_callable(loader_spec)
    import_module_s = time.monotonic() - t0

    t0 = time.monotonic()
    runtime = loader(model_dir, device=device, threads=threads, **({"tensorrt": True} if tensorrt else {}))
    load_wall = time.monotonic() - t0
    reported = {k: float(v) for k, v in (getattr(runtime, "load_phases", None) or {}).items()}
    if not reported:          # a loader that reports no phases: its whole call is deserialization
        reported = {"deserialize": load_wall}
    phases["import"] = import_module_s + reported.pop("import", 0.0)
    for k in ("read", "deserialize", "to_device"):
        phases[k] = reported.pop(k, 0.0)
    phases.update(reported)   # extra phases a loader names
    # loader overhead no phase accounts for (reading variant.json, dispatch)
    phases["other"] = max(0.0, load_wall - sum(v for k, v in phases.items() if k != "interpreter") + import_module_s)

    t0 = time.monotonic()
    feeds = resolve_callable(feeds_spec)(model_dir, 1, seq_len)
    phases["adapter"] = time.monotonic() - t0

    t0 = time.monotonic()
    runtime.run(feeds)
    if device == "cuda" and "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.synchronize()
    phases["first_call"] = time.monotonic() - t0
    done_at = time.monotonic()
    close = getattr(runtime, "close", None)
    if close:
        close()
    return {"phases": phases, "started_at": _STARTED_AT, "done_at": done_at}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--loader", default="handlers.runtime:load_runtime")
    ap.add_argument("--feeds", default="pipeline.measure.feeds:example_feeds")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--tensorrt", action="store_true")
    a = ap.parse_args(argv)
    result = cold_start(a.loader, a.feeds, a.model_dir, a.device, a.threads, a.seq_len, a.tensorrt)
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
