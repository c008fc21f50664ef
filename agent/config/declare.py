"""Declaring settings: a settings class is a frozen dataclass whose fields are declared with
:func:`setting` (flag(s), help, default or :data:`REQUIRED`, how one raw string becomes a value:
from the field's type, ``choices`` or ``parse``), or are groups of such settings (a field whose
type is another settings dataclass, as :class:`agent.config.agent_config.Config` is made of). From
the declarations, :func:`settings_of` lists every setting resolved (:class:`Setting`: flags,
variables, converter) and :func:`build_settings` builds a class from values by setting name."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from agent.config.converters import boolean, integer, path, seconds, text

ENV_PREFIX = "TESSERA_"
REQUIRED: Any = MISSING
"""The default of a setting that must be given (by its flag or its variable)."""

T = TypeVar("T")


@dataclass(frozen=True)
class SettingMeta:
    """How one field is set from the command line and the environment."""

    help: str
    groups: tuple[str, ...]
    """For Config: the option groups carrying it: ``node`` (commands that look at a node),
    ``driver`` (commands that compute what the driver advertises), ``daemon`` (only `run`).
    Command options ignore it: a command exposes all of its own options."""
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    extra_env: tuple[str, ...] = ()
    """Further environment variables honoured after ``TESSERA_<FLAG>`` (e.g. ``NODE_NAME``)."""
    flags: tuple[str, ...] = ()
    """Option strings; unset: ``--<field-name>`` with dashes. The variable is named after the
    last (long) one: ``("-o", "--output")`` -> ``TESSERA_OUTPUT``."""
    parse: Callable[[str], Any] | None = None
    """Turns one raw string into the value; a ValueError's message says what is wrong, as a
    phrase that follows the value (``is not a positive whole number``). Unset: from the type."""
    listen: bool = False
    """The value is an address or port the command listens on (named when it is busy)."""
    positional: bool = False
    """Given as the command's argument (``tessera explain CLAIM.yaml``), not as a flag; its one
    ``flags`` entry is how usage and errors name it (``CLAIM``); the variable is named after it
    (``TESSERA_CLAIM``)."""


def setting(
    default: Any,
    help: str,
    *,
    groups: tuple[str, ...] = ("node",),
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    extra_env: tuple[str, ...] = (),
    flags: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
    listen: bool = False,
    positional: bool = False,
) -> Any:
    """A settings field: ``name: type = setting(default, help, ...)``. Supported types: ``str``,
    ``int``, ``float`` (seconds > 0 unless ``parse`` says otherwise), ``bool`` (a switch),
    ``Path``, ``X | None``, and ``tuple[X, ...]`` (a repeatable option; comma-separated in a
    variable)."""
    meta = SettingMeta(help, groups, choices, metavar, extra_env, flags, parse, listen, positional)
    return field(default=default, metadata={"tessera": meta})


@dataclass(frozen=True)
class Setting:
    """One declared setting, resolved: its flags, variables and converter."""

    name: str
    meta: SettingMeta
    default: Any
    """None when unset; :data:`REQUIRED` when it must be given."""
    kind: Literal["switch", "value", "list"]
    convert: Callable[[str], Any]
    """One raw string (one item of a list) -> value; ValueError("<phrase>")."""
    section: str = ""
    """The group of Config it belongs to (``http``, ``telemetry``, ...); empty: none."""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def flags(self) -> tuple[str, ...]:
        return self.meta.flags or (flag_name(self.name),)

    @property
    def label(self) -> str:
        """``-o/--output``: how errors and docs name the option."""
        return "/".join(self.flags)

    @property
    def env(self) -> tuple[str, ...]:
        """``TESSERA_<FLAG>`` then the extra variables, in the order they are honoured."""
        own = ENV_PREFIX + self.flags[-1].lstrip("-").replace("-", "_").upper()
        return (own, *self.meta.extra_env)

    @property
    def metavar(self) -> str:
        if self.meta.choices:
            return "{" + ",".join(self.meta.choices) + "}"
        return self.meta.metavar or self.flags[-1].lstrip("-").replace("-", "_").upper()

    def in_groups(self, groups: Collection[str] | None) -> bool:
        return groups is None or bool(set(self.meta.groups) & set(groups))


@dataclass(frozen=True)
class Origin:
    """Where a setting's value came from: ``label`` is the flag (``--state-dir``) or the
    variable (``TESSERA_STATE_DIR``) that gave it."""

    setting: Setting
    label: str
    value: Any


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _base_converter(kind: Any) -> Callable[[str], Any]:
    by_type: dict[Any, Callable[[str], Any]] = {
        str: text,
        int: integer,
        float: seconds,  # every float setting so far is a duration; others pass parse=
        bool: boolean,
        Path: path,
    }
    if kind not in by_type:
        raise TypeError(f"unsupported setting type {kind!r}")
    return by_type[kind]


def is_section(f: Field[Any]) -> bool:
    """A field that holds a group of settings (a settings dataclass of its own), not a setting."""
    return "tessera" not in f.metadata


def _hints(cls: type[Any]) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, once per class: it evaluates every annotation's string
    (``from __future__ import annotations``) each time, and a start asks for each settings
    class's a dozen times (tens of milliseconds of ``tessera run``'s start). A class's hints do not
    change after it is defined."""
    return _class_hints(cast(Hashable, cls))


