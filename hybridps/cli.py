"""Typed dataclass configs <-> command-line flags <-> environment variables.

Every field `foo_bar` of a config dataclass becomes the flag `--foo-bar` and
reads the environment variable `HYBRIDPS_FOO_BAR` as its default, so a compose
file can set any flag. Precedence: flag > environment > dataclass default.
Validation stays in the dataclass's __post_init__ (real exceptions, never assert).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "HYBRIDPS_"


class ConfigError(ValueError):
    """A flag or environment variable with a value the config cannot take."""


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(underlying type, optional?) for `X` or `X | None`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(tp: Any, text: str, where: str) -> Any:
    base, optional = _base_type(tp)
    if optional and text.strip().lower() in ("", "none"):
        return None
    try:
        if base is bool:
            return _parse_bool(text)
        if base in (int, float, str):
            return base(text)
    except ValueError as exc:
        raise ConfigError(f"{where}={text!r}: expected {base.__name__} ({exc})") from None
    raise ConfigError(f"{where}: unsupported config type {tp!r}")


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field; a bool flag given alone (`--compile`) means true."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        help_text = field.metadata.get("help", "")
        default = field.default if field.default is not dataclasses.MISSING else None
        help_full = f"{help_text} (default {default!r}) [env {env_name(field.name)}]".strip()
        extra: dict[str, Any] = {}
        if _base_type(hints[field.name])[0] is bool:
            extra = {"nargs": "?", "const": "true"}
        parser.add_argument(
            flag_name(field.name),
            dest=field.name,
            default=None,
            metavar=field.metadata.get("metavar", field.name.upper()),
            help=help_full,
            **extra,
        )


DefaultsHook = Callable[[Mapping[str, Any]], Mapping[str, Any]]


def from_namespace(cls: type[T], ns: argparse.Namespace,
                   environ: Mapping[str, str] | None = None,
                   defaults: DefaultsHook | None = None) -> T:
    """Build the dataclass from parsed flags, falling back to the environment.

    `defaults(given)` (optional) sees the values given by flag or environment and returns
    defaults for other fields (e.g. a task's own defaults): flag > env > hook > dataclass.
    """
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = getattr(ns, field.name, None)
        where = flag_name(field.name)
        if raw is None and env_name(field.name) in environ:
            raw = environ[env_name(field.name)]
            where = env_name(field.name)
        if raw is not None:
            values[field.name] = _convert(hints[field.name], raw, where)
    if defaults is not None:
        for name, value in defaults(dict(values)).items():
            values.setdefault(name, value)
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def parse_config(cls: type[T], argv: Sequence[str] | None = None, *, prog: str | None = None,
                 description: str | None = None,
                 environ: Mapping[str, str] | None = None,
                 defaults: DefaultsHook | None = None, epilog: str | None = None) -> T:
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    add_dataclass_flags(parser, cls)
    ns = parser.parse_args(argv)
    try:
        return from_namespace(cls, ns, environ, defaults)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
