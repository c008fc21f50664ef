"""Decoding untrusted bytes with limits: JSON and YAML that cannot cost more than they should.

Every file and answer Tessera reads that someone else could have written (state files after a
crash or an edit, standalone claim files, answers of the API server) goes through here first:

- a size limit, checked before parsing;
- integers of at most ``MAX_INT_DIGITS`` digits (Python's own limit of 4300 raises a plain
  ValueError that parsers do not wrap, and no state Tessera writes needs more than 20);
- nesting at most ``MAX_DEPTH`` deep (deeper input would also exhaust the parser's recursion);
- YAML: no aliases (an 800-byte alias bomb expands to gigabytes) and at most ``MAX_YAML_EVENTS``
  parser events.

Anything else becomes :class:`~agent.errors.DecodeError` naming what was read and why; the caller
turns it into its own layer's error (a corrupt checkpoint, a claim that cannot be read, ...).
The result is plain JSON-shaped data (dicts, lists, str, int, float, bool, None); callers then
read the fields they need with :mod:`agent.decode.fields`.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from agent.errors import DecodeError

MAX_DEPTH = 64
MAX_INT_DIGITS = 40
MAX_YAML_EVENTS = 200_000
YamlLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when installed


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-+")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS} allowed)")
    return int(text)


def _finite(text: str) -> float:
    raise ValueError(f"{text} is not a number JSON allows")


def check_depth(value: Any, what: str, max_depth: int = MAX_DEPTH) -> None:
    """Raise DecodeError when ``value`` nests lists/dicts deeper than ``max_depth``."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise DecodeError(f"{what}: nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)


def load_json(data: bytes | str, what: str, max_bytes: int) -> Any:
    """The JSON value in ``data`` within the limits above; DecodeError naming ``what``."""
    if len(data) > max_bytes:
        raise DecodeError(f"{what}: {len(data)} bytes, more than the {max_bytes} allowed")
    try:
        value = json.loads(data, parse_int=_bounded_int, parse_constant=_finite)
    except RecursionError as exc:
        raise DecodeError(f"{what}: nested deeper than the parser can follow") from exc
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, huge integers, NaN
        raise DecodeError(f"{what}: not valid JSON: {exc}") from exc
    check_depth(value, what)
    return value


def load_json_fast(data: bytes, what: str, max_bytes: int) -> Any:
    """``load_json`` through orjson, for answers of hundreds of megabytes (``tessera explain``
    reads every ResourceSlice of a cluster): 1.6x to 2x faster than the json module and no walk
    of the result for its depth (docs/performance.md "explain" has the figures). The limits
    differ in two ways, both harmless for an API server's answers: orjson refuses nesting
    deeper than 1,024 levels (not 64), and reads an integer outside 64 bits as a float instead
    of refusing it (Kubernetes' integers are int64, so a real server sends none; no integer
    can cost quadratic time here either). DecodeError naming ``what`` otherwise."""
    # imported here: every command reads through this module, and the pure-Python gpu-check
    # bundle (bench/gpu_check/bundle.py) carries no compiled packages such as orjson
    import orjson

    if len(data) > max_bytes:
        raise DecodeError(f"{what}: {len(data)} bytes, more than the {max_bytes} allowed")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:  # bad JSON or UTF-8, NaN, nested too deep
        raise DecodeError(f"{what}: not valid JSON: {exc}") from exc


def load_yaml_documents(
    text: str, what: str, max_bytes: int, max_events: int = MAX_YAML_EVENTS
) -> list[Any]:
    """Every document of the YAML stream ``text`` within the limits above (no aliases; at most
    ``max_events`` parser events); DecodeError naming ``what``."""
    if len(text) > max_bytes:
        raise DecodeError(f"{what}: {len(text)} characters, more than the {max_bytes} allowed")
    try:
        for events, event in enumerate(yaml.parse(text, Loader=YamlLoader), start=1):
            if isinstance(event, yaml.AliasEvent):
                raise DecodeError(
                    f"{what}: YAML aliases (*name) are not allowed (line {_line(event)})"
                )
            if events > max_events:
                raise DecodeError(f"{what}: more than {max_events} YAML nodes")
        docs = list(yaml.load_all(text, Loader=_BoundedLoader))
    except RecursionError as exc:
        raise DecodeError(f"{what}: nested deeper than the parser can follow") from exc
    except (yaml.YAMLError, ValueError) as exc:  # bad YAML, huge integers
        raise DecodeError(f"{what}: not valid YAML: {_one_line(str(exc))}") from exc
    for doc in docs:
        check_depth(doc, what)
    return docs


def _line(event: Any) -> int:
    mark = getattr(event, "start_mark", None)
    return int(mark.line) + 1 if mark is not None else 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _BoundedLoader(YamlLoader):  # type: ignore[misc]
    """The safe loader with integers bounded like JSON's (see ``MAX_INT_DIGITS``)."""

    def construct_yaml_int(self, node: Any) -> int:
        value = str(node.value).replace("_", "")
        if len(value.lstrip("-+")) > MAX_INT_DIGITS:
            raise ValueError(
                f"an integer of {len(value)} digits (at most {MAX_INT_DIGITS} allowed), line"
                f" {node.start_mark.line + 1}"
            )
        result: int = super().construct_yaml_int(node)
        return result


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)
