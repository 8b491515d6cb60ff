"""params.yaml: the typed contract, validated once at the edge.

Every stage calls `load_params()` first. Every mistake (unknown key, wrong type, a number out of
range, a rule across fields) is collected and raised together as one `ParamsError` naming the
file and, per problem, the key, the bad value and what is allowed, before any work. Inside the
pipeline the result is plain frozen dataclasses (the schema: pipeline/core/params_schema.py);
`as_dict()` turns them back into plain data for records.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any, Optional

import yaml

from pipeline.core.params_checks import check_semantics
from pipeline.core.params_schema import *  # noqa: F401,F403  (the schema, re-exported: one import for stages)
from pipeline.core.params_schema import PKG_PREFIX, Params
from pipeline.core.params_typed import Builder, ParamsError, Problem

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PARAMS = REPO_ROOT / "params.yaml"

__all__ = ["ParamsError", "Problem", "REPO_ROOT", "DEFAULT_PARAMS", "parse_params", "load_params", "as_dict",
           "resolve_path", "checkpoint_path", "load_concurrency", "display_path", "params_and_problems",
           "read_params_file"]


# --------------------------------------------------------------------------- loading
def parse_params(data: Any, source: str = "params.yaml") -> Params:
    """Validate an already-parsed params mapping: every problem at once, named after `source`."""
    params, problems, _ = params_and_problems(data)
    if problems:
        raise ParamsError.of(problems, source)
    return params


def params_and_problems(data: Any) -> tuple[Optional[Params], list[Problem], list[str]]:
    """The params as far as they could be built (a bad value replaced by its default, a bad required
    one by a stand-in; None when the file is not a mapping), every problem found, and the keys that
    hold a stand-in (no rule is judged on those sections)."""
    builder = Builder(Params)
    params = builder.build(Params, data, "")
    if not isinstance(params, Params):
        return None, builder.problems, builder.degraded
    broken = tuple(key.rsplit(".", 1)[0] + "." if "." in key else key for key in builder.degraded)
    problems = builder.problems + [p for p in check_semantics(params)
                                   if not any(p.key == b.rstrip(".") or p.key.startswith(b) for b in broken)]
    return params, problems, builder.degraded


def read_params_file(path: str | os.PathLike | None = None) -> tuple[Any, str]:
    """The parsed YAML of `path` / $PIPELINE_PARAMS / params.yaml, and its name as a user says it."""
    env = os.environ.get("PIPELINE_PARAMS")
    path = Path(path) if path else (resolve_path(env) if env else DEFAULT_PARAMS)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ParamsError(f"params file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{display_path(path)}: not valid YAML: {e}") from None
    return data, display_path(path)


def load_params(path: str | os.PathLike | None = None) -> Params:
    """`path`, else $PIPELINE_PARAMS (another params file, e.g. examples/tensor/params.yaml), else
    params.yaml. Note: DVC tracks params.yaml only; for `dvc repro` copy an example over params.yaml."""
    data, source = read_params_file(path)
    return parse_params(data, source)


def display_path(path: Path) -> str:
    """A file as a user names it: relative to the repo root when inside it."""
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def as_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


# --------------------------------------------------------------------------- paths
def resolve_path(spec: str, base: Path = REPO_ROOT) -> Path:
    """`pkg:<module>/<sub/path>` → inside the installed package (no machine path committed);
    relative → against the repo root; absolute → as is."""
    if spec.startswith(PKG_PREFIX):
        module, _, sub = spec[len(PKG_PREFIX):].partition("/")
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            raise ParamsError(f"`{spec}`: Python package `{module}` is not installed; "
                              f"install it (see requirements.txt) or give a file path")
        return Path(list(found.submodule_search_locations)[0]) / sub
    p = Path(spec).expanduser()
    return p if p.is_absolute() else base / p


def checkpoint_path(params: Params) -> Path:
    return resolve_path(params.model.checkpoint)


def load_concurrency(params: Params) -> tuple[int, str]:
    """The load serve_check measures, and the key that set it: serve_check.concurrency when given,
    else serve.expected_concurrency (the load tune chose the operating point for)."""
    if params.serve_check.concurrency is not None:
        return params.serve_check.concurrency, "serve_check.concurrency"
    return params.serve.expected_concurrency, "serve.expected_concurrency"
