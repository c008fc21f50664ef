"""``tessera usage``: the usage this node has counted for each claim (or namespace), from the usage
ledger in the state directory (``<state-dir>/usage.json``, docs/budgets.md), with its cost under a
price table when one is given. It reads the file only: no NVML, no running agent needed; the
figures are those written by the agent (at most ``--usage-write-interval`` behind it).
"""

from __future__ import annotations

import datetime
import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from agent.cli.framework import EXIT_ERROR, Command, Invocation, Uses
from agent.cli.usage_cluster import (
    ClaimRow,
    ClusterRow,
    claim_rows,
    cluster_rows,
    describe,
    time_range,
)
from agent.config import Config, setting
from agent.decode import load_yaml_documents
from agent.errors import ConfigError, DecodeError
from agent.usage.counters import Counters, HoldingKey, decode
from agent.usage.prices import PriceTable, cost, price_table
from dra_driver.errors import KubeError

DEFAULT_STATE_DIR = Path("/var/lib/tessera")
MAX_PRICES_BYTES = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class UsageOptions:
    by: str | None = setting(
        None,
        "One row per claim device (the default), or per namespace (the sums of its claims)."
        " With --cluster: per namespace and DeviceClass (the default), or per claim (over whole"
        " UTC days; no cost per claim: the record keeps none).",
        choices=("claim", "namespace"),
    )
    prices: Path | None = setting(
        None,
        "A price table (YAML or JSON, docs/budgets.md): adds each row's cost.",
        metavar="FILE",
    )
    node_labels: tuple[str, ...] = setting(
        (),
        "The node's labels as KEY=VALUE, for the price table's energy prices (nodeSelector).",
        metavar="KEY=VALUE",
    )
    output: str = setting(
        "table",
        "Output format: table (for people), json or yaml (for scripts).",
        flags=("-o", "--output"),
        choices=("table", "json", "yaml"),
    )
    cluster: bool = setting(
        False,
        "Read the cluster's record (GpuUsageSummaries and the GpuUsageReports not yet folded)"
        " instead of this node's ledger (--node-labels does not apply: each node's labels come"
        " from the record).",
    )
    kubeconfig: Path | None = setting(
        None,
        "With --cluster: the API server to read (default: the in-cluster service account).",
        metavar="FILE",
    )
    since: str | None = setting(
        None,
        "With --cluster: from this day (yyyy-mm-dd, midnight in --time-zone) or RFC 3339 time;"
        " rounded down to 15 minutes (default: all that is recorded).",
        metavar="WHEN",
    )
    until: str | None = setting(
        None,
        "With --cluster: up to this day or time, exclusive (default: now).",
        metavar="WHEN",
    )
    period: str = setting(
        "range",
        "With --cluster: month (the calendar month holding now, in --time-zone) or range"
        " (--since/--until).",
        choices=("range", "month"),
    )
    time_zone: str = setting(
        "UTC",
        "With --cluster: the IANA time zone of --period month and of days in --since/--until.",
        metavar="ZONE",
    )


@dataclass(frozen=True)
class Row:
    namespace: str
    claim: str
    device: str
    mig_profile: str | None
    rule: str
    gpu_hours: float
    busy_gpu_hours: float
    unobserved_hours: float
    energy_kwh: float
    cost: Decimal | None
    released: bool


def cmd_usage(inv: Invocation) -> int:
    config, opts = inv.get(Config), inv.get(UsageOptions)
    if opts.cluster:
        return _cluster(inv, opts)
    path = (config.node.state_dir or DEFAULT_STATE_DIR) / "usage.json"
    try:
        _, through, _, counters = decode(path.read_bytes())
        table = None if opts.prices is None else _prices(opts.prices)
        labels = _labels(opts.node_labels)
    except FileNotFoundError:
        inv.err.write(
            f"tessera: error: no usage ledger at {path}: no agent has counted usage in this"
            " state directory (--state-dir)\n"
        )
        return EXIT_ERROR
    except (OSError, DecodeError, ValueError) as exc:
        inv.err.write(f"tessera: error: {exc}\n")
        return EXIT_ERROR
    rows = [_row(key, c, table, labels) for key, c in sorted(counters.items())]
    if opts.by == "namespace":
        rows = _by_namespace(rows)  # else (claim, the default) one row per claim device
    currency = None if table is None else table.currency
    if opts.output == "table":
        inv.out.write(_table(rows, currency, through))
        return 0
    data = {
        "through": through,
        "currency": currency,
        "rows": [_json(r) for r in rows],
    }
    if opts.output == "json":
        inv.out.write(json.dumps(data, indent=2) + "\n")
    else:
        inv.out.write(yaml.safe_dump(data, sort_keys=False))
    return 0


