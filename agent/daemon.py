"""The daemon's wiring and lifecycle: the only place that constructs the object graph.

``build_agent`` is the composition root: it turns a Config into a ready-to-start ``Agent`` with
every dependency passed in explicitly. ``Agent.start``/``stop`` bring the loops up and down in
order; ``run`` blocks until asked to stop (SIGINT/SIGTERM in the CLI).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from agent.config import Config
from agent.discovery.inventory import NodeInventory
from agent.http import HttpEndpoint, Readiness
from agent.logs import fields_
from agent.node import NodeSource, discover, open_node

DEFAULT_STATE_DIR = Path("/var/lib/tessera")


@dataclass
class Agent:
    config: Config
    source: NodeSource
    state_dir: Path
    http: HttpEndpoint
    readiness: Readiness
    log: logging.Logger
    inventory: NodeInventory | None = None

    def start(self) -> None:
        """Initialize NVML, discover the node, then open the HTTP endpoint."""
        self.source.nvml.init()
        self.inventory = discover(self.source)
        self._log_inventory(self.inventory)
        inventory_ok = self.inventory is not None
        self.readiness.add("inventory", lambda: (inventory_ok, "node discovered"))
        self.http.start()
        host, port = self.http.address
        self.log.info(
            "agent started",
            extra=fields_(
                node=self.source.hostname,
                simulated=self.source.model,
                healthz=f"http://{host}:{port}/healthz",
                state_dir=str(self.state_dir),
            ),
        )

    def stop(self) -> None:
        """Stop in reverse order of start; safe to call more than once."""
        self.http.stop()
        self.source.nvml.shutdown()
        self.log.info("agent stopped")

    def run(self, stop: threading.Event) -> None:
        self.start()
        try:
            stop.wait()
        finally:
            self.stop()

    def _log_inventory(self, inv: NodeInventory) -> None:
        for g in inv.gpus:
            d = g.device
            self.log.info(
                "discovered GPU",
                extra=fields_(
                    gpu=d.index,
                    uuid=d.uuid,
                    model=d.name,
                    pci_bus_id=g.pcie.bus_id,
                    numa_node=g.pcie.numa_node,
                    pcie_root=g.pcie.pcie_root,
                    nvlink_clique=g.nvlink_clique,
                    mig_enabled=d.mig_enabled,
                    mig_devices=len(d.mig_instances),
                    near_nics=",".join(g.near_nics),
                ),
            )
        self.log.info(
            "node inventory",
            extra=fields_(
                node=inv.hostname,
                gpus=len(inv.gpus),
                nics=len(inv.nics),
                numa_nodes=len(inv.numa_nodes),
                nvlink_cliques=len(inv.nvlink_cliques),
                driver_version=inv.system.driver_version,
                cuda_driver_version=inv.system.cuda_driver_version,
            ),
        )


def build_agent(config: Config, log: logging.Logger) -> Agent:
    """Compose the agent from its configuration. Creates the state directory; starts nothing."""
    state_dir = config.state_dir or DEFAULT_STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    source = open_node(config, state_dir)
    readiness = Readiness()
    host, port = config.metrics_host_port()
    http = HttpEndpoint(host, port, readiness)
    return Agent(
        config=config,
        source=source,
        state_dir=state_dir,
        http=http,
        readiness=readiness,
        log=log,
    )
