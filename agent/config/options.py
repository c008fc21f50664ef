"""Settings from the command line and the environment: :func:`add_options` adds a settings
class's options to an argparse parser (argparse only collects raw strings: no ``type``,
``choices`` or ``required``; converting and checking is done once, here), and
:func:`load_settings` builds the class from the parsed flags and an environment mapping: a flag
wins over ``TESSERA_<FLAG>``, which wins over extra variables (``NODE_NAME``), which win over the
default. A bad value is a :class:`ConfigError` that names where it came from: the variable
(``TESSERA_OUTPUT='xml' is not one of table, json, yaml``) or the flag (``-o/--output: ...``).

Nothing below the CLI reads ``os.environ``: the CLI passes the environment in."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

from agent.config.declare import Origin, Setting, build_settings, settings_of
from agent.errors import ConfigError

T = TypeVar("T")


def dest(cls: type[Any], name: str) -> str:
    """The argparse destination of a setting: unique per class, so classes never collide."""
    return f"{cls.__qualname__}.{name}"


def option_help(s: Setting) -> str:
    parts = [s.meta.help.rstrip()]
    if s.required:
        parts.append("Required.")
    elif s.default is not None and s.kind != "switch":
        parts.append(f"Default: {s.default}.")
    env = ", ".join(s.env)
    parts.append(f"Env: {env}=true." if s.kind == "switch" else f"Env: {env}.")
    return " ".join(parts).replace("%", "%%")


def add_options(
    parser: argparse.ArgumentParser, cls: type[Any], groups: Collection[str] | None = None
) -> None:
    """Add the options of ``cls`` (of the given groups; None: all) to an argparse parser. argparse
    only collects raw strings; :func:`load_settings` converts and checks them."""
    for s in settings_of(cls):
        if not s.in_groups(groups):
            continue
        if s.meta.positional:
            parser.add_argument(
                dest(cls, s.name), nargs="?", default=None, metavar=s.flags[0],
                help=option_help(s),
            )  # fmt: skip
            continue
        if s.kind == "switch":
            parser.add_argument(
                *s.flags, dest=dest(cls, s.name), default=None, action="store_true",
                help=option_help(s),
            )  # fmt: skip
            continue
        parser.add_argument(
            *s.flags,
            dest=dest(cls, s.name),
            default=None,
            action="append" if s.kind == "list" else "store",
            metavar=s.metavar,
            help=option_help(s),
        )


def _convert(s: Setting, raw: Any, label: str, from_env: bool) -> Any:
    where = f"{label}=" if from_env else f"{label}: "
    if s.kind == "switch" and not from_env:
        return bool(raw)
    items: list[str]
    if s.kind == "list":
        items = [i.strip() for i in raw.split(",")] if from_env else list(raw)
    else:
        items = [raw]
    values = []
    for item in items:
        item = item if isinstance(item, str) else str(item)
        try:
            values.append(s.convert(item))
        except ValueError as exc:
            raise ConfigError(f"{where}{item!r} {exc}") from None
    return tuple(values) if s.kind == "list" else values[0]


def resolve_settings(
    cls: type[T],
    args: argparse.Namespace | Mapping[str, Any] | None,
    environ: Mapping[str, str] | None,
    groups: Collection[str] | None = None,
) -> tuple[T, tuple[Origin, ...]]:
    """:func:`load_settings`, and where each given value came from."""
    if isinstance(args, argparse.Namespace):
        given = {s.name: getattr(args, dest(cls, s.name), None) for s in settings_of(cls)}
    else:
        given = dict(args or {})
    env = environ or {}
    values: dict[str, Any] = {}
    origins: list[Origin] = []
    for s in settings_of(cls):
        if not s.in_groups(groups):
            continue
        raw = given.get(s.name)
        label, from_env = s.label, False
        if raw is None or raw == []:
            raw = None
            for var in s.env:
                if env.get(var):
                    raw, label, from_env = env[var], var, True
                    break
        if raw is None:
            if s.required:
                give = s.flags[0] if s.meta.positional else f"{s.flags[-1]} {s.metavar}"
                raise ConfigError(f"{s.label} is required: give {give} or set {s.env[0]}")
            continue
        values[s.name] = _convert(s, raw, label, from_env)
        origins.append(Origin(s, label, values[s.name]))
    return build_settings(cls, values), tuple(origins)


def load_settings(
    cls: type[T],
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    groups: Collection[str] | None = None,
) -> T:
    """Build a settings class from parsed flags (an argparse Namespace filled by
    :func:`add_options`, or a mapping by field name) and an environment mapping; settings
    outside ``groups`` keep their defaults. Pure: reads only what it is given."""
    return resolve_settings(cls, args, environ, groups)[0]
