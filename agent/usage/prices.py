"""Prices: what a GPU-hour and a kWh cost, and the cost of usage counters (pure).

A price table (YAML or JSON; in the cluster it will be the ``prices.yaml`` key of a ConfigMap)::

    currency: EUR                    # ISO 4217, three capital letters
    gpuHour:                         # per weighted GPU-hour (docs/budgets.md)
      - match: {product: NVIDIA H100 80GB HBM3}
        price: "2.50"
      - match: {product: NVIDIA H100 80GB HBM3, migProfile: 1g.10gb}
        price: "3.00"                # small slices may cost more per GPU-hour
      - match: {deviceClass: gpu-spot.tessera.dev}
        price: "0.90"
      - price: "1.80"                # no match: the default
    energy:                          # per kWh, by the node's labels
      - nodeSelector: {tessera.dev/pool: reserved}
        pricePerKWh: "0.08"
      - pricePerKWh: "0.20"

**Matching.** A device's GPU-hour price is the entry whose ``match`` names the most of its
``product``, ``migProfile`` and ``deviceClass``, all equal; among equally specific entries the
first listed; an entry without ``match`` (at most one) matches every device. The energy price is
the first entry whose ``nodeSelector`` labels all equal the node's, else the one without a
selector. A device no entry matches has no price: its cost is None, never a guess.

**Money is exact.** Prices are decimal strings (numbers are accepted and read through their
decimal text, so ``0.1`` is 0.1); costs are ``Decimal``, rounded only where they are shown. Cost
is derived from the usage counters every time it is asked for and never stored: a price change
re-prices the whole period, as a price table is the price of the period it is applied to.

Every field is checked (types, signs, unknown fields, the currency's form, one default per
list, no two entries with the same ``match``); a table that fails names the field and the value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from agent.decode import fields

CURRENCY = re.compile(r"^[A-Z]{3}$")
MATCH_KEYS = ("product", "migProfile", "deviceClass")
JOULES_PER_KWH = Decimal(3_600_000)
SECONDS_PER_HOUR = Decimal(3600)
MAX_ENTRIES = 1000


@dataclass(frozen=True)
class GpuHourPrice:
    match: tuple[tuple[str, str], ...]
    """(key, value) pairs, each of ``MATCH_KEYS``; empty: the default."""
    price: Decimal


@dataclass(frozen=True)
class EnergyPrice:
    node_selector: tuple[tuple[str, str], ...]
    """(label, value) pairs; empty: the default."""
    price_per_kwh: Decimal


@dataclass(frozen=True)
class PriceTable:
    currency: str
    gpu_hour: tuple[GpuHourPrice, ...]
    energy: tuple[EnergyPrice, ...]

    def gpu_hour_price(
        self, product: str, mig_profile: str | None, device_class: str | None
    ) -> Decimal | None:
        """The price of a weighted GPU-hour of this device; None when nothing matches."""
        mine = {"product": product, "migProfile": mig_profile, "deviceClass": device_class}
        best: GpuHourPrice | None = None
        for entry in self.gpu_hour:
            matches = all(mine.get(k) == v for k, v in entry.match)
            if matches and (best is None or len(entry.match) > len(best.match)):
                best = entry
        return None if best is None else best.price

    def energy_price(self, node_labels: Mapping[str, str]) -> Decimal | None:
        """The price of a kWh on a node with these labels; None when nothing matches."""
        default = None
        for entry in self.energy:
            if not entry.node_selector:
                default = entry.price_per_kwh if default is None else default
            elif all(node_labels.get(k) == v for k, v in entry.node_selector):
                return entry.price_per_kwh
        return default


@dataclass(frozen=True)
class Cost:
    currency: str
    gpu: Decimal | None
    """Allocated GPU-hours x their price; None when no price matches the device."""
    energy: Decimal | None
    """kWh x their price; None when no price matches the node."""

    @property
    def total(self) -> Decimal | None:
        """Both parts; None when either has no price (a partial sum would read as the cost)."""
        if self.gpu is None or self.energy is None:
            return None
        return self.gpu + self.energy


def cost(
    table: PriceTable,
    allocated_gpu_seconds: float,
    energy_joules: float,
    *,
    product: str,
    mig_profile: str | None,
    device_class: str | None,
    node_labels: Mapping[str, str],
) -> Cost:
    """The cost of one device's counters under ``table`` (pure)."""
    gpu_price = table.gpu_hour_price(product, mig_profile, device_class)
    kwh_price = table.energy_price(node_labels)
    hours = Decimal(repr(allocated_gpu_seconds)) / SECONDS_PER_HOUR
    kwh = Decimal(repr(energy_joules)) / JOULES_PER_KWH
    return Cost(
        table.currency,
        None if gpu_price is None else hours * gpu_price,
        None if kwh_price is None else kwh * kwh_price,
    )


