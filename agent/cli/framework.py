"""The command tree behind ``tessera``: commands declare their settings classes, argparse is built
from the declarations, and one place turns every failure into one line and exit code 2.

A :class:`Command` names the settings classes it reads (:class:`Uses`: ``Config`` with some of its
groups, or a command's own options dataclass); :func:`build_parser` adds their options with
:func:`agent.config.add_options`, and :func:`invoke` loads them with
:func:`agent.config.resolve_settings` (flag, then ``TESSERA_<FLAG>``, then the default) before the
handler runs with an :class:`Invocation`. :func:`describe` is the one place that words a failed
command: Tessera's own errors, and the OS errors and friends that escape a command (a file where a
directory belongs, a busy port, an unreadable or undecodable file), naming the path or port and
the flag or variable that gave it. :func:`invoke` writes it as one line on stderr with exit code
2; ``tessera run``, whose stderr is a JSON log, logs the same words as a record.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar, cast

import yaml

from agent.config import Origin, add_options, resolve_settings
from agent.errors import ConfigError, TesseraError
from agent.nvml.errors import DriverNotFoundError

T = TypeVar("T")
EXIT_ERROR = 2
NO_DRIVER_HINT = (
    "no NVIDIA driver found on this machine (libnvidia-ml.so.1 could not be loaded); "
    "to try Tessera without a GPU add --simulate MODEL, e.g. --simulate dgx-h100 "
    "(list models: tessera sim models)"
)
_CHAIN = "_tessera_chain"
_PARSER = "_tessera_parser"


@dataclass(frozen=True)
class Uses:
    """A settings class a command reads; for Config, the groups whose options it offers (None:
    every field)."""

    cls: type[Any]
    groups: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Invocation:
    """One run of a command: its loaded settings and where the given ones came from."""

    values: Mapping[type[Any], Any]
    origins: tuple[Origin, ...]
    out: IO[str]
    err: IO[str]

    def get(self, cls: type[T]) -> T:
        return cast(T, self.values[cls])

    def describe(self, exc: BaseException) -> str | None:
        """The one line for a failure of this command (:func:`describe`)."""
        return describe(exc, self.origins)


Handler = Callable[[Invocation], int]


@dataclass(frozen=True)
class Command:
    """A node of the command tree: a leaf runs ``run``; an inner node has ``subcommands``. Options
    of an inner node (``tessera sim fault --state-dir DIR xid ...``) reach its leaves."""

    name: str
    help: str
    run: Handler | None = None
    uses: tuple[Uses, ...] = ()
    subcommands: tuple[Command, ...] = ()
    description: str | None = None
    metavar: str = "COMMAND"
    """How the usage names the subcommand argument."""
    module: str | None = None
    """A command defined in another module (its ``COMMAND``), imported only when a command line
    names it or the whole tree is walked (:meth:`resolved`): what ``explain``, ``doctor``,
    ``kubelet`` and ``sim`` import is 100 ms of every other command's start. This stub carries
    the name and help the parent lists (a test keeps them equal to the module's)."""

    def resolved(self) -> Command:
        """The command itself: the one in :attr:`module` for a stub, else this one."""
        if self.module is None:
            return self
        return cast(Command, importlib.import_module(self.module).COMMAND)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that writes to the streams it is given instead of sys.stdout/stderr."""

    def __init__(self, *args: Any, streams: tuple[IO[str], IO[str]], **kwargs: Any) -> None:
        self.streams = streams
        super().__init__(*args, **kwargs)

    def _print_message(self, message: str, file: Any = None) -> None:
        if message:
            out, err = self.streams
            (err if file is sys.stderr else out).write(message)


class _Version(argparse.Action):
    """``--version``: asks for the version only when given (finding it imports
    ``importlib.metadata``, 30 to 50 ms of every command's start)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.find: Callable[[], str] = kwargs.pop("find")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any, **__: Any) -> None:
        parser._print_message(f"{parser.prog} {self.find()}\n", sys.stdout)
        parser.exit()


def build_parser(
    root: Command,
    version: Callable[[], str],
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    argv: Sequence[str] | None = None,
) -> Parser:
    """argparse for the tree; parsing leaves the chain of commands in the namespace.
    ``version`` is asked for when ``--version`` is given.

    With ``argv``, only the commands named in it get their options (the others are listed, with
    their help, and cannot be chosen by that argv): every option of every command is about 25 ms
    of each command's start. Without it, the whole tree."""
    streams = (out or sys.stdout, err or sys.stderr)
    parser = Parser(prog=root.name, description=root.description or root.help, streams=streams)
    parser.add_argument("--version", action=_Version, find=version, help="print the version")
    named = None if argv is None else frozenset(argv)
    _populate(parser, root, (root,), streams, named)
    return parser


def _populate(
    parser: Parser,
    command: Command,
    chain: tuple[Command, ...],
    streams: tuple[IO[str], IO[str]],
    named: frozenset[str] | None,
) -> None:
    for use in command.uses:
        add_options(parser, use.cls, use.groups)
    parser.set_defaults(**{_CHAIN: chain, _PARSER: parser})
    if not command.subcommands:
        return
    sub = parser.add_subparsers(
        dest=f"_tessera_{len(chain)}", required=True, metavar=command.metavar, title="commands"
    )
    for child in command.subcommands:
        chosen = named is None or child.name in named
        full = child.resolved() if chosen else child
        child_parser = sub.add_parser(
            child.name,
            help=child.help,
            description=full.description or full.help,
            streams=streams,
        )
        if chosen:
            _populate(child_parser, full, (*chain, full), streams, named)


def invoke(
    parser: Parser,
    argv: Sequence[str] | None,
    environ: Mapping[str, str],
    out: IO[str],
    err: IO[str],
) -> int:
    """Parse, load the settings of the chosen command, run it; every failure is one line on
    ``err`` and exit code 2 (usage errors: the subcommand's usage, then one line)."""
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # the innermost command reached words the error, with its own usage
            getattr(args, _PARSER).error("unrecognized arguments: " + " ".join(extra))
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    chain: tuple[Command, ...] = getattr(args, _CHAIN)
    origins: list[Origin] = []
    try:
        values: dict[type[Any], Any] = {}
        for command in chain:
            for use in command.uses:
                values[use.cls], found = resolve_settings(use.cls, args, environ, use.groups)
                origins += found
        run = chain[-1].run
        assert run is not None, f"{chain[-1].name} has subcommands but no handler"
        return run(Invocation(values, tuple(origins), out, err))
    except BrokenPipeError:
        raise  # the caller decides how a closed output ends
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        message = failure_message(exc, tuple(origins))
        if message is None:
            raise
        err.write(f"tessera: {message}\n")
        return EXIT_ERROR


def failure_message(exc: BaseException, origins: Sequence[Origin] = ()) -> str | None:
    """The line for a failed command (after ``tessera: ``), or None for a bug (which keeps its
    traceback)."""
    reason = describe(exc, origins)
    if reason is None or isinstance(exc, DriverNotFoundError):
        return reason
    return f"{'configuration error' if isinstance(exc, ConfigError) else 'error'}: {reason}"


def describe(exc: BaseException, origins: Sequence[Origin] = ()) -> str | None:
    """What went wrong, in one line naming the offending path, port or value and the flag or
    variable that gave it; None when ``exc`` is a bug rather than a failure to report."""
    if isinstance(exc, DriverNotFoundError):
        return NO_DRIVER_HINT
    if isinstance(exc, TesseraError):
        return _by_source(_one_line(str(exc)), origins)
    if isinstance(exc, OSError):
        return _os_error(exc, origins)
    if isinstance(exc, UnicodeDecodeError):
        return f"a file that should be text is not UTF-8 ({exc.reason} at byte {exc.start})"
    if isinstance(exc, yaml.YAMLError):
        return f"not valid YAML: {_one_line(str(exc))}"
    return None


_LISTEN_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


def _os_error(exc: OSError, origins: Sequence[Origin]) -> str:
    reason = exc.strerror or str(exc)
    if exc.filename is not None:
        name = _text(exc.filename)
        if exc.errno == errno.EEXIST and not Path(name).is_dir():
            reason = "not a directory (a file is in the way)"
        where = f"{name} -> {_text(exc.filename2)}" if exc.filename2 is not None else name
        given = _path_origin(Path(name), origins)
        return f"{where}: {reason}" + (f" (from {given})" if given else "")
    listen = [o for o in origins if o.setting.meta.listen]
    if exc.errno in _LISTEN_ERRORS and listen:
        named = " or ".join(f"{_address(o.value)} (from {o.label})" for o in listen)
        return f"cannot listen on {named}: {reason}"
    return reason


def _address(value: Any) -> str:
    return f"port {value}" if isinstance(value, int) else str(value)


def _text(name: Any) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _path_origin(failed: Path, origins: Sequence[Origin]) -> str | None:
    """The flag or variable whose path the failed path is, is inside, or is a parent of (the
    closest one)."""
    failed = failed.absolute()
    best: tuple[int, str] | None = None
    for o in origins:
        if not isinstance(o.value, Path):
            continue
        given = o.value.absolute()
        if given == failed or given in failed.parents or failed in given.parents:
            distance = abs(len(given.parts) - len(failed.parts))
            if best is None or distance < best[0]:
                best = (distance, o.label)
    return None if best is None else best[1]


def _by_source(message: str, origins: Sequence[Origin]) -> str:
    """Lower layers name a setting by its flag (``--state-dir: cannot create ...``); when its
    value came from a variable, the message names the variable instead."""
    for o in origins:
        if o.label in o.setting.env:
            for flag in o.setting.flags:
                message = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", o.label, message)
    return message


def _one_line(text: str) -> str:
    return " ".join(text.split())