def _cluster(inv: Invocation, opts: UsageOptions) -> int:
    now = datetime.datetime.now(datetime.UTC)
    try:
        table = None if opts.prices is None else _prices(opts.prices)
        start, end = time_range(
            opts.since or "", opts.until or "", opts.period, opts.time_zone, now
        )
        from dra_driver.cluster.kube import KubeClient  # the client loads only in cluster mode

        kube = KubeClient.from_config(opts.kubeconfig)
        try:

            def request(method: str, path: str, query: Mapping[str, str]) -> dict[str, Any]:
                return kube.request(method, path, query)

            if opts.by == "claim":
                text = render_claims(claim_rows(request, start, end), start, end, opts.output)
            else:
                rows = cluster_rows(request, start, end, table)
                text = render_cluster(rows, table, start, end, opts.output)
        finally:
            kube.close()
    except (OSError, DecodeError, ValueError, ConfigError, KubeError) as exc:
        inv.err.write(f"tessera: error: {exc}\n")
        return EXIT_ERROR
    inv.out.write(text)
    return 0


def render_claims(
    rows: list[ClaimRow],
    start: datetime.datetime | None,
    end: datetime.datetime | None,
    output: str,
) -> str:
    """The cluster's per-claim rows as a table, JSON or YAML."""
    if output == "table":
        lines = [["NAMESPACE", "CLAIM", "DEVICECLASS", "GPU-H", "KWH"]]
        for r in rows:
            lines.append([r.namespace, r.claim or r.claim_uid, r.device_class or "-",
                          f"{r.gpu_hours:.3f}", f"{r.energy_kwh:.3f}"])  # fmt: skip
        return f"{_columns(lines)}\n{describe(start, end)}\n"
    data = {
        "since": None if start is None else start.isoformat(),
        "until": None if end is None else end.isoformat(),
        "rows": [
            {
                "namespace": r.namespace,
                "claim": r.claim,
                "claimUID": r.claim_uid,
                "deviceClass": r.device_class,
                "gpuHours": str(r.gpu_hours.quantize(Decimal("0.000001"))),
                "energyKWh": str(r.energy_kwh.quantize(Decimal("0.000001"))),
            }
            for r in rows
        ],
    }
    if output == "json":
        return json.dumps(data, indent=2) + "\n"
    return str(yaml.safe_dump(data, sort_keys=False))


def _columns(lines: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in lines
    )


def render_cluster(
    rows: list[ClusterRow],
    table: PriceTable | None,
    start: datetime.datetime | None,
    end: datetime.datetime | None,
    output: str,
) -> str:
    """The cluster's rows as a table, JSON or YAML (amounts as decimal strings: exact)."""
    currency = None if table is None else table.currency
    if output == "table":
        head = ["NAMESPACE", "DEVICECLASS", "GPU-H", "KWH"]
        if currency is not None:
            head.append(f"COST ({currency})")
        lines = [head]
        for r in rows:
            line = [r.namespace, r.device_class or "-", f"{r.gpu_hours:.3f}", f"{r.energy_kwh:.3f}"]
            if currency is not None:
                line.append("-" if r.cost is None else f"{r.cost:.2f}")
            lines.append(line)
        text = _columns(lines)
        return f"{text}\n{describe(start, end)}\n"
    data = {
        "since": None if start is None else start.isoformat(),
        "until": None if end is None else end.isoformat(),
        "currency": currency,
        "rows": [
            {
                "namespace": r.namespace,
                "deviceClass": r.device_class,
                "gpuHours": str(r.gpu_hours.quantize(Decimal("0.000001"))),
                "energyKWh": str(r.energy_kwh.quantize(Decimal("0.000001"))),
                "cost": None if r.cost is None else str(r.cost),
            }
            for r in rows
        ],
    }
    if output == "json":
        return json.dumps(data, indent=2) + "\n"
    return str(yaml.safe_dump(data, sort_keys=False))


