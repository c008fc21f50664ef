"""Test helpers for a simulated node's state: what the simulated driver holds now (MIG
instances, compute modes, time-slices, MPS daemons), read the way the simulated tools read it,
and the MPS daemons a test must not leave running."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from pathlib import Path

from agent.nvml.facade import Nvml
from agent.nvml.types import MigInstance
from agent.sim.model import NodeModel, load_model
from agent.sim.nvml import FakeNvml
from agent.sim.sharing import MpsDaemon, SharingState, SharingStore, live_daemons, start_ticks


@functools.cache
def node_model(name: str) -> NodeModel:
    """A simulated node model, parsed once per test process."""
    return load_model(name)


def sharing(sim_dir: Path, model: str) -> SharingState:
    """The simulated node's sharing state (compute modes, time-slices, MPS daemons)."""
    return SharingStore(sim_dir, node_model(model)).read()


def mps_daemons(sim_dir: Path, model: str) -> list[MpsDaemon]:
    """The simulated MPS control daemons that still run."""
    return live_daemons(sharing(sim_dir, model))


def reap_mps_daemons(sim_dir: Path, model: str) -> int:
    """SIGKILL every simulated MPS daemon of the node that still runs (test teardown: they are
    real, daemonized processes); how many there were."""
    if not (sim_dir / "sharing-state.json").exists():
        return 0
    daemons = mps_daemons(sim_dir, model)
    for d in daemons:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(start_ticks(d.pid) == d.start_ticks for d in daemons):  # until they are gone
        if time.monotonic() > deadline:
            raise AssertionError(f"MPS daemons {[d.pid for d in daemons]} did not die")
        time.sleep(0.01)
    return len(daemons)


def mig_instances(sim_dir: Path, model: str, index: int) -> tuple[MigInstance, ...]:
    """The MIG devices of GPU ``index`` now, as NVML reports them."""
    nvml = Nvml(FakeNvml(node_model(model), sim_dir))
    nvml.init()
    try:
        return nvml.mig_instances(index)
    finally:
        nvml.shutdown()
