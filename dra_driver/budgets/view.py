"""The cluster as the planner sees it: every list the controller reads, and the price table.

Lists are read in pages (``limit``/``continue``, as client-go's pager does) so 10,000 nodes'
reports never come back as one answer above the client's body bound. Each item gets its ``kind``
and ``apiVersion`` back (the API server leaves them out of the items of a built-in list), so an
object the planner hands back can be written as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.decode import fields, load_yaml_documents
from agent.errors import DecodeError
from agent.usage.budget_plan import ClusterView
from agent.usage.prices import PriceTable, price_table
from dra_driver.budgets import api_paths
from dra_driver.cluster.kube import KubeClient
from dra_driver.errors import KubeError, KubeMalformed

PAGE = 500
"""Objects per page: client-go's pager default."""
MAX_PRICES_BYTES = 1024 * 1024


@dataclass(frozen=True)
class PricesRef:
    """The ConfigMap holding the price table (``prices.yaml``); absent: no costs."""

    namespace: str
    name: str
    key: str = "prices.yaml"


class PricesInvalid(DecodeError):
    """The price ConfigMap exists but its table does not parse or validate."""


def list_all(kube: KubeClient, path: str) -> list[dict[str, Any]]:
    """Every object of a collection, page by page; KubeMalformed for an answer without items."""
    kind, api_version = api_paths.KINDS[path]
    out: list[dict[str, Any]] = []
    token = ""
    while True:
        query = {"limit": str(PAGE), **({"continue": token} if token else {})}
        data = kube.request("GET", path, query=query)
        try:
            items = fields.objects(data.get("items"), "items")
        except fields.FieldError as exc:
            raise KubeMalformed(f"a {kind} list: {exc}", "GET", path) from exc
        out += [{"kind": kind, "apiVersion": api_version, **item} for item in items]
        meta = data.get("metadata")
        token = str(meta.get("continue") or "") if isinstance(meta, Mapping) else ""
        if not token:
            return out


def read_prices(kube: KubeClient, ref: PricesRef) -> PriceTable | None:
    """The price table from its ConfigMap; None when the ConfigMap (or its key) is absent.
    PricesInvalid names the ConfigMap, the key and what is wrong."""
    path = api_paths.namespaced(ref.namespace, "configmaps", ref.name)
    try:
        cm = kube.request("GET", path)
    except KubeError as exc:
        if exc.status == 404:
            return None
        raise
    where = f"ConfigMap {ref.namespace}/{ref.name} key {ref.key}"
    data = cm.get("data")
    text = data.get(ref.key) if isinstance(data, Mapping) else None
    if text is None:
        return None
    if not isinstance(text, str):
        raise PricesInvalid(f"{where}: not text")
    try:
        docs = load_yaml_documents(text, where, MAX_PRICES_BYTES)
        if len(docs) != 1:
            raise PricesInvalid(f"{where}: expected one price table, found {len(docs)} documents")
        return price_table(docs[0], "prices")
    except (DecodeError, ValueError) as exc:
        if isinstance(exc, PricesInvalid):
            raise
        raise PricesInvalid(f"{where}: {exc}") from exc


def _holds_claims(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec")
    return isinstance(spec, Mapping) and bool(spec.get("resourceClaims"))


def read_view(kube: KubeClient, prices: PricesRef) -> ClusterView:
    """One consistent-enough read of everything the planner needs (each list is one snapshot;
    the planner is idempotent, so what changed between the lists is seen next time)."""
    return ClusterView(
        reports=list_all(kube, api_paths.REPORTS),
        summaries=list_all(kube, api_paths.SUMMARIES),
        budgets=list_all(kube, api_paths.BUDGETS),
        namespaces=list_all(kube, api_paths.NAMESPACES),
        nodes=frozenset(
            str((n.get("metadata") or {}).get("name", "")) for n in list_all(kube, api_paths.NODES)
        ),
        pods=[p for p in list_all(kube, api_paths.PODS) if _holds_claims(p)],
        claims=list_all(kube, api_paths.CLAIMS),
        prices=read_prices(kube, prices),
    )