def _prices(path: Path) -> PriceTable:
    raw = path.read_bytes()
    if len(raw) > MAX_PRICES_BYTES:
        raise DecodeError(f"{path}: {len(raw)} bytes, more than the {MAX_PRICES_BYTES} allowed")
    docs = load_yaml_documents(raw.decode("utf-8", "replace"), str(path), MAX_PRICES_BYTES)
    if len(docs) != 1:
        raise DecodeError(f"{path}: expected one price table, found {len(docs)} documents")
    return price_table(docs[0], "prices")


def _labels(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--node-labels {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _row(key: HoldingKey, c: Counters, table: PriceTable | None, labels: dict[str, str]) -> Row:
    priced = None
    if table is not None:
        priced = cost(
            table,
            c.allocated_gpu_seconds,
            c.energy_joules,
            product=c.product,
            mig_profile=c.mig_profile,
            device_class=None,  # not known on the node: entries that name one match no row here
            node_labels=labels,
        ).total
    return Row(
        c.namespace,
        c.claim,
        key[2],
        c.mig_profile,
        c.rule,
        c.allocated_gpu_seconds / 3600,
        c.busy_gpu_seconds / 3600,
        c.unobserved_seconds / 3600,
        c.energy_joules / 3.6e6,
        priced,
        c.released_at is not None,
    )


def _by_namespace(rows: list[Row]) -> list[Row]:
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        groups[r.namespace].append(r)
    out = []
    for ns, members in sorted(groups.items()):
        costs = [m.cost for m in members if m.cost is not None]
        priced = len(costs) == len(members)
        out.append(
            Row(
                ns,
                f"{len({m.claim for m in members})} claims",
                f"{len(members)} devices",
                None,
                "",
                sum(m.gpu_hours for m in members),
                sum(m.busy_gpu_hours for m in members),
                sum(m.unobserved_hours for m in members),
                sum(m.energy_kwh for m in members),
                sum(costs, Decimal(0)) if priced else None,
                all(m.released for m in members),
            )
        )
    return out


def _json(r: Row) -> dict[str, Any]:
    return {
        "namespace": r.namespace,
        "claim": r.claim,
        "device": r.device,
        "migProfile": r.mig_profile,
        "rule": r.rule,
        "gpuHours": r.gpu_hours,
        "busyGpuHours": r.busy_gpu_hours,
        "unobservedHours": r.unobserved_hours,
        "energyKWh": r.energy_kwh,
        "cost": None if r.cost is None else str(r.cost),  # a string: exact
        "released": r.released,
    }


def _table(rows: list[Row], currency: str | None, through: float | None) -> str:
    head = ["NAMESPACE", "CLAIM", "DEVICE", "RULE", "GPU-H", "BUSY-GPU-H", "UNOBS-H", "KWH"]
    if currency is not None:
        head.append(f"COST ({currency})")
    lines = [head]
    for r in rows:
        line = [
            r.namespace or "-",
            r.claim + (" (released)" if r.released else ""),
            r.device,
            r.rule or "-",
            f"{r.gpu_hours:.3f}",
            f"{r.busy_gpu_hours:.3f}",
            f"{r.unobserved_hours:.3f}",
            f"{r.energy_kwh:.3f}",
        ]
        if currency is not None:
            line.append("-" if r.cost is None else f"{r.cost:.2f}")
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    text = "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in lines
    )
    if through is None:
        note = "no usage counted yet"
    else:
        at = datetime.datetime.fromtimestamp(through, datetime.UTC)
        note = f"counted up to {at.strftime('%Y-%m-%dT%H:%M:%SZ')}"
    return f"{text}\n{note}\n"


COMMAND = Command(
    "usage",
    "GPU-hours, energy and cost this node has counted per claim or namespace",
    cmd_usage,
    (Uses(Config, ("node",)), Uses(UsageOptions)),
    description="The usage this node's agent has counted (the usage ledger in --state-dir,"
    " docs/budgets.md): allocated and busy GPU-hours, unobserved hours and energy for each"
    " claim device, or summed per namespace (--by namespace); with --prices, each row's cost."
    " Reads the file only: works while the agent runs, and after it stopped. With --cluster,"
    " the cluster's usage per namespace and DeviceClass over --since/--until or --period"
    " month, from its GpuUsageSummaries and GpuUsageReports (the budget controller's sums).",
)
