"""The side effects of sharing and dynamic MIG (dra_driver.kubeletplugin.effects) on a simulated
node,
through the real tools: the simulated nvidia-smi and nvidia-cuda-mps-control (real subprocesses)
and NVML's MIG calls over the simulator."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.cli.node_access import open_node
from agent.config import Config
from agent.daemon import CurrentDevices, sharing_effects
from agent.node import NodeSource, discover
from agent.nvml.mig import MigControl
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from agent.sim.sharing import COMPUTE_MODE_DEFAULT, COMPUTE_MODE_EXCLUSIVE_PROCESS
from dra_driver.device_model import GIB, DeviceModel, advertised_devices
from dra_driver.errors import SharingError
from dra_driver.kubeletplugin.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimEntry,
    MpsRecord,
    PreparedDevice,
)
from dra_driver.kubeletplugin.claims import AllocatedDevice, Allocation, ClaimKey, OpaqueConfig
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.plan import ClaimPlan, PlannedDevice, SharingPolicy, plan_claim
from tests.simnode import mps_daemons, reap_mps_daemons, sharing

POOL = "node-a"


class Crash(Exception):
    """Stands in for the agent dying at a crash point."""


@dataclass
class Node:
    source: NodeSource
    model: DeviceModel
    state: Path
    crash_at: set[str]
    effects: Effects
    policy: SharingPolicy
    mig_changed: list[int]
    """GPU indexes dynamic MIG said it changed (the agent re-reads them for telemetry), in order."""

    @property
    def sim_dir(self) -> Path:
        return self.state / "sim"

    def gpu(self, index: int) -> Any:
        return sharing(self.sim_dir, self.model_name).gpus[index]

    model_name: str = ""

    def daemons(self) -> list[Any]:
        return mps_daemons(self.sim_dir, self.model_name)

    def mig(self) -> MigControl:
        return MigControl(self.source.nvml)

    def restart(self) -> Node:
        """A new agent over the same node (new tool objects, same state)."""
        return make_node(self.state, self.model_name, self.policy, self.source)


def make_node(
    state: Path,
    model: str,
    policy: SharingPolicy,
    source: NodeSource | None = None,
    mps_root: Path | None = None,
) -> Node:
    config = Config.of(
        simulate=model,
        mig_mode="dynamic" if policy.dynamic_mig else "static",
        sharing=policy.mode,
        mps_ready_timeout=20.0,
        mps_root=mps_root,
    )
    if source is None:
        source = open_node(config, state)
        source.nvml.init()
    devices = CurrentDevices()
    devices.set(advertised_devices(discover(source), config.driver.device_policy()))
    crash_at: set[str] = set()

    def crash(point: str) -> None:
        if point in crash_at:
            raise Crash(point)

    mig_changed: list[int] = []
    effects = sharing_effects(
        config, source, state, devices, logging.getLogger("test"), crash, mig_changed.append
    )
    return Node(
        source, devices.get(), state, crash_at, effects, policy, mig_changed, model_name=model
    )


@pytest.fixture
def h100(tmp_path: Path) -> Iterator[Node]:
    node = make_node(tmp_path, "dgx-h100", SharingPolicy(mode="time-slicing", dynamic_mig=True))
    yield node
    reap_mps_daemons(node.sim_dir, "dgx-h100")
    node.source.nvml.shutdown()


@pytest.fixture
def shares(tmp_path: Path) -> Iterator[Node]:
    node = make_node(tmp_path, "dgx-h100", SharingPolicy(mode="memory-shares"))
    yield node
    reap_mps_daemons(node.sim_dir, "dgx-h100")
    node.source.nvml.shutdown()


def config(kind: str, strategy: str, **fields: Any) -> dict[str, Any]:
    sharing_: dict[str, Any] = {"strategy": strategy}
    if fields:
        sharing_["timeSlicing" if strategy == "TimeSlicing" else "mps"] = fields
    return {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": kind, "sharing": sharing_}


def plan(
    node: Node,
    uid: str,
    *devices: str,
    cfg: dict[str, Any] | None = None,
    consumed: int | None = None,
) -> tuple[ClaimKey, ClaimPlan]:
    key = ClaimKey("ns", uid, uid)
    allocation = Allocation(
        claim=key,
        devices=tuple(
            AllocatedDevice("gpu", "gpu.tessera.dev", POOL, d, consumed_memory=consumed)
            for d in devices
        ),
        configs=(OpaqueConfig("FromClaim", (), cfg),) if cfg else (),
    )
    return key, plan_claim(allocation, node.model, node.policy)


def record(p: PlannedDevice) -> PreparedDevice:
    d = p.device
    placement = None
    if p.dynamic:
        placement = (d.mig_profile_id or 0, d.mig_placement_start or 0, d.mig_placement_size or 0)
    return PreparedDevice(
        request_names=("gpu",),
        pool=POOL,
        device=d.name,
        cdi_device_ids=(),
        kind=d.kind,
        gpu_uuid=d.parent_uuid,
        gpu_minor=d.gpu_minor,
        mig_uuid=d.uuid if d.kind == "mig" else None,
        placement=placement,
        sharing=p.sharing,
        interval=p.interval,
        memory_bytes=p.memory_bytes,
    )


class Saved:
    """The progress apply records (what the preparer commits as PrepareStarted)."""

    def __init__(self) -> None:
        self.devices: tuple[PreparedDevice, ...] = ()
        self.mps: MpsRecord | None = None

    def __call__(self, devices: tuple[PreparedDevice, ...], mps: MpsRecord | None) -> None:
        self.devices, self.mps = devices, mps


def apply(node: Node, key: ClaimKey, claim_plan: ClaimPlan) -> ClaimEntry:
    records = tuple(record(p) for p in claim_plan.devices)
    applied = node.effects.apply(key, claim_plan, records, Saved())
    return ClaimEntry(
        key.uid, key.namespace, key.name, PREPARE_COMPLETED, applied.devices, 0.0, mps=applied.mps
    )


def checkpoint(*entries: ClaimEntry) -> Checkpoint:
    return Checkpoint("boot", {e.uid: e for e in entries})


def placement_device(node: Node, gpu: int, profile: str, start: int) -> str:
    return next(
        d.name
        for d in node.model.devices
        if d.kind == "mig"
        and d.gpu_minor == gpu
        and dict(d.attributes)["profile"]["string"] == profile
        and d.mig_placement_start == start
    )


# -- time-slicing ------------------------------------------------------------------------------


def test_time_slicing_sets_the_interval_until_the_last_sharer_leaves(h100):
    a_key, a_plan = plan(
        h100, "a", "gpu-0", cfg=config("GpuConfig", "TimeSlicing", interval="Long")
    )
    b_key, b_plan = plan(
        h100, "b", "gpu-0", cfg=config("GpuConfig", "TimeSlicing", interval="Long")
    )
    a, b = apply(h100, a_key, a_plan), apply(h100, b_key, b_plan)
    gpu = h100.gpu(0)
    assert (gpu.timeslice, gpu.compute_mode) == (3, COMPUTE_MODE_DEFAULT)
    h100.effects.undo(a, checkpoint(a, b))
    assert h100.gpu(0).timeslice == 3  # b still time-slices it
    h100.effects.undo(b, checkpoint(b))
    assert h100.gpu(0).timeslice == 0
    assert h100.gpu(1).timeslice == 0  # other GPUs never touched


def test_restore_sets_a_time_slice_changed_behind_the_agents_back(h100):
    key, p = plan(h100, "a", "gpu-2", cfg=config("GpuConfig", "TimeSlicing", interval="Short"))
    entry = apply(h100, key, p)
    h100.effects.settings.timeslice(h100.model.device("gpu-2").parent_uuid, "Default")  # type: ignore[union-attr]
    assert h100.gpu(2).timeslice == 0
    assert h100.restart().effects.restore(entry) == entry
    assert h100.gpu(2).timeslice == 1


# -- MPS ---------------------------------------------------------------------------------------


def test_an_mps_claim_gets_its_daemon_with_its_limits_and_gives_it_back(h100):
    key, p = plan(
        h100,
        "a",
        "gpu-0",
        "gpu-1",
        cfg=config(
            "GpuConfig",
            "MPS",
            activeThreadPercentage=30,
            pinnedMemoryLimit="2Gi",
            perDevicePinnedMemoryLimit={"gpu-1": "3Gi"},
        ),
    )
    entry = apply(h100, key, p)
    assert entry.mps is not None
    (daemon,) = h100.daemons()
    uuids = [h100.model.device(n).parent_uuid for n in ("gpu-0", "gpu-1")]
    assert daemon.pid == entry.mps.pid and list(daemon.devices) == uuids
    assert daemon.active_thread_percentage == 30
    assert dict(daemon.pinned_mem_limits) == {uuids[0]: 2048, uuids[1]: 3072}
    assert Path(entry.mps.pipe_dir).is_dir() and Path(entry.mps.shm_dir).is_dir()
    # a claim alone on its GPUs: one process (the MPS server) per GPU
    assert [h100.gpu(i).compute_mode for i in (0, 1)] == [COMPUTE_MODE_EXCLUSIVE_PROCESS] * 2
    h100.effects.undo(entry, checkpoint(entry))
    assert h100.daemons() == []
    assert not Path(entry.mps.pipe_dir).exists()
    assert [h100.gpu(i).compute_mode for i in (0, 1)] == [COMPUTE_MODE_DEFAULT] * 2


def test_an_mps_root_too_long_for_a_socket_fails_the_claim_saying_so(tmp_path, caplog):
    root = tmp_path / ("m" * 60)
    with caplog.at_level(logging.WARNING):
        node = make_node(tmp_path, "dgx-h100", SharingPolicy(mode="time-slicing"), mps_root=root)
    try:
        # the agent warns at start, before any claim
        assert any("MPS claims will fail" in r.getMessage() for r in caplog.records)
        key, p = plan(
            node, "3f0e6a52-9d1c-4b7e-8a65-0c2d9e4f1a7b", "gpu-0", cfg=config("GpuConfig", "MPS")
        )
        with pytest.raises(SharingError, match=r"--mps-root .* at most \d+ bytes long"):
            apply(node, key, p)
        assert node.daemons() == [] and not root.exists()
    finally:
        reap_mps_daemons(node.sim_dir, "dgx-h100")
        node.source.nvml.shutdown()


def test_an_mps_daemon_that_still_runs_is_adopted_and_a_dead_one_started_again(h100):
    key, p = plan(h100, "a", "gpu-3", cfg=config("GpuConfig", "MPS"))
    entry = apply(h100, key, p)
    assert entry.mps is not None
    again = h100.restart()
    assert again.effects.restore(entry) == entry  # same PID and start time: adopted
    reap_mps_daemons(h100.sim_dir, "dgx-h100")  # the daemon died with the node's agent
    restored = again.effects.restore(entry)
    assert restored.mps is not None and restored.mps.pid != entry.mps.pid
    (daemon,) = h100.daemons()
    assert daemon.pid == restored.mps.pid and list(daemon.devices) == list(entry.mps.devices)


def test_memory_shares_run_one_daemon_per_claim_side_by_side(shares):
    a_key, a_plan = plan(shares, "a", "gpu-0", consumed=8 * GIB)
    b_key, b_plan = plan(shares, "b", "gpu-0", consumed=16 * GIB)
    a, b = apply(shares, a_key, a_plan), apply(shares, b_key, b_plan)
    daemons = {d.pid: d for d in shares.daemons()}
    assert a.mps is not None and b.mps is not None and set(daemons) == {a.mps.pid, b.mps.pid}
    uuid = shares.model.device("gpu-0").parent_uuid
    assert dict(daemons[a.mps.pid].pinned_mem_limits) == {uuid: 8 * 1024}
    assert dict(daemons[b.mps.pid].pinned_mem_limits) == {uuid: 16 * 1024}
    # several claims' MPS servers on one GPU: the GPU must take several processes
    assert shares.gpu(0).compute_mode == COMPUTE_MODE_DEFAULT
    shares.effects.undo(a, checkpoint(a, b))
    assert [d.pid for d in shares.daemons()] == [b.mps.pid]


def test_a_daemon_left_by_a_crash_before_its_record_is_stopped_by_the_sweep(h100):
    key, p = plan(h100, "a", "gpu-4", cfg=config("GpuConfig", "MPS"))
    h100.crash_at.add("after-mps-start")
    with pytest.raises(Crash):
        apply(h100, key, p)
    assert len(h100.daemons()) == 1
    h100.restart().effects.sweep(checkpoint())  # no claim owns it
    assert h100.daemons() == []
    assert not (h100.state / "mps" / "a").exists()


def test_undo_finds_a_daemon_its_record_does_not_name(h100):
    """A prepare that crashed after the daemon started and before it was recorded: the retry's
    rollback stops the daemon by its directory."""
    key, p = plan(h100, "a", "gpu-5", cfg=config("GpuConfig", "MPS"))
    h100.crash_at.add("after-mps-start")
    with pytest.raises(Crash):
        apply(h100, key, p)
    started = ClaimEntry("a", "ns", "a", PREPARE_STARTED, tuple(record(x) for x in p.devices), 0.0)
    h100.restart().effects.undo(started, checkpoint())
    assert h100.daemons() == []


# -- dynamic MIG -------------------------------------------------------------------------------


def test_a_placement_is_created_where_allocated_and_destroyed_after(h100):
    name = placement_device(h100, 0, "2g.20gb", 2)
    key, p = plan(h100, "a", name)
    entry = apply(h100, key, p)
    (dev,) = entry.devices
    (inst,) = h100.mig().gpu_instances(0)
    assert (inst.profile_id, inst.placement.start) == (dev.placement[0], 2)  # type: ignore[index]
    assert dev.gpu_instance_id == inst.gpu_instance_id
    (mig_device,) = h100.source.nvml.mig_instances(0)  # what discovery and telemetry see
    assert dev.mig_uuid == mig_device.uuid and dev.compute_instance_id == 0
    assert h100.mig_changed == [0]  # told once the device is made, before apply returns
    h100.effects.undo(entry, checkpoint(entry))
    assert h100.mig().gpu_instances(0) == ()
    assert h100.mig_changed == [0, 0]
    h100.effects.undo(entry, checkpoint(entry))  # nothing left to destroy: nothing to tell
    assert h100.mig_changed == [0, 0]


@pytest.mark.parametrize("point", ["after-gi-create", "after-ci-create"])
def test_a_placement_half_made_by_a_crash_is_finished_or_swept(h100, point):
    name = placement_device(h100, 1, "1g.10gb", 3)
    key, p = plan(h100, "a", name)
    h100.crash_at.add(point)
    with pytest.raises(Crash):
        apply(h100, key, p)
    assert len(h100.mig().gpu_instances(1)) == 1
    retry = h100.restart()
    entry = apply(retry, key, p)  # the retry adopts what the crash left
    assert [g.gpu_instance_id for g in retry.mig().gpu_instances(1)] == [
        entry.devices[0].gpu_instance_id
    ]
    assert retry.mig().compute_instances(1, entry.devices[0].gpu_instance_id or 0)
    retry.effects.sweep(checkpoint(entry))  # owned: kept
    assert len(retry.mig().gpu_instances(1)) == 1
    retry.effects.sweep(checkpoint())  # owned by no claim: destroyed
    assert retry.mig().gpu_instances(1) == ()
    # told of what changed the GPU: the half-made device (even as its make failed), the compute
    # instance the retry made where the crash left none, the sweep's destroy
    assert h100.mig_changed == [1]
    assert retry.mig_changed == ([1, 1] if point == "after-gi-create" else [1])


def test_restore_makes_a_lost_placement_again_and_its_mps_daemon_serves_the_new_one(h100):
    """An unprepare that crashed after undoing and before releasing the record: at the next
    start the claim is still prepared, so its MIG device and daemon are made again."""
    name = placement_device(h100, 2, "3g.40gb", 4)
    key, p = plan(h100, "a", name, cfg=config("MigDeviceConfig", "MPS", pinnedMemoryLimit="1Gi"))
    entry = apply(h100, key, p)
    assert entry.mps is not None
    h100.effects.undo(entry, checkpoint(entry))
    assert h100.mig().gpu_instances(2) == () and h100.daemons() == []
    restored = h100.restart().effects.restore(entry)
    (inst,) = h100.source.nvml.mig_instances(2)
    (dev,) = restored.devices
    assert (dev.mig_uuid, dev.gpu_instance_id) == (inst.uuid, inst.gpu_instance_id)
    assert restored.mps is not None and restored.mps.devices == (inst.uuid,)
    (daemon,) = h100.daemons()
    assert daemon.pid == restored.mps.pid and daemon.devices == (inst.uuid,)
    assert dict(daemon.pinned_mem_limits) == {inst.uuid: 1024}


def test_a_whole_gpu_is_refused_while_mig_instances_live_on_it(h100):
    mig = h100.mig()  # someone else made a MIG device on a GPU the agent hands out whole
    assert mig.set_mode(6, True)
    mig.create(6, 19, 0, 1)
    key, p = plan(h100, "a", "gpu-6")
    with pytest.raises(SharingError, match="GPU 6 still has MIG instances") as e:
        apply(h100, key, p)
    assert e.value.reason == "mig_in_use"


def test_a_hopper_gpu_leaves_mig_mode_for_a_whole_gpu_claim(h100):
    name = placement_device(h100, 7, "1g.10gb", 0)
    key, p = plan(h100, "a", name)
    entry = apply(h100, key, p)
    mode = h100.source.nvml.mig_mode(7)
    assert mode is not None and mode.current  # turned on for the placement, at once on Hopper
    h100.effects.undo(entry, checkpoint(entry))
    key, whole = plan(h100, "b", "gpu-7")
    apply(h100, key, whole)
    mode = h100.source.nvml.mig_mode(7)
    assert mode is not None and not mode.current
    assert h100.mig_changed == [7, 7, 7]  # made, destroyed, MIG mode off


def test_an_ampere_gpu_out_of_mig_mode_refuses_a_placement(tmp_path):
    node = make_node(tmp_path, "dgx-a100", SharingPolicy(dynamic_mig=True))
    try:
        # the node advertised GPU 0's placements (it was in MIG mode); since, MIG mode was
        # turned off and the GPU reset: turning it on again needs another reset
        mig = MigControl(node.source.nvml)
        mig.destroy_all(0)
        assert mig.set_mode(0, False) is False  # pending until a reset
        FakeNvml(load_model("dgx-a100"), node.sim_dir).reset_gpu(0)
        name = next(d.name for d in node.model.devices if d.kind == "mig" and d.gpu_minor == 0)
        key, p = plan(node, "a", name)
        with pytest.raises(SharingError, match="needs a GPU reset on Ampere GPUs") as e:
            apply(node, key, p)
        assert e.value.reason == "mig_reset_required"
        assert mig.gpu_instances(0) == ()
    finally:
        node.source.nvml.shutdown()
