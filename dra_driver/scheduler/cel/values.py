"""Quantities and versions as CEL values, the type names of CEL values, how values are
written in messages, and the size bounds of a device (see ``dra_driver.scheduler.celenv``'s
docstring, "Representation")."""

from __future__ import annotations

import json
from typing import Any

from dra_driver.quantity import NANO
from dra_driver.scheduler.cel.semver import Semver

# Size bounds of a device (k8s.io/api resource/v1 types, used by cel/compile.go's estimator).
MAX_ATTRIBUTES = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
MAX_DOMAIN_CHARS = 63  # DeviceMaxDomainLength
MAX_ID_CHARS = 32  # DeviceMaxIDLength
MAX_DRIVER_CHARS = 63  # DriverNameMaxLength
MAX_VALUE_CHARS = 64  # DeviceAttributeMaxValueLength
MAX_LIST_VALUES = 48  # ResourceSliceMaxAttributeValuesPerDevice ('includes' refuses longer)

QUANTITY_TAG = "@quantity"
SEMVER_TAG = "@semver"


def _decimal_text(nanos: int) -> str:
    """The canonical exact decimal of a value in nanos: ``1073741824``, ``0.5``, ``-0.001``."""
    sign = "-" if nanos < 0 else ""
    whole, frac = divmod(abs(nanos), NANO)
    if not frac:
        return f"{sign}{whole}"
    return f"{sign}{whole}.{str(frac).rjust(9, '0').rstrip('0')}"


def quantity_value(nanos: int) -> dict[str, str]:
    return {QUANTITY_TAG: _decimal_text(nanos)}


def semver_value(version: Semver) -> dict[str, str]:
    return {SEMVER_TAG: version.text()}


def type_name(value: Any) -> str:
    if isinstance(value, dict):
        if QUANTITY_TAG in value:
            return "quantity"
        if SEMVER_TAG in value:
            return "semver"
        return "map"
    names = {bool: "bool", int: "int", float: "double", str: "string", bytes: "bytes"}
    return names.get(type(value), "list" if isinstance(value, list) else type(value).__name__)


def no_overload(function: str, *args: Any) -> TypeError:
    kinds = ", ".join(type_name(a) for a in args)
    return TypeError(f"no such overload: {function}({kinds})")


def render(value: Any) -> str:
    """A value as CEL writes it: strings quoted, bools lower case."""
    return json.dumps(value) if isinstance(value, str | bool) else str(value)


def show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
