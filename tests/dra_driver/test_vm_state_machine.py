"""Random sequences of prepare, unprepare, restarts and crashes at every point, mixing container
claims (whole GPUs, MIG devices), GPUs handed to VMs through VFIO and vGPUs (SR-IOV VFs and
mediated devices) on simulated nodes (tests/vmnode.py, ``NODES``), each with its own agent: a
passthrough node (``mixed`` under ``all-7g``), a vGPU 17+ node (``vgpu-h200``) and an older vGPU
node (``vgpu-t4``). After every step each node is what its checkpoint says: the simulator's state
(each function's driver, ``driver_override`` and vGPU type, the mediated devices) equals the
records, NVML lists exactly the GPUs bound to nvidia, the checkpoint holds exactly the claims
prepared, and a GPU never serves a VM and containers at once."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from agent.pcihost.vm_types import NVIDIA
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.crash_points import CRASH_POINTS
from tests import vmnode
from tests.vmnode import VmNode

UNPREPARE_POINTS = tuple(p for p in CRASH_POINTS if p.startswith("after-unprepare-"))
PREPARE_POINTS = tuple(p for p in CRASH_POINTS if p not in UNPREPARE_POINTS)
CLAIMS = {
    "m0": ("passthrough", "gpu-0-mig-7g80gb-0-0", 0, "containers", None),
    "c2": ("passthrough", "gpu-2", 2, "containers", None),
    "v2": ("passthrough", "gpu-2-vfio", 2, "vm", None),
    "c3": ("passthrough", "gpu-3", 3, "containers", None),
    "v3": ("passthrough", "gpu-3-vfio", 3, "vm", None),
    "f35a": ("vf", "gpu-0-vgpu-1430-0", 0, "vm", 1430),
    "f35b": ("vf", "gpu-0-vgpu-1430-1", 0, "vm", 1430),
    "f70": ("vf", "gpu-0-vgpu-1429-0", 0, "vm", 1429),
    "f141": ("vf", "gpu-1-vgpu-1428-0", 1, "vm", 1428),
    "t1a": ("mdev", "gpu-0-vgpu-230-0", 0, "vm", 230),
    "t1b": ("mdev", "gpu-0-vgpu-230-1", 0, "vm", 230),
    "t2": ("mdev", "gpu-0-vgpu-231-0", 0, "vm", 231),
}
"""name -> (node, device, GPU, who it serves, vGPU type)."""
NAMES = st.sampled_from(sorted(CLAIMS))


def fits(name: str, prepared: set[str]) -> bool:
    """Whether claim ``name`` can be prepared beside ``prepared`` (the rules of the nodes)."""
    node, _, gpu, view, vgpu_type = CLAIMS[name]
    for other in prepared - {name}:
        other_node, _, other_gpu, other_view, other_type = CLAIMS[other]
        if (other_node, other_gpu) != (node, gpu):
            continue
        if other_view != view or (view == "vm" and vgpu_type is None):
            return False  # VMs or containers; a vfio GPU is one VM's
        if vgpu_type != other_type:
            return False  # every simulated vGPU GPU is homogeneous
    return True


class VmMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="vm-machine-"))
        self.nodes: dict[str, VmNode] = {}
        self.agents: dict[str, vmnode.Agent] = {}
        self.claims: dict[str, vmnode.Claims] = {}
        self.prepared: set[str] = set()

    def _agent(self, name: str) -> vmnode.Agent:
        """The agent of claim ``name``'s node, the node opened (and the agent started) on first
        use: a game touches only the nodes its claims are on."""
        kind = CLAIMS[name][0]
        if kind not in self.agents:
            node = VmNode.of(self.tmp, kind)
            self.nodes[kind] = node
            claims = vmnode.Claims(node.source.hostname)
            for n, (k, device, *_) in CLAIMS.items():
                if k == kind:
                    claims.add(n, device)
            self.claims[kind] = claims
            self.agents[kind] = vmnode.Agent(node, claims)
        return self.agents[kind]

    def _key(self, name: str) -> ClaimKey:
        self._agent(name)
        return ClaimKey("default", name, f"uid-{name}")  # as Claims.add made it

    @rule(name=NAMES)
    def prepare(self, name: str) -> None:
        want = name in self.prepared or fits(name, self.prepared)
        agent = self._agent(name)
        result = agent.prepare(self._key(name))
        assert (result.error == "") == want, (name, sorted(self.prepared), result.error)
        if want:
            self.prepared.add(name)

    @rule(name=NAMES)
    def unprepare(self, name: str) -> None:
        assert self._agent(name).unprepare(self._key(name)).error == ""
        self.prepared.discard(name)

    @rule(name=NAMES)
    def restart(self, name: str) -> None:
        """The agent of ``name``'s node restarts (its start repairs what it finds)."""
        self._agent(name).restart()

    @rule(name=NAMES, point=st.sampled_from(PREPARE_POINTS))
    def crash_in_prepare(self, name: str, point: str) -> None:
        want = name in self.prepared or fits(name, self.prepared)
        agent = self._agent(name)
        agent.crash_at = point
        try:
            result = agent.prepare(self._key(name))
        except vmnode.Crash:
            if point == "after-completed":
                self.prepared.add(name)
            else:
                self.prepared.discard(name)  # rolled back by the next start
        else:
            assert (result.error == "") == want, (name, point, result.error)
            if want:
                self.prepared.add(name)
        agent.crash_at = None
        agent.restart()

    @rule(name=NAMES, point=st.sampled_from(UNPREPARE_POINTS))
    def crash_in_unprepare(self, name: str, point: str) -> None:
        agent = self._agent(name)
        agent.crash_at = point
        try:
            agent.unprepare(self._key(name))
        except vmnode.Crash:
            if point == "after-unprepare-commit":
                self.prepared.discard(name)
        else:
            self.prepared.discard(name)
        agent.crash_at = None
        agent.restart()

    @invariant()
    def every_node_is_its_checkpoint(self) -> None:
        for kind, agent in self.agents.items():
            node = self.nodes[kind]
            cp = agent.preparer.checkpoint
            mine = {n for n in self.prepared if CLAIMS[n][0] == kind}
            assert {e.name for e in cp.claims.values()} == mine
            assert all(e.state == PREPARE_COMPLETED for e in cp.claims.values())
            state = node.state()
            assert state == vmnode.expected(node, cp)
            gpus = {node.bus(i) for i in range(len(node.source.sim.model.gpus))}
            on_nvidia = {b for b in gpus if state.functions[b][0] == NVIDIA}
            assert node.nvml_buses() == on_nvidia  # NVML lost exactly the GPUs lent to VMs

    def teardown(self) -> None:
        for node in self.nodes.values():
            node.close()
        shutil.rmtree(self.tmp)


def play(examples: int, steps: int) -> None:
    run_state_machine_as_test(
        VmMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_vm_state_machine() -> None:
    """A few games in `make test` (each step is writes to the simulator's kernel, each of which
    rewrites its sysfs tree, and a checkpoint write)."""
    play(examples=10, steps=12)


@pytest.mark.reliability
@pytest.mark.timeout(3600)
def test_vm_state_machine_long() -> None:
    """`make reliability`: many more, longer games."""
    play(examples=300, steps=30)
