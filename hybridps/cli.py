"""Typed dataclass configs <-> command-line flags <-> HYBRIDPS_* environment variables.

A config is a frozen dataclass. A field whose type is itself a dataclass is a *section*
(one concern: the shard server, checkpoints, ...); every other field is a *setting*.

Naming rule. A setting named `foo_bar`, in whatever section, is the flag `--foo-bar` and
the environment variable `HYBRIDPS_FOO_BAR`. Setting names are unique within a config
tree (checked whenever the tree is read), so the section is not part of the name: it is
where the setting lives in code (`cfg.sync.staleness`) and the heading it is listed under
in `--help` and docs/flags.md. A flat config (no sections) may give a heading per setting
with `setting(..., group=...)`. Precedence: flag > environment > defaults hook (e.g. a
task's own defaults) > dataclass default.

Types: bool (`--x` alone means true; 1/0, true/false, yes/no, on/off), int, float, str,
`X | None`, and `Literal[...]`: the choices, written once in the type (or, where a registry
holds them, `setting(..., choices=FUNCTION)`: read from it at each check). A lower bound is
`setting(..., at_least=N)` (a float must also be finite). `check_settings` (called first by
a section's __post_init__) refuses a value outside its choices or bound, so a config built
in code is checked exactly like one from flags; other checks follow it in __post_init__.
Validation raises ValueError naming the value; the parser prints it as one line, last, and
exits with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NoReturn, TypeVar

T = TypeVar("T")
C = TypeVar("C", bound="FlagConfig")
ENV_PREFIX = "HYBRIDPS_"
EVERYDAY = "everyday flags"
OTHER = "options"
ENV_RULE = ("Every flag --foo-bar is also the environment variable HYBRIDPS_FOO_BAR "
            "(flag > environment > default).")


class ConfigError(ValueError):
    """A flag or environment variable with a value the config cannot take."""


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


# -- declaring settings and sections ------------------------------------------------------

def setting(default: Any, help: str, metavar: str | None = None, *, everyday: bool = False,
            group: str | None = None, at_least: float | None = None,
            choices: Callable[[], Sequence[Any]] | None = None) -> Any:
    """A setting with its help text. `everyday`: listed first in --help; `group`: its
    heading in a flat config (a nested one uses the section's title); `at_least`: the
    smallest value allowed (checked by check_settings); `choices`: a function returning the
    values allowed now (a registry's names), for a setting whose type is not a Literal."""
    meta: dict[str, Any] = {"help": help, "everyday": everyday}
    if choices is not None:
        meta["choices"] = choices
    if metavar:
        meta["metavar"] = metavar
    if group:
        meta["group"] = group
    if at_least is not None:
        meta["at_least"] = at_least
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, title: str) -> Any:
    """A section: a dataclass of settings under the heading `title`."""
    return dataclasses.field(default_factory=cls, metadata={"title": title})


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(underlying type, optional?) for `X` or `X | None`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def choices_of(tp: Any) -> tuple[Any, ...]:
    """The values of a `Literal[...]` type (possibly `| None`); () for any other type."""
    base, _ = _base_type(tp)
    return tuple(typing.get_args(base)) if typing.get_origin(base) is Literal else ()


def field_choices(f: dataclasses.Field, tp: Any) -> tuple[Any, ...]:  # type: ignore[type-arg]
    """The values setting `f` (of type `tp`) may take: its `choices` function's, else its
    Literal's; () for any value."""
    given = f.metadata.get("choices")
    return tuple(given()) if given is not None else choices_of(tp)


def format_choices(values: Sequence[Any]) -> str:
    return ", ".join(repr(v) if v == "" else str(v) for v in values)


def check_settings(obj: Any) -> None:
    """ValueError naming the first setting of `obj` outside its choices (`name='value' is
    not one of a, b`) or below its `at_least` (`name=value must be >= N`)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None and _base_type(hints[f.name])[1]:
            continue
        allowed = field_choices(f, hints[f.name])
        if allowed and value not in allowed:
            raise ValueError(f"{f.name}={value!r} is not one of {format_choices(allowed)}")
        low = f.metadata.get("at_least")
        if low is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name}={value!r} must be finite and >= {low:g}")
        if value < low:
            finite = "finite and " if isinstance(value, float) else ""
            raise ValueError(f"{f.name}={value!r} must be {finite}>= {low:g}")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One leaf of a config tree: where it lives and how it is spelled outside."""

    name: str
    path: tuple[str, ...]  # attribute path from the root, e.g. ("sync", "staleness")
    type: Any
    field: dataclasses.Field  # type: ignore[type-arg]
    heading: str

    @property
    def flag(self) -> str:
        return flag_name(self.name)

    @property
    def env(self) -> str:
        return env_name(self.name)

    @property
    def help(self) -> str:
        return str(self.field.metadata.get("help", ""))

    @property
    def everyday(self) -> bool:
        return bool(self.field.metadata.get("everyday", False))

    @property
    def choices(self) -> tuple[Any, ...]:
        return field_choices(self.field, self.type)

    @property
    def is_bool(self) -> bool:
        return _base_type(self.type)[0] is bool

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def at_least(self) -> float | None:
        low = self.field.metadata.get("at_least")
        return None if low is None else float(low)

    @property
    def metavar(self) -> str:
        given = self.field.metadata.get("metavar")
        if given:
            return str(given)
        if self.choices:
            return "|".join(str(c) for c in self.choices if c != "")
        return "BOOL" if self.is_bool else self.name.upper()


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def settings(cls: type) -> list[Setting]:
    """Every setting of a config tree, depth first in field order (TypeError on a name
    used twice: the flag and the variable would be ambiguous)."""
    out: list[Setting] = []
    _collect(cls, (), OTHER, out)
    seen: dict[str, tuple[str, ...]] = {}
    for s in out:
        if s.name in seen:
            raise TypeError(f"config setting {s.name!r} appears twice: "
                            f"{'.'.join(seen[s.name])} and {'.'.join(s.path)}")
        seen[s.name] = s.path
    return out


def _collect(cls: type, prefix: tuple[str, ...], heading: str, out: list[Setting]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if is_section(tp):
            _collect(tp, (*prefix, f.name), str(f.metadata.get("title", f.name)), out)
        else:
            out.append(Setting(f.name, (*prefix, f.name), tp, f,
                               str(f.metadata.get("group", heading))))


def sections(cls: type) -> Iterator[tuple[str, type]]:
    """(attribute, section class) of each section directly in `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if is_section(hints[f.name]):
            yield f.name, hints[f.name]


# -- flat values <-> a tree ------------------------------------------------------------

def from_flat(cls: type[T], values: Mapping[str, Any]) -> T:
    """Build a config tree from {setting name: value}; missing settings keep their defaults.
    TypeError naming an unknown setting; the sections' ValueError for a bad value."""
    known = {s.name for s in settings(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(map(repr, unknown))}")
    return _build(cls, values)


def _build(cls: type[T], values: Mapping[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if is_section(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def flat_values(obj: Any) -> dict[str, Any]:
    """{setting name: value} of a config tree (what --results records as "config")."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(flat_values(value))
        else:
            out[f.name] = value
    return out


class FlagConfig:
    """Mixin of a config root: build, read and change it by setting name."""

    @classmethod
    def of(cls: type[C], **values: Any) -> C:
        """The config with these settings (by flag name, `local_optimizer=True`)."""
        return from_flat(cls, values)

    def flat(self) -> dict[str, Any]:
        return flat_values(self)

    def replace(self: C, **values: Any) -> C:
        """A copy with these settings changed (validated again)."""
        return from_flat(type(self), {**self.flat(), **values})


# -- text -> values ---------------------------------------------------------------------

def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(tp: Any, text: str, where: str, allowed: Sequence[Any] = ()) -> Any:
    base, optional = _base_type(tp)
    if optional and text.strip().lower() in ("", "none"):
        return None
    if allowed:  # the value itself is checked by the section (one message for both ways)
        folded = [c for c in allowed if str(c).lower() == text.strip().lower()]
        return folded[0] if len(folded) == 1 else text
    try:
        if base is bool:
            return _parse_bool(text)
        if base in (int, float, str):
            return base(text)
    except ValueError:
        raise ConfigError(f"{where}={text!r}: expected {base.__name__}") from None
    raise ConfigError(f"{where}: unsupported config type {tp!r}")


# -- argparse --------------------------------------------------------------------------

class ConfigParser(argparse.ArgumentParser):
    """argparse with a one-line usage hint and the error as the last line printed."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"usage: {self.prog} [options]   (--help lists every flag)\n")
        self.exit(2, f"{self.prog}: error: {message}{self._suggestion(message)}\n")

    def _suggestion(self, message: str) -> str:
        """' (did you mean --steps?)' for a misspelled flag."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        guesses = []
        for token in message.split(":", 1)[1].split():
            flag = token.split("=", 1)[0]
            if flag.startswith("--"):
                guesses += difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        return f" (did you mean {', '.join(dict.fromkeys(guesses))}?)" if guesses else ""


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per setting, under one argument group per heading (everyday flags first);
    a bool flag given alone (`--compile`) means true."""
    groups: dict[str, Any] = {}
    found = settings(cls)
    if any(s.everyday for s in found):
        groups[EVERYDAY] = parser.add_argument_group(EVERYDAY)
    for s in found:
        heading = EVERYDAY if s.everyday else s.heading
        if heading not in groups:
            groups[heading] = parser.add_argument_group(heading)
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if s.is_bool else {}
        default = "" if s.default in ("", None) else f" (default {s.default})"
        groups[heading].add_argument(s.flag, dest=s.name, default=None, metavar=s.metavar,
                                     help=f"{s.help}{default}".replace("%", "%%"), **extra)


DefaultsHook = Callable[[Mapping[str, Any]], Mapping[str, Any]]


def from_namespace(cls: type[T], ns: argparse.Namespace,
                   environ: Mapping[str, str] | None = None,
                   defaults: DefaultsHook | None = None) -> T:
    """Build the config from parsed flags, falling back to the environment.

    `defaults(given)` (optional) sees the values given by flag or environment and returns
    defaults for other settings (e.g. a task's own defaults): flag > env > hook > dataclass.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for s in settings(cls):
        raw = getattr(ns, s.name, None)
        where = s.flag
        if raw is None and s.env in environ:
            raw, where = environ[s.env], s.env
        if raw is not None:
            values[s.name] = _convert(s.type, raw, where, s.choices)
    if defaults is not None:
        for name, value in defaults(dict(values)).items():
            values.setdefault(name, value)
    try:
        return from_flat(cls, values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def parse_config(cls: type[T], argv: Sequence[str] | None = None, *, prog: str | None = None,
                 description: str | None = None,
                 environ: Mapping[str, str] | None = None,
                 defaults: DefaultsHook | None = None, epilog: str | None = None) -> T:
    """Parse flags (+ environment) into `cls`; a bad value exits 2 with one error line
    (after a one-line usage hint), naming the value; an unknown flag exits 2 the same way,
    with the nearest known flag as a hint."""
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    epilog = ENV_RULE + (f"\n{epilog}" if epilog else "")
    parser = ConfigParser(prog=prog, description=description, epilog=epilog,
                          usage="%(prog)s [-h] [options]", allow_abbrev=False,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_flags(parser, cls)
    ns = parser.parse_args(argv)
    try:
        return from_namespace(cls, ns, environ, defaults)
    except ConfigError as exc:
        parser.error(str(exc))