# -- reading a table --------------------------------------------------------------------------


def price_table(value: object, path: str = "prices") -> PriceTable:
    """A price table from its decoded YAML or JSON; raises a FieldError (a ValueError) naming
    the field and the value on anything else."""
    obj = fields.obj(value, path)
    fields.check_known(obj, path, ("currency", "gpuHour", "energy"))
    currency = fields.text(obj.get("currency"), f"{path}.currency")
    if not CURRENCY.fullmatch(currency):
        raise fields.FieldError(
            f"{path}.currency",
            f"must be an ISO 4217 code (three capital letters), got {currency!r}",
        )
    gpu = _gpu_entries(obj.get("gpuHour"), f"{path}.gpuHour")
    energy = _energy_entries(obj.get("energy"), f"{path}.energy")
    return PriceTable(currency, gpu, energy)


def _entries(
    value: object, path: str, key: str, price: str, allowed_keys: Sequence[str] | None
) -> list[tuple[tuple[tuple[str, str], ...], Decimal]]:
    """The (``key``'s pairs, ``price``) of each entry of a list: at most ``MAX_ENTRIES``, no two
    with the same pairs (so at most one default, the entry without ``key``)."""
    entries = fields.objects(value, path)
    if len(entries) > MAX_ENTRIES:
        raise fields.FieldError(path, f"{len(entries)} entries, at most {MAX_ENTRIES} allowed")
    out: list[tuple[tuple[tuple[str, str], ...], Decimal]] = []
    seen: dict[tuple[tuple[str, str], ...], int] = {}
    for i, e in enumerate(entries):
        p = f"{path}[{i}]"
        fields.check_known(e, p, (key, price))
        pairs = _pairs(e.get(key), f"{p}.{key}", allowed_keys)
        if pairs in seen:
            what = f"the default (no {key})" if not pairs else f"the same {key}"
            raise fields.FieldError(p, f"{what} as {path}[{seen[pairs]}]")
        seen[pairs] = i
        out.append((pairs, _money(e.get(price), f"{p}.{price}")))
    return out


def _gpu_entries(value: object, path: str) -> tuple[GpuHourPrice, ...]:
    return tuple(GpuHourPrice(m, v) for m, v in _entries(value, path, "match", "price", MATCH_KEYS))


def _energy_entries(value: object, path: str) -> tuple[EnergyPrice, ...]:
    return tuple(
        EnergyPrice(m, v) for m, v in _entries(value, path, "nodeSelector", "pricePerKWh", None)
    )


def _pairs(value: object, path: str, allowed: Sequence[str] | None) -> tuple[tuple[str, str], ...]:
    obj = fields.obj(value, path, optional=True)
    if allowed is not None:
        fields.check_known(obj, path, allowed)
    pairs = tuple(sorted((str(k), fields.text(v, fields.at(path, str(k)))) for k, v in obj.items()))
    return pairs


def _money(value: object, path: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise fields.expected('a decimal string such as "2.50"', value, path)
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise fields.expected('a decimal string such as "2.50"', value, path) from None
    if not amount.is_finite() or amount < 0:
        raise fields.FieldError(path, f"must be a finite amount >= 0, got {value!r}")
    return amount
