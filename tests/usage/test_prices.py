"""Price tables and the cost of usage counters (agent/usage/prices.py)."""

from __future__ import annotations

from decimal import Decimal

import pytest
import yaml

from agent.decode.fields import FieldError
from agent.usage.prices import cost, price_table

H100 = "NVIDIA H100 80GB HBM3"
TABLE = yaml.safe_load(
    f"""
currency: EUR
gpuHour:
  - match: {{product: {H100}}}
    price: "2.50"
  - match: {{product: {H100}, migProfile: 1g.10gb}}
    price: "3.00"
  - match: {{deviceClass: gpu-spot.tessera.dev}}
    price: "0.90"
  - price: "1.80"
energy:
  - nodeSelector: {{tessera.dev/pool: reserved}}
    pricePerKWh: "0.08"
  - pricePerKWh: "0.20"
"""
)


def test_the_most_specific_match_prices_a_gpu_hour_and_the_default_the_rest():
    t = price_table(TABLE)
    assert t.gpu_hour_price(H100, None, None) == Decimal("2.50")
    assert t.gpu_hour_price(H100, "1g.10gb", None) == Decimal("3.00")
    assert t.gpu_hour_price(H100, "3g.40gb", None) == Decimal("2.50")
    assert t.gpu_hour_price("NVIDIA L40S", None, "gpu-spot.tessera.dev") == Decimal("0.90")
    assert t.gpu_hour_price("NVIDIA L40S", None, None) == Decimal("1.80")


def test_energy_is_priced_by_the_first_selector_the_nodes_labels_match():
    t = price_table(TABLE)
    assert t.energy_price({"tessera.dev/pool": "reserved", "zone": "a"}) == Decimal("0.08")
    assert t.energy_price({"tessera.dev/pool": "spot"}) == Decimal("0.20")


def test_cost_is_exact_decimal_money_from_the_counters():
    c = cost(
        price_table(TABLE),
        7200.0,  # two weighted GPU-hours
        3_600_000.0,  # one kWh
        product=H100,
        mig_profile=None,
        device_class=None,
        node_labels={},
    )
    assert (c.currency, c.gpu, c.energy, c.total) == (
        "EUR",
        Decimal("5.00"),
        Decimal("0.20"),
        Decimal("5.20"),
    )


def test_a_device_or_node_no_price_matches_has_no_cost_rather_than_a_guess():
    table = price_table({"currency": "USD", "gpuHour": [{"match": {"product": H100}, "price": 2}]})
    c = cost(
        table, 3600.0, 0.0, product="other", mig_profile=None, device_class=None, node_labels={}
    )
    assert c.gpu is None and c.energy is None and c.total is None


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"currency": "euro"}, "prices.currency: must be an ISO 4217 code"),
        ({"currency": None}, "prices.currency: missing"),
        ({"gpuHour": [{"price": "-1"}]}, "prices.gpuHour[0].price: must be a finite amount >= 0"),
        ({"gpuHour": [{"price": "two"}]}, "prices.gpuHour[0].price: expected a decimal string"),
        ({"gpuHour": [{"price": True}]}, "prices.gpuHour[0].price: expected a decimal string"),
        (
            {"gpuHour": [{"price": "1"}, {"price": "2"}]},
            "the default (no match) as prices.gpuHour[0]",
        ),
        ({"gpuHour": [{"match": {"model": "x"}, "price": "1"}]}, "prices.gpuHour[0].match"),
        ({"energy": [{"pricePerKwh": "0.1"}]}, "prices.energy[0]"),
        ({"budget": 3}, "prices"),
    ],
)
def test_a_bad_table_is_refused_naming_the_field_and_the_value(change, words):
    with pytest.raises(FieldError) as caught:
        price_table({**TABLE, **change})
    assert words in str(caught.value)


def test_a_price_written_as_a_number_is_read_through_its_decimal_text():
    table = price_table({"currency": "USD", "gpuHour": [{"price": 0.1}]})
    assert table.gpu_hour_price("any", None, None) == Decimal("0.1")
