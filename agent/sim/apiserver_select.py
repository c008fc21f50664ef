"""Field and label selectors, parsed and matched like the real API server does.

Field selectors: comma-separated ``field=value``, ``field==value``, ``field!=value`` terms (all must
hold); backslash escapes ``\\,``, ``\\=`` and ``\\\\`` in values. A field the resource does not
support is an error (the real server answers 400).

Label selectors: ``key=v``, ``key==v``, ``key!=v``, ``key in (a,b)``, ``key notin (a,b)``, ``key``
(exists) and ``!key`` (does not exist), comma-separated, all must hold.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

#: Selectable fields whose value is a bool the real server renders as "false" when unset.
_BOOL_FIELDS = frozenset({"spec.unschedulable", "spec.hostNetwork"})


class SelectorError(ValueError):
    """A selector that does not parse, or names a field the resource does not support."""


@dataclass(frozen=True)
class FieldTerm:
    field: str
    equal: bool  # False for !=
    value: str


@dataclass(frozen=True)
class LabelTerm:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str]


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            cur.append(text[i : i + 2])
            i += 2
            continue
        if c == sep:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def _unescape(value: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(value):
        if value[i] == "\\" and i + 1 < len(value):
            if value[i + 1] not in "\\,=":
                raise SelectorError(f"invalid escape sequence in field selector value: {value!r}")
            out.append(value[i + 1])
            i += 2
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def _find_operator(term: str) -> tuple[int, str] | None:
    i = 0
    while i < len(term):
        if term[i] == "\\":
            i += 2
            continue
        for op in ("!=", "==", "="):
            if term.startswith(op, i):
                return i, op
        i += 1
    return None


def parse_fields(text: str, allowed: Collection[str], what: str | None) -> list[FieldTerm]:
    """Parse a field selector; ``allowed`` lists the fields of the resource.

    ``what`` (``resource.k8s.io/v1, Kind=ResourceSlice``) names a resource with a field-label
    conversion of its own; None means the default one (``metadata.name``/``metadata.namespace``).
    """
    terms: list[FieldTerm] = []
    if not text.strip():
        return terms
    for raw in _split_unescaped(text, ","):
        term = raw.strip()
        if not term:
            continue
        found = _find_operator(term)
        if found is None:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{term}'")
        at, op = found
        name = term[:at].strip()
        if name not in allowed:
            if what is None:
                raise SelectorError(
                    f'"{name}" is not a known field selector: only "metadata.name",'
                    ' "metadata.namespace"'
                )
            raise SelectorError(f"field label not supported for {what}: {name}")
        terms.append(FieldTerm(name, op != "!=", _unescape(term[at + len(op) :])))
    return terms


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The string value of the dotted ``path`` in ``obj`` ("" when unset)."""
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, Mapping) else None
    if isinstance(cur, bool):
        return "true" if cur else "false"
    if cur is None:
        return "false" if path in _BOOL_FIELDS else ""
    return str(cur)


def fields_match(terms: list[FieldTerm], obj: Mapping[str, Any]) -> bool:
    return all((field_value(obj, t.field) == t.value) == t.equal for t in terms)


_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET_TERM = re.compile(rf"^({_KEY})\s+(in|notin)\s*\((.*)\)$")
_EQ_TERM = re.compile(rf"^({_KEY})\s*(==|!=|=)\s*(.*)$")
_KEY_RX = re.compile(rf"^{_KEY}$")
_VALUE_RX = re.compile(rf"^{_VALUE}$")


def _split_labels(text: str) -> list[str]:
    parts: list[str] = []
    depth, start = 0, 0
    for i, c in enumerate(text):
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _check_value(value: str, text: str) -> str:
    if len(value) > 63 or not _VALUE_RX.match(value):
        raise SelectorError(
            f"unable to parse requirement: invalid label value: {value!r} in {text!r}"
        )
    return value


def parse_labels(text: str) -> list[LabelTerm]:
    """Parse a label selector."""
    terms: list[LabelTerm] = []
    if not text.strip():
        return terms
    for raw in _split_labels(text):
        term = raw.strip()
        if not term:
            raise SelectorError(f"found '', expected: identifier in {text!r}")
        m = _SET_TERM.match(term)
        if m:
            values = [_check_value(v.strip(), text) for v in m.group(4).split(",")]
            terms.append(LabelTerm(m.group(1), m.group(3), frozenset(values)))
            continue
        m = _EQ_TERM.match(term)
        if m:
            op = "=" if m.group(3) == "==" else m.group(3)
            terms.append(
                LabelTerm(m.group(1), op, frozenset({_check_value(m.group(4).strip(), text)}))
            )
            continue
        if term.startswith("!") and _KEY_RX.match(term[1:].strip()):
            terms.append(LabelTerm(term[1:].strip(), "!", frozenset()))
            continue
        if _KEY_RX.match(term):
            terms.append(LabelTerm(term, "exists", frozenset()))
            continue
        raise SelectorError(f"unable to parse requirement: {term!r}")
    return terms


def labels_match(terms: list[LabelTerm], labels: Mapping[str, str] | None) -> bool:
    labels = labels or {}
    for t in terms:
        present = t.key in labels
        value = labels.get(t.key)
        ok = {
            "=": present and value in t.values,
            "in": present and value in t.values,
            "!=": not present or value not in t.values,
            "notin": not present or value not in t.values,
            "exists": present,
            "!": not present,
        }[t.op]
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Selection:
    """Which objects of a resource a list or watch asks for."""

    namespace: str | None = None
    fields: tuple[FieldTerm, ...] = ()
    labels: tuple[LabelTerm, ...] = ()

    def matches(self, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return fields_match(list(self.fields), obj) and labels_match(
            list(self.labels), meta.get("labels")
        )
