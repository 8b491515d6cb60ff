"""Typed dataclasses from plain YAML data: each value converted to its field's annotated type. Every
unknown or missing key and every value of the wrong type becomes one `Problem` (key, value, fix);
all of them are collected, so one run names every mistake. The schema itself lives in
pipeline/core/params_schema.py."""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Literal

MISSING = object()          # a Problem's value when the key is absent
INVALID = object()          # convert's result for a value it could not convert (a Problem was recorded)


@dataclass(frozen=True)
class Problem:
    """One mistake: the key (dotted path), the value found, and what is allowed or how to fix it."""
    key: str
    value: Any
    fix: str
    unknown: bool = False        # a key the schema does not have (fix: the near miss, the allowed keys)

    def line(self) -> str:
        if self.value is MISSING:
            return f"`{self.key}` is missing: {self.fix}"
        if self.unknown:
            return f"unknown key `{self.key}` (= {self.value!r}): {self.fix}"
        return f"`{self.key}` = {self.value!r} is invalid; allowed: {self.fix}"


class ParamsError(ValueError):
    """The params file is wrong; the message names the file, and per problem the key, the value and
    what is allowed. `problems` holds them as data (empty for a message-only error)."""

    def __init__(self, message: str, problems: Iterable[Problem] = ()):
        super().__init__(message)
        self.problems = list(problems)

    @classmethod
    def of(cls, problems: list[Problem], source: str = "params.yaml") -> "ParamsError":
        if len(problems) == 1:
            return cls(f"{source}: {problems[0].line()}", problems)
        lines = "\n".join(f"  {i}. {p.line()}" for i, p in enumerate(problems, 1))
        return cls(f"{source}: {len(problems)} problems, nothing was run:\n{lines}", problems)


def bad_value(key: str, value: Any, allowed: str) -> ParamsError:
    return ParamsError.of([Problem(key, value, allowed)])


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


def schema_paths(cls: type, prefix: str = "") -> list[str]:
    """Every key of a schema as a dotted path (a dict of sections as `<name>`, a list as `[]`)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = join(prefix, f.name)
        out.append(key)
        tp = hints[f.name]
        inner = _section_type(tp)
        if inner is not None:
            sub, suffix = inner
            out += schema_paths(sub, key + suffix)
    return out


def _section_type(tp: Any) -> tuple[type, str] | None:
    """The dataclass a field holds (directly, as dict values or as list items) and its path suffix."""
    if dataclasses.is_dataclass(tp):
        return tp, ""
    origin = typing.get_origin(tp)
    if origin is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
        return typing.get_args(tp)[1], ".<name>"
    if origin is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return typing.get_args(tp)[0], "[]"
    return None


class Builder:
    """Converts one params mapping against a schema, collecting every problem (`problems`)."""

    def __init__(self, root: type):
        self.problems: list[Problem] = []
        self.degraded: list[str] = []          # required keys built from a placeholder (their value was bad)
        self._paths = schema_paths(root)

    def add(self, key: str, value: Any, fix: str, unknown: bool = False) -> Any:
        self.problems.append(Problem(key, value, fix, unknown))
        return INVALID

    def suggestion(self, prefix: str, name: str, siblings: list[str]) -> str:
        near = difflib.get_close_matches(name, siblings, n=1, cutoff=0.75)
        if near:
            return f"did you mean `{join(prefix, near[0])}`? "
        # the key under another section, e.g. model.max_length -> model.text.max_length
        leaf = [p for p in self._paths if p.rsplit(".", 1)[-1] == name]
        if leaf:
            return f"did you mean `{leaf[0]}`? "
        return ""

    def convert(self, tp: Any, value: Any, key: str) -> Any:
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            args = typing.get_args(tp)
            if value is None and type(None) in args:
                return None
            for arg in args:
                if arg is type(None):
                    continue
                trial = Builder.__new__(Builder)
                trial.problems, trial.degraded, trial._paths = [], [], self._paths
                out = trial.convert(arg, value, key)
                if out is not INVALID:
                    return out
            return self.add(key, value, type_name(tp))
        if origin is Literal:
            choices = typing.get_args(tp)
            if value not in choices:
                near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                return self.add(key, value, type_name(tp) + hint)
            return value
        if origin is list:
            if not isinstance(value, list):
                return self.add(key, value, type_name(tp))
            (item_tp,) = typing.get_args(tp)
            items = [self.convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
            return INVALID if any(i is INVALID for i in items) else items
        if origin is dict:
            if not isinstance(value, dict):
                return self.add(key, value, type_name(tp))
            _, value_tp = typing.get_args(tp)
            items = {str(k): self.convert(value_tp, v, f"{key}.{k}") for k, v in value.items()}
            return INVALID if any(v is INVALID for v in items.values()) else items
        if tp is dict:
            return dict(value) if isinstance(value, dict) else self.add(key, value, "a mapping")
        if dataclasses.is_dataclass(tp):
            return self.build(tp, value, key)
        if tp is bool:
            return value if isinstance(value, bool) else self.add(key, value, "true/false")
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                return self.add(key, value, "an integer")
            return value
        if tp is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return self.add(key, value, "a number")
            return float(value)
        if tp is str:
            return value if isinstance(value, str) else self.add(key, value, "a string")
        raise TypeError(f"schema type {tp} not supported")

    def build(self, cls: type, data: Any, prefix: str) -> Any:
        """The dataclass, a bad field falling back to its default; INVALID if a required one is bad."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            return self.add(prefix or "<top level>", data, "a mapping")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in sorted(set(data) - set(fields), key=str):
            where = f"`{prefix}`" if prefix else "the top level"
            self.add(join(prefix, str(name)), data[name],
                     f"not a setting under {where}; {self.suggestion(prefix, str(name), sorted(fields))}"
                     f"allowed keys: {', '.join(sorted(fields))} (docs/params.md)", unknown=True)
        kwargs = {}
        for name, f in fields.items():
            key = join(prefix, name)
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            value = self.convert(hints[name], data[name], key) if name in data else INVALID
            if name not in data and required:
                self.add(key, MISSING, f"required ({type_name(hints[name])})")
            if value is not INVALID:
                kwargs[name] = value
            elif required:
                # a stand-in, so the other sections' rules still run; parse_params drops what they
                # say about this section
                kwargs[name] = placeholder(hints[name])
                self.degraded.append(key)
        return cls(**kwargs)


def placeholder(tp: Any) -> Any:
    """A value of type `tp` standing in for a required value that was bad or missing."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return typing.get_args(tp)[0]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if len(args) < len(typing.get_args(tp)) else placeholder(args[0])
    if origin is list:
        return []
    if origin is dict or tp is dict:
        return {}
    if dataclasses.is_dataclass(tp):
        return Builder(tp).build(tp, {}, "")
    return {int: 1, float: 1.0, bool: False, str: "placeholder"}[tp]


def build(cls: type, data: Any, prefix: str) -> Any:
    """`cls` from `data`, or ParamsError naming every problem (one schema section on its own)."""
    builder = Builder(cls)
    out = builder.build(cls, data, prefix)
    if builder.problems:
        raise ParamsError.of(builder.problems)
    return out


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
