"""What an expression refers to: the device values it reads through literal paths (for
``Verdict.seen`` and the selector's memo) and the domains it names."""

from __future__ import annotations

import json

from dra_driver.scheduler.cel.syntax import Node


def _string_key(node: Node) -> str | None:
    return node.value if node.kind == "lit" and isinstance(node.value, str) else None


def _device_field(node: Node | None) -> str | None:
    """``attributes``/``capacity``/``driver``/... when node is ``device.<field>``."""
    if node is None or node.kind != "select" or node.target is None:
        return None
    return node.name if node.target.kind == "ident" and node.target.name == "device" else None


def _domain_of(node: Node | None) -> tuple[str, str] | None:
    """(field, domain) when node is ``device.attributes["d"]`` or ``device.capacity["d"]``."""
    if node is not None and node.kind == "index" and node.target is not None:
        field = _device_field(node.target)
        domain = _string_key(node.args[0])
        if field in ("attributes", "capacity") and domain is not None:
            return field, domain
    return None


def references(node: Node, out: dict[str, tuple[str, ...]], domains: set[tuple[str, str]]) -> bool:
    """The device values node refers to: path as written -> lookup key. True when node reads
    the device only through such literal paths (``device.driver``, ``device.attributes["d"].x``,
    ``device.capacity["d"]["x"]``, ``"x" in device.attributes["d"]``): its result is then a
    function of the values at those keys alone. Any other use of ``device`` (a whole map passed
    to a function, a comprehension over it, a computed key) answers False."""
    literal = False
    if node.kind == "op" and node.name == "in" and len(node.args) == 2:
        key, tested = _string_key(node.args[0]), _domain_of(node.args[1])
        if key is not None and tested is not None:
            written = f"{json.dumps(key)} in device.{tested[0]}[{json.dumps(tested[1])}]"
            out.setdefault(written, ("in", *tested, key))
            literal = True
    if node.kind in ("select", "index"):
        field = _device_field(node)
        if field in ("driver", "allowMultipleAllocations"):
            out.setdefault(f"device.{field}", (field,))
            literal = True
        domain = _domain_of(node)
        if domain is not None:
            domains.add(domain)
        outer = _domain_of(node.target)
        name = node.name if node.kind == "select" else _string_key(node.args[0])
        if outer is not None and name is not None:
            field, dom = outer
            written = f"device.{field}[{json.dumps(dom)}]"
            written += f".{name}" if node.kind == "select" else f"[{json.dumps(name)}]"
            out.setdefault(written, (field, dom, name))
            literal = True
    closed = not (node.kind == "ident" and node.name == "device")
    for child in (node.target, *node.args):
        if child is not None:
            closed = references(child, out, domains) and closed  # every child is walked
    # a literal path's own parts (device, device.attributes) are read only through it
    return literal or closed
