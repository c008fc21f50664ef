"""The ``devices.config`` of an allocation, as upstream's ``Allocate`` copies it ("Populate
configs", structured/internal/incubating/allocator_incubating.go): each selected class's configs
once, with the requests that use it, then the claim's own that apply. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dra_driver.scheduler.domain import Claim, DeviceClass


def _selected_names(claim: Claim, selected: Mapping[int, int]) -> list[tuple[str, str, str]]:
    """Per request: (request name, selected name, class name)."""
    out = []
    for gi, group in enumerate(claim.requests):
        alt = group.alternatives[selected.get(gi, 0)]
        out.append((group.name, alt.full_name, alt.class_name))
    return out


def allocation_config(
    claim: Claim, selected: Mapping[int, int], classes: Mapping[str, DeviceClass]
) -> list[dict[str, Any]]:
    """The configs upstream copies (Allocate, "Populate configs"): each class's once, with
    the requests that use it; then the claim's that apply; an entry naming every request
    names none."""
    config: list[dict[str, Any]] = []
    by_class: dict[str, list[dict[str, Any]]] = {}
    names = _selected_names(claim, selected)
    for _, name, cls_name in names:
        if cls_name in by_class:
            for entry in by_class[cls_name]:
                entry["requests"].append(name)
            continue
        cls = classes.get(cls_name)
        entries = [
            {
                "source": "FromClass",
                "requests": [name],
                **{k: v for k, v in c.items() if k != "requests"},
            }
            for c in (cls.config if cls else ())
        ]
        by_class[cls_name] = entries
        config.extend(entries)
    for requests, raw in claim.config:
        applies = not requests or any(
            base in requests or full in requests for base, full, _ in names
        )
        if applies:
            config.append(
                {
                    "source": "FromClaim",
                    **({"requests": list(requests)} if requests else {}),
                    **{k: v for k, v in raw.items() if k != "requests"},
                }
            )
    for entry in config:
        listed = entry.get("requests")
        if listed and all(base in listed or full in listed for base, full, _ in names):
            del entry["requests"]
    return config
