"""`tessera usage`: the node's usage ledger per claim or namespace, with costs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import yaml

from agent.cli import main
from agent.usage.counters import Interval, UsageLedger

H100 = "NVIDIA H100 80GB HBM3"
PRICES = {
    "currency": "EUR",
    "gpuHour": [
        {"match": {"product": H100}, "price": "2.50"},
        {"match": {"product": H100, "migProfile": "1g.10gb"}, "price": "4.00"},
    ],
    "energy": [{"pricePerKWh": "0.20"}],
}


def ledger(state: Path) -> None:
    """Two teams' claims: a whole GPU for 2 h, a 1g.10gb MIG device for 2 h (released)."""
    led = UsageLedger(state / "usage.json", "boot")
    whole = Interval(("u1", "node-a", "gpu-0"), "team-a", "train", "GPU-0", 1.0, "whole-gpu",
                     0.0, 0.5, H100)  # fmt: skip
    mig = Interval(("u2", "node-a", "gpu-1-mig-1g10gb-19-0"), "team-b", "infer", "GPU-1", 0.25,
                   "mig-slices", 0.0, None, H100, "1g.10gb")  # fmt: skip
    led.account(0.0, 0.0, [whole, mig], {})
    led.account(7200.0, 7200.0, [whole._replace(energy_joules=3.6e6), mig], {})
    led.account(7201.0, 0.0, [whole], {})  # the MIG claim is released


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["usage", *args], {}, out, err)
    return code, out.getvalue(), err.getvalue()


def test_each_claim_device_with_its_hours_energy_and_cost(tmp_path: Path):
    ledger(tmp_path)
    (tmp_path / "prices.yaml").write_text(yaml.safe_dump(PRICES))
    code, out, _ = run("--state-dir", str(tmp_path), "--prices", str(tmp_path / "prices.yaml"),
                       "-o", "json")  # fmt: skip
    assert code == 0
    data = json.loads(out)
    assert (data["currency"], data["through"]) == ("EUR", 7201.0)
    rows = {r["claim"]: r for r in data["rows"]}
    assert rows["train"]["gpuHours"] == 2.0 and rows["train"]["busyGpuHours"] == 1.0
    assert rows["train"]["energyKWh"] == 1.0
    assert rows["train"]["cost"] == "5.200"  # 2 GPU-h x 2.50 + 1 kWh x 0.20, exact
    assert rows["infer"]["gpuHours"] == 0.5 and rows["infer"]["unobservedHours"] == 2.0
    assert rows["infer"]["cost"] == "2.000"  # its MIG profile's own price
    assert rows["infer"]["released"] is True


def test_per_namespace_sums_and_a_table_for_people(tmp_path: Path):
    ledger(tmp_path)
    code, out, _ = run("--state-dir", str(tmp_path), "--by", "namespace")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAMESPACE", "CLAIM", "DEVICE", "RULE", "GPU-H", "BUSY-GPU-H",
                                "UNOBS-H", "KWH"]  # fmt: skip
    assert lines[1].split()[:5] == ["team-a", "1", "claims", "1", "devices"]
    assert "2.000" in lines[1] and lines[-1] == "counted up to 1970-01-01T02:00:01Z"


def test_no_ledger_and_a_bad_price_table_are_one_line_each(tmp_path: Path):
    code, _, err = run("--state-dir", str(tmp_path))
    assert code == 2 and "no usage ledger at" in err and err.count("\n") == 1
    ledger(tmp_path)
    (tmp_path / "prices.yaml").write_text(yaml.safe_dump({**PRICES, "currency": "euro"}))
    code, _, err = run("--state-dir", str(tmp_path), "--prices", str(tmp_path / "prices.yaml"))
    assert code == 2 and "prices.currency: must be an ISO 4217 code" in err