@functools.cache
def _class_hints(cls: Hashable) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def settings_of(cls: type[Any]) -> tuple[Setting, ...]:
    """Every setting of a settings dataclass, in declaration order; the settings of a group
    (a field whose type is itself a settings dataclass: ``Config.http``) in its place, named by
    their own field names, which are unique across the groups."""
    hints = _hints(cls)
    out: list[Setting] = []
    for f in fields(cls):
        if is_section(f):
            out += [
                dataclasses.replace(s, section=s.section or f.name)
                for s in settings_of(hints[f.name])
            ]
            continue
        meta: SettingMeta = f.metadata["tessera"]
        kind_: Literal["switch", "value", "list"] = "value"
        hint = hints[f.name]
        if isinstance(hint, types.UnionType):  # X | None
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if typing.get_origin(hint) is tuple:
            kind_, hint = "list", typing.get_args(hint)[0]
        elif hint is bool:
            kind_ = "switch"
        convert = meta.parse or _base_converter(hint)
        if meta.choices is not None:
            convert = _choice(meta.choices, convert)
        out.append(Setting(f.name, meta, f.default, kind_, convert))
    names = [s.name for s in out]
    if len(names) != len(set(names)):
        raise TypeError(f"{cls.__qualname__}: a setting name is used twice")
    return tuple(out)


def sections_of(cls: type[Any]) -> list[tuple[str, type[Any]]]:
    """The groups of a settings dataclass, ``(field name, settings class)``, in order."""
    hints = _hints(cls)
    return [(f.name, hints[f.name]) for f in fields(cls) if is_section(f)]


def build_settings(cls: type[T], values: Mapping[str, Any]) -> T:
    """``cls`` from values by setting name (its groups' settings among them: the groups are
    built from theirs); what is not given keeps its default. An unknown name is a TypeError."""
    unknown = set(values) - {s.name for s in settings_of(cls)}
    if unknown:
        raise TypeError(f"{cls.__qualname__} has no setting {', '.join(sorted(unknown))}")
    return _build(cls, values)


def _build(cls: type[T], values: Mapping[str, Any]) -> T:
    hints = _hints(cls)
    given = {
        f.name: _build(hints[f.name], values) if is_section(f) else values[f.name]
        for f in fields(cls)  # type: ignore[arg-type]
        if is_section(f) or f.name in values
    }
    return cls(**given)


def _choice(choices: tuple[str, ...], then: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        if raw not in choices:
            raise ValueError("is not one of " + ", ".join(choices))
        return then(raw)

    return convert
