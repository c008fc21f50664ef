"""Prometheus instruments without prometheus_client's ``_created`` series.

prometheus_client adds to each counter, histogram and summary a ``<name>_created`` gauge: the
Unix time its series was created. Tessera's metrics (docs/metrics.md) do not include them: no
alert or dashboard reads them, and every labelled series would have a second series beside it.
prometheus_client turns them off only for the whole process (``disable_created_metrics()``, or
``PROMETHEUS_DISABLE_CREATED_SERIES`` read at import): global state, which this project keeps
out, and which would change the exposition of every other registry in the process. Its
maintainers chose the global switch and named filtering per registry as the alternative
(prometheus/client_python#933 and #973). So the instruments live in a registry of their own and
:class:`WithoutCreated` serves that registry's metrics, less the ``_created`` samples, through
the registry that is scraped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

CREATED = "_created"


class WithoutCreated(Collector):
    """The metrics of ``instruments`` (a registry of prometheus_client instruments), each
    without its ``_created`` samples. Register it with the registry that is served."""

    def __init__(self, instruments: CollectorRegistry) -> None:
        self.instruments = instruments

    def collect(self) -> Iterator[Metric]:
        for metric in self.instruments.collect():
            created = metric.name + CREATED
            kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            kept.samples.extend(s for s in metric.samples if s.name != created)
            yield kept

    def describe(self) -> list[Metric]:
        """The metrics as collected now: the served registry checks their names for clashes."""
        return list(self.collect())
