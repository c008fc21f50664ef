"""The running agent's device model across dynamic MIG changes (agent/daemon/devices.py): a
prepare that makes or destroys a MIG device re-reads its GPU before it answers (telemetry sees
the device from the next tick), but the devices advertised in dynamic mode are the placements,
which no MIG device changes, so the model is not built again for it."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

import agent.daemon.devices as devices_module
from agent.cli.node_access import node_access, open_node
from agent.config import Config
from agent.daemon import build_agent
from agent.daemon.devices import model_inputs
from agent.discovery.inventory import NodeInventory
from agent.node import discover
from agent.nvml.mig import MigControl
from agent.nvml.types import MemoryInfo
from dra_driver.device_model import DevicePolicy, advertised_devices


def inventory_with_mig(state: Path, model: str) -> tuple[NodeInventory, NodeInventory]:
    """The node read before and after a MIG device is made on GPU 1 (MIG mode switched on
    first where the GPU needs that) and GPU 0's memory is put in use."""
    src = open_node(Config.of(simulate=model), state)
    src.nvml.init()
    try:
        mig = MigControl(src.nvml)
        for i in range(2):
            mig.destroy_all(i)
        before = discover(src)
        mode = mig.mode(1)
        if mode is not None and not mode.current:
            mig.set_mode(1, True)
            before = discover(src)  # the mode is the model's input: only instances differ
        profile = before.gpus[1].device.mig_profiles[0]
        placement = profile.placements[0]
        mig.create(1, profile.profile_id, placement.start, placement.size)
        after = discover(src)
    finally:
        src.nvml.shutdown()
    gpu0 = after.gpus[0]
    total = gpu0.device.memory.total
    busy = replace(gpu0.device, memory=MemoryInfo(total, total // 4, total - total // 4, 1))
    after = replace(after, gpus=(replace(gpu0, device=busy), *after.gpus[1:]))
    assert after.gpus[1].device.mig_instances and not before.gpus[1].device.mig_instances
    return before, after


@pytest.mark.parametrize("model", ["dgx-a100", "dgx-h100"])
def test_the_dynamic_model_reads_neither_mig_devices_nor_memory_in_use(
    tmp_path: Path, model: str
) -> None:
    """What ``model_inputs`` leaves out, the dynamic model does not read: a MIG device made
    and memory in use advertise the same devices, and their inputs compare equal."""
    before, after = inventory_with_mig(tmp_path, model)
    dynamic = DevicePolicy(mig_mode="dynamic")
    assert advertised_devices(after, dynamic) == advertised_devices(before, dynamic)
    assert model_inputs(after, dynamic) == model_inputs(before, dynamic)


def test_the_static_model_reads_mig_devices(tmp_path: Path) -> None:
    """In static mode the MIG devices are what is advertised: they are inputs."""
    before, after = inventory_with_mig(tmp_path, "dgx-h100")
    static = DevicePolicy(mig_mode="static")
    assert advertised_devices(after, static) != advertised_devices(before, static)
    assert model_inputs(after, static) != model_inputs(before, static)


def test_a_dynamic_mig_change_reaches_telemetry_without_building_the_model_again(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = Config.of(
        simulate="dgx-h100", state_dir=short_tmp, no_kube=True, metrics_address="127.0.0.1:0",
        telemetry_interval=60.0, mig_mode="dynamic",
    )  # fmt: skip
    agent = build_agent(cfg, logging.getLogger("tessera.test"), node_access(cfg))
    agent.start()
    try:
        model = agent.node.devices.get()
        builds: list[object] = []

        def counted(inv: NodeInventory, policy: DevicePolicy) -> object:
            builds.append(policy)
            return advertised_devices(inv, policy)

        monkeypatch.setattr(devices_module, "advertised_devices", counted)
        mig = MigControl(agent.source.nvml)
        mig.set_mode(2, True)
        agent.node.mig_changed(2)  # the mode switched: an input of the model, built again
        assert len(builds) == 1
        assert agent.node.devices.get() == model
        mig.create(2, 19, 0, 1)
        agent.node.mig_changed(2)  # a MIG device made: no input of the model
        assert len(builds) == 1
        (gpu2,) = [g for g in agent.telemetry.sampler.gpus if g.index == 2]
        assert [p for _, p in gpu2.mig_profiles] == ["1g.10gb"]
        mig.destroy_all(2)
        agent.node.mig_changed(2)
        assert len(builds) == 1
        (gpu2,) = [g for g in agent.telemetry.sampler.gpus if g.index == 2]
        assert list(gpu2.mig_profiles) == []
        assert agent.node.devices.get() == model
    finally:
        agent.stop()
