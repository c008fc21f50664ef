"""Opening the node for one-shot commands (discover, topo, slices, explain --simulate)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.config import Config
from agent.errors import ConfigError
from agent.node import NodeSource, discover

if TYPE_CHECKING:
    from agent.discovery.inventory import NodeInventory
    from dra_driver.device_model import DeviceModel


@contextmanager
def node_session(config: Config) -> Iterator[NodeSource]:
    """Open the node for a one-shot command; with --simulate and no --state-dir, use a
    temporary state directory that is removed afterwards."""
    from agent.cli.node_access import open_node

    with tempfile.TemporaryDirectory(prefix="tessera-") as tmp:
        state_dir = config.node.state_dir or (
            Path(tmp) if config.simulator.simulate else Path("/var/lib/tessera")
        )
        source = open_node(config, state_dir)
        with source.nvml:
            yield source


def discover_node(config: Config, source: NodeSource) -> NodeInventory:
    """The node's inventory as the daemon under this Config discovers it: with
    ``--virtualization``, each GPU's VM facts, and a GPU lent to a VM kept from the daemon's
    cache in its state directory (``tessera run``'s default one when none is given)."""
    import logging

    from agent.discovery.vm import vm_discovery

    state_dir = config.node.state_dir
    if state_dir is None and not config.simulator.simulate:
        state_dir = Path("/var/lib/tessera")
    vm = vm_discovery(
        config.driver.virtualization, state_dir, source.nvml, logging.getLogger("tessera.discovery")
    )
    return discover(source, vm)


def advertised(config: Config) -> tuple[str, DeviceModel]:
    """The node's name and the devices the driver would advertise for it (``tessera run`` with
    this Config advertises the same)."""
    with node_session(config) as source:
        inventory = discover_node(config, source)
    return source.hostname, advertise(config, inventory)


def advertise(config: Config, inventory: NodeInventory) -> DeviceModel:
    """The devices the driver advertises for a discovered inventory under this Config."""
    from dra_driver.device_model import advertised_devices, node_mig_profiles, unknown_mig_profiles

    policy = config.driver.device_policy()
    unknown = unknown_mig_profiles(inventory, policy)
    if unknown:  # a one-shot command knows the node: say what it has (the daemon logs it)
        raise ConfigError(
            f"--mig-profiles {','.join(unknown)}: no GPU of this node has it; its MIG profiles"
            f" are {', '.join(node_mig_profiles(inventory)) or 'none (no MIG-capable GPU)'}"
        )
    return advertised_devices(inventory, policy)


def slices_for(config: Config, node_name: str, model: DeviceModel) -> list[dict[str, Any]]:
    """The ResourceSlices the driver publishes for these devices (generation 1)."""
    from dra_driver.advertise.slices import SlicePolicy, build_slices

    policy = SlicePolicy(
        driver_name=config.driver.driver_name,
        node_name=node_name,
        layout=config.driver.kube_layout,
    )
    return build_slices(model, policy, generation=1)


def published_slices(config: Config) -> list[dict[str, Any]]:
    """The ResourceSlices ``tessera run`` with this Config would publish for the node (what
    ``tessera slices`` prints and ``tessera explain --simulate`` allocates from)."""
    node_name, model = advertised(config)
    return slices_for(config, node_name, model)
