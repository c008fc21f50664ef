"""A device in resource.k8s.io/v1 form (as in a ResourceSlice) converted to its CEL value, with
each value as CEL writes it and the first value the scheduler could not convert; versions and
quantities are converted once per distinct text."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dra_driver.errors import QuantityError
from dra_driver.quantity import parse_quantity
from dra_driver.scheduler.cel.semver import parse_semver
from dra_driver.scheduler.cel.values import quantity_value, render, semver_value, show


@dataclass(frozen=True)
class Converted:
    """A device's CEL value, each value as CEL writes it (for ``Verdict.seen`` and the memo),
    and the first value the scheduler could not convert."""

    value: dict[str, Any]
    rendered: dict[tuple[str, ...], str]
    error: str | None
    attr_domains: frozenset[str]
    cap_domains: frozenset[str]


class DeviceConverter:
    """Converts devices for one environment; remembers the versions and quantities it read."""

    def __init__(self) -> None:
        self._versions: dict[str, dict[str, str]] = {}
        self._quantities: dict[str, dict[str, str]] = {}

    def convert(
        self,
        driver: str,
        attributes: Mapping[str, Mapping[str, Any]],
        capacity: Mapping[str, Mapping[str, Any]],
        allow_multiple_allocations: bool = False,
    ) -> Converted:
        attrs: dict[str, dict[str, Any]] = {}
        caps: dict[str, dict[str, Any]] = {}
        rendered: dict[tuple[str, ...], str] = {
            ("driver",): render(driver),
            ("allowMultipleAllocations",): render(allow_multiple_allocations),
        }
        error: str | None = None
        for name, attribute in attributes.items():
            domain, ident = name.split("/", 1) if "/" in name else (driver, name)
            value: Any
            if "int" in attribute:
                value = shown = attribute["int"]
            elif "bool" in attribute:
                value = shown = attribute["bool"]
            elif "string" in attribute:
                value = shown = attribute["string"]
            elif "version" in attribute:
                shown = attribute["version"]
                try:
                    value = self.version(shown)
                except ValueError as err:
                    error = error or f"attribute {name}: parse semantic version: {err}"
                    continue
            else:
                error = error or (
                    f"attribute {name}: unsupported attribute value {show(dict(attribute))};"
                    " allowed: one of int, bool, string, version"
                )
                continue
            attrs.setdefault(domain, {})[ident] = value
            rendered[("attributes", domain, ident)] = (
                str(shown) if "version" in attribute else render(shown)
            )
        for name, cap in capacity.items():
            domain, ident = name.split("/", 1) if "/" in name else (driver, name)
            text = cap.get("value")
            try:
                caps.setdefault(domain, {})[ident] = self.quantity(text)
            except QuantityError as err:
                error = error or f"capacity {name}: {err}"
                continue
            rendered[("capacity", domain, ident)] = str(text)
        value = {
            "driver": driver,
            "allowMultipleAllocations": allow_multiple_allocations,
            "attributes": attrs,
            "capacity": caps,
        }
        return Converted(value, rendered, error, frozenset(attrs), frozenset(caps))

    def version(self, text: str) -> dict[str, str]:
        """A version attribute's CEL value, converted once per distinct text."""
        value = self._versions.get(text)
        if value is None:
            value = self._versions[text] = semver_value(parse_semver(text))
        return value

    def quantity(self, text: Any) -> dict[str, str]:
        """A capacity's CEL value, converted once per distinct text."""
        value = self._quantities.get(text)
        if value is None:
            value = quantity_value(parse_quantity(text).nanos)
            if isinstance(text, str):
                self._quantities[text] = value
        return value
