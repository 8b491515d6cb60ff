"""Typed dataclasses from plain YAML data: each value converted to its field's annotated type, an
unknown or missing key, or a value of the wrong type, raised as `ParamsError` naming the key, the
value and what is allowed. The schema itself lives in pipeline/core/params.py."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal


class ParamsError(ValueError):
    """params.yaml is wrong; the message names the key, the value and what is allowed."""

def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list ({type_name(typing.get_args(tp)[0])} each)"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def bad_value(key: str, value: Any, allowed: str) -> ParamsError:
    return ParamsError(f"params.yaml: `{key}` = {value!r} is invalid; allowed: {allowed}")


def convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(arg, value, key)
            except ParamsError:
                pass
        raise bad_value(key, value, type_name(tp))
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad_value(key, value, type_name(tp))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad_value(key, value, type_name(tp))
        (item_tp,) = typing.get_args(tp)
        return [convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad_value(key, value, type_name(tp))
        _, value_tp = typing.get_args(tp)
        return {str(k): convert(value_tp, v, f"{key}.{k}") for k, v in value.items()}
    if tp is dict:
        if not isinstance(value, dict):
            raise bad_value(key, value, "a mapping")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad_value(key, value, "true/false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_value(key, value, "an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_value(key, value, "a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad_value(key, value, "a string")
        return value
    raise TypeError(f"schema type {tp} not supported")


def build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise bad_value(prefix or "<top level>", data, "a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"`{prefix}`" if prefix else "the top level"
        raise ParamsError(
            f"params.yaml: unknown key `{join(prefix, unknown[0])}` under {where}; "
            f"allowed keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, f in fields.items():
        key = join(prefix, name)
        if name in data:
            kwargs[name] = convert(hints[name], data[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ParamsError(f"params.yaml: required key `{key}` is missing ({type_name(hints[name])})")
    return cls(**kwargs)


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
