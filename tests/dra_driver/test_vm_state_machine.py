"""Random sequences of prepare, unprepare, restarts and crashes at every point, mixing container
claims, GPUs handed to VMs and vGPUs (SR-IOV and mdev) on one hand-built node (tests/vmnode.py):
after every step the node (each function's driver and override, the vGPUs) is what the
checkpoint says, the checkpoint holds exactly the claims prepared, and a GPU never serves a VM
and containers at once."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from dra_driver.device_model import DeviceModel
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.crash_points import CRASH_POINTS
from tests.vmnode import MODEL, Agent, Claims, Crash, Node, advertised, expected

UNPREPARE_POINTS = tuple(p for p in CRASH_POINTS if p.startswith("after-unprepare-"))
PREPARE_POINTS = tuple(p for p in CRASH_POINTS if p not in UNPREPARE_POINTS)
NODE_MODEL = DeviceModel(
    (
        *MODEL.devices,
        advertised("gpu-1", "gpu", 1, "GPU-1"),
        replace(
            advertised("gpu-0-mig", "mig", 0, "GPU-0"),
            uuid="MIG-0",
            gpu_instance_id=1,
            compute_instance_id=0,
        ),
    ),
    (),
)
CLAIMS = {
    "c0": ("gpu-0", 0, "containers", None),
    "m0": ("gpu-0-mig", 0, "containers", None),
    "v0": ("gpu-0-vfio", 0, "vm", None),
    "c1": ("gpu-1", 1, "containers", None),
    "g1a": ("gpu-1-vgpu-62-0", 1, "vm", 62),
    "g1b": ("gpu-1-vgpu-62-1", 1, "vm", 62),
    "g1c": ("gpu-1-vgpu-63-0", 1, "vm", 63),
    "t2": ("gpu-2-vgpu-230-0", 2, "vm", 230),
}
"""name -> (device, GPU, who it serves, vGPU type)."""


def fits(name: str, prepared: set[str]) -> bool:
    """Whether claim ``name`` can be prepared beside ``prepared`` (the rules of the node)."""
    _, gpu, view, vgpu_type = CLAIMS[name]
    for other in prepared - {name}:
        _, other_gpu, other_view, other_type = CLAIMS[other]
        if other_gpu != gpu:
            continue
        if other_view != view or (view == "vm" and vgpu_type is None):
            return False  # VMs or containers; a vfio GPU is one VM's
        if view == "containers" and {name, other} == {"c0", "m0"}:
            return False  # a whole GPU and its MIG device
        if vgpu_type != other_type:
            return False  # GPU 1 is homogeneous
    return True


class VmMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="vm-machine-"))
        self.node = Node(self.tmp)
        self.claims = Claims()
        self.keys = {n: self.claims.add(n, CLAIMS[n][0]) for n in CLAIMS}
        self.agent = Agent(self.node, self.claims, model=NODE_MODEL)
        self.prepared: set[str] = set()

    def _key(self, name: str) -> ClaimKey:
        return self.keys[name]

    @rule(name=st.sampled_from(sorted(CLAIMS)))
    def prepare(self, name: str) -> None:
        want = name in self.prepared or fits(name, self.prepared)
        result = self.agent.prepare(self._key(name))
        assert (result.error == "") == want, (name, sorted(self.prepared), result.error)
        if want:
            self.prepared.add(name)

    @rule(name=st.sampled_from(sorted(CLAIMS)))
    def unprepare(self, name: str) -> None:
        assert self.agent.unprepare(self._key(name)).error == ""
        self.prepared.discard(name)

    @rule()
    def restart(self) -> None:
        self.agent.restart()

    @rule(name=st.sampled_from(sorted(CLAIMS)), point=st.sampled_from(PREPARE_POINTS))
    def crash_in_prepare(self, name: str, point: str) -> None:
        want = name in self.prepared or fits(name, self.prepared)
        self.agent.crash_at = point
        try:
            result = self.agent.prepare(self._key(name))
        except Crash:
            if point == "after-completed":
                self.prepared.add(name)
            else:
                self.prepared.discard(name)  # rolled back by the next start
        else:
            assert (result.error == "") == want, (name, point, result.error)
            if want:
                self.prepared.add(name)
        self.agent.crash_at = None
        self.agent.restart()

    @rule(name=st.sampled_from(sorted(CLAIMS)), point=st.sampled_from(UNPREPARE_POINTS))
    def crash_in_unprepare(self, name: str, point: str) -> None:
        self.agent.crash_at = point
        try:
            self.agent.unprepare(self._key(name))
        except Crash:
            if point == "after-unprepare-commit":
                self.prepared.discard(name)
        else:
            self.prepared.discard(name)
        self.agent.crash_at = None
        self.agent.restart()

    @invariant()
    def the_node_is_the_checkpoint(self) -> None:
        cp = self.agent.preparer.checkpoint
        assert {e.name for e in cp.claims.values()} == self.prepared
        assert all(e.state == PREPARE_COMPLETED for e in cp.claims.values())
        assert self.node.state() == expected(cp)

    def teardown(self) -> None:
        for preparer in self.node.preparers:
            preparer.close(0)
        shutil.rmtree(self.tmp)


def play(examples: int) -> None:
    run_state_machine_as_test(
        VmMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_vm_state_machine() -> None:
    """A few games in `make test` (each step is sysfs files and a checkpoint write)."""
    play(examples=20)


@pytest.mark.reliability
@pytest.mark.timeout(3600)
def test_vm_state_machine_long() -> None:
    """`make reliability`: many more games."""
    play(examples=500)
