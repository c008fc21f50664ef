"""The one place that chooses between this machine and the simulator's stand-in for a node
(``--simulate``): the node a command looks at, the host tree ``tessera doctor`` reads, and what
``tessera run`` hands the daemon's composition root (:class:`agent.daemon.NodeAccess`), so
that the daemon never imports the simulator."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from agent.config import Config
from agent.driverfiles.discover import make_char_device
from agent.hotplug import EventSource, open_udev
from agent.node import NodeSource, real_node

if TYPE_CHECKING:
    from agent.daemon import NodeAccess


def open_node(config: Config, state_dir: Path) -> NodeSource:
    """The node this run looks at: a simulated model with ``--simulate``, else this machine
    (NVML is not initialized yet). The one place that decides."""
    node, sim = config.node, config.simulator
    if sim.simulate:
        from agent.sim.node import simulated_node

        return simulated_node(
            sim.simulate,
            state_dir,
            mig_layout=sim.sim_mig_layout,
            node_name=node.node_name,
            sysfs_root=node.sysfs_root,
            driver_root=node.driver_root,
            proc_root=node.proc_root,
            driver_layout=sim.sim_driver_layout,
            host_driver_root=node.host_driver_root,
        )
    return real_node(
        node_name=node.node_name,
        sysfs_root=node.sysfs_root,
        driver_root=node.driver_root,
        proc_root=node.proc_root,
        host_driver_root=node.host_driver_root,
    )


def open_triggers(config: Config, state_dir: Path, log: logging.Logger) -> EventSource:
    """What tells the agent that GPUs came or went: udev on a real node, the simulator's event
    log with ``--simulate`` (the one place that chooses)."""
    if config.simulator.simulate:
        from agent.sim.udev import SimUdevSource

        return SimUdevSource(state_dir / "sim")
    return open_udev(log)


def node_access(config: Config) -> NodeAccess:
    """What ``tessera run`` hands the composition root about the node: how to open it, where
    its udev events come from, how device nodes are made (the simulator's with --simulate).
    The daemon's modules are imported here, by ``tessera run`` only: the commands that only look
    at the node (discover, slices, topo) start without them (0.2 s of each)."""
    from agent.daemon import NodeAccess

    make_node = make_char_device
    if config.simulator.simulate:
        from agent.sim.driverroot import make_device_node

        make_node = make_device_node
    return NodeAccess(
        open=lambda state_dir: open_node(config, state_dir),
        triggers=lambda state_dir, log: open_triggers(config, state_dir, log),
        make_device_node=make_node,
    )


def host_root(config: Config, state_dir: Path, given: Path | None) -> Path:
    """Where the host's / is seen: ``given`` (``tessera doctor --host-root``), else /, or with
    ``--simulate`` the simulated node's host tree, written under ``<state_dir>/sim/host`` (a
    given one is read as it is, never written)."""
    if given is not None:
        return given
    if config.simulator.simulate is None:
        return Path("/")
    from agent.daemon.paths import simulated_paths
    from agent.sim.hostroot import write_host_root
    from agent.sim.model import load_model

    root = state_dir / "sim" / "host"
    sim = simulated_paths(state_dir)
    write_host_root(
        load_model(config.simulator.simulate),
        root,
        cdi_dirs=[sim.cdi_root],
        kubelet_dirs=[sim.registry_dir, sim.plugins_dir],
    )
    return root
