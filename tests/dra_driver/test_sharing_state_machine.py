"""Prepare, unprepare, restart and crash in any order against a simulated node: after every step
the node (MIG instances, time-slices, MPS daemons, CDI specs, checkpoint) is exactly what the
prepared claims say, and a prepare succeeds exactly when an independent model of the hardware
says the claim fits beside the ones prepared.

The preparer runs in this process over the real tools (simulated nvidia-smi and MPS daemons are
subprocesses); a crash is an exception raised at a crash point, after which the preparer is
abandoned and a new one starts from the files, as a restarted agent does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from agent.cli.node_access import open_node
from agent.config import Config
from agent.daemon import CurrentDevices, sharing_effects
from agent.node import NodeSource, discover
from agent.sim.driverroot import make_device_node
from agent.sim.nvml import FakeNvml
from agent.sim.sharing import SharingStore, initial_sharing
from dra_driver.device_model import DeviceModel, advertised_devices
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED, CheckpointStore
from dra_driver.kubeletplugin.claim_sources import DirClaimSource
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.crash_points import CRASH_POINTS
from dra_driver.kubeletplugin.prepare import Preparer
from tests.integration.daemon import DRIVER, claim_manifest, write_claims
from tests.simnode import mig_instances, mps_daemons, node_model, reap_mps_daemons, sharing

MODEL = "dgx-h100"
INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
UNPREPARE_POINTS = tuple(p for p in CRASH_POINTS if p.startswith("after-unprepare-"))
PREPARE_POINTS = tuple(p for p in CRASH_POINTS if p not in UNPREPARE_POINTS)


class Crash(BaseException):
    """The agent dies here (not an Exception: nothing in the preparer may catch it)."""


@dataclass(frozen=True)
class Spec:
    """One claim the kubelet may prepare, and what it takes on the hardware (the model)."""

    name: str
    device: str
    gpu: int
    slices: frozenset[int]
    interval: str | None = None
    """Time-slicing interval of a whole GPU (claims at one interval share it)."""
    mps: bool = False
    placement: tuple[str, int] | None = None
    """(profile, start) of a dynamic MIG device."""

    def fits_beside(self, other: Spec) -> bool:
        if self.gpu != other.gpu or not self.slices & other.slices:
            return True
        return self.interval is not None and self.interval == other.interval


def ts_config(interval: str) -> dict[str, Any]:
    parameters = {
        "apiVersion": f"{DRIVER}/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}},
    }
    return {
        "source": "FromClaim",
        "requests": [],
        "opaque": {"driver": DRIVER, "parameters": parameters},
    }


def mps_config(kind: str) -> dict[str, Any]:
    parameters = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": kind, "sharing": {"strategy": "MPS"}}
    return {
        "source": "FromClaim",
        "requests": [],
        "opaque": {"driver": DRIVER, "parameters": parameters},
    }


def specs(model: DeviceModel) -> tuple[list[Spec], list[dict[str, Any]]]:
    """The claims of the game, and their manifests."""

    def placement(gpu: int, profile: str, start: int) -> tuple[str, int]:
        dev = next(
            d
            for d in model.devices
            if d.kind == "mig"
            and d.gpu_minor == gpu
            and dict(d.attributes)["profile"]["string"] == profile
            and d.mig_placement_start == start
        )
        return dev.name, dev.mig_placement_size or 0

    out: list[Spec] = [
        Spec("whole0", "gpu-0", 0, frozenset(range(8))),
        Spec("whole1", "gpu-1", 1, frozenset(range(8))),
        Spec("ts1-default-a", "gpu-1", 1, frozenset(range(8)), interval="Default"),
        Spec("ts1-default-b", "gpu-1", 1, frozenset(range(8)), interval="Default"),
        Spec("ts1-long", "gpu-1", 1, frozenset(range(8)), interval="Long"),
        Spec("mps2", "gpu-2", 2, frozenset(range(8)), mps=True),
    ]
    for gpu, profile, start, mps in [
        (0, "1g.10gb", 0, False),
        (0, "1g.10gb", 1, False),
        (0, "2g.20gb", 0, False),
        (0, "3g.40gb", 4, False),
        (0, "1g.10gb", 6, True),
        (0, "7g.80gb", 0, False),
        (2, "1g.10gb", 3, False),
    ]:
        name, size = placement(gpu, profile, start)
        out.append(
            Spec(
                f"mig{gpu}-{profile.replace('.', '')}-{start}{'-mps' if mps else ''}",
                name,
                gpu,
                frozenset(range(start, start + size)),
                mps=mps,
                placement=(profile, start),
            )
        )
    manifests = []
    for s in out:
        config = None
        if s.interval is not None:
            config = [ts_config(s.interval)]
        elif s.mps:
            config = [mps_config("MigDeviceConfig" if s.placement else "GpuConfig")]
        manifests.append(
            claim_manifest(s.name, f"uid-{s.name}", [("gpu", s.device)], MODEL, config=config)
        )
    return out, manifests


@dataclass
class Node:
    source: NodeSource
    state: Path
    model: DeviceModel
    specs: list[Spec]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    state = tmp_path_factory.mktemp("machine")
    config = Config.of(simulate=MODEL, mig_mode="dynamic", sharing="time-slicing")
    source = open_node(config, state)
    source.nvml.init()
    model = advertised_devices(discover(source), config.driver.device_policy())
    game, manifests = specs(model)
    write_claims(state, *manifests)
    yield Node(source, state, model, game)
    reap_mps_daemons(state / "sim", MODEL)
    source.nvml.shutdown()


def reset(node: Node, run: Path) -> None:
    """A fresh node for the next game: no MIG instances, default settings, no daemons."""
    reap_mps_daemons(node.state / "sim", MODEL)
    model = node_model(MODEL)
    FakeNvml(model, node.state / "sim").apply_mig_layout("none")
    SharingStore(node.state / "sim", model).update(lambda s: (initial_sharing(model), None))
    run.mkdir(parents=True)


class SharingMachine(RuleBasedStateMachine):
    node: Node
    runs: Iterator[Path]

    def __init__(self) -> None:
        super().__init__()
        self.run = next(self.runs)
        reset(self.node, self.run)
        self.prepared: set[str] = set()
        self.crash_at: str | None = None
        self.preparer = self._start()
        self.by_name = {s.name: s for s in self.node.specs}

    # -- the agent ---------------------------------------------------------------------------
    def _crash_hook(self, point: str) -> None:
        if point == self.crash_at:
            self.crash_at = None
            raise Crash(point)

    def _start(self) -> Preparer:
        config = Config.of(
            simulate=MODEL,
            mig_mode="dynamic",
            sharing="time-slicing",
            mps_root=self.run / "mps",
        )
        devices = CurrentDevices()
        devices.set(self.node.model)
        log = logging.getLogger("test.machine")
        preparer = Preparer(
            driver_name=DRIVER,
            pool=MODEL,
            claims=DirClaimSource(self.node.state / "resourceclaims"),
            store=CheckpointStore(self.run / "checkpoint.json", "boot"),
            cdi=CdiWriter(
                self.run / "cdi",
                DRIVER,
                self.node.source.driver_root,
                "550.90.07",
                make_node=make_device_node,  # the simulated dev tree's, never a real mknod
            ),
            devices=devices.get,
            log=log,
            effects=sharing_effects(
                config, self.node.source, self.run, devices, log, self._crash_hook, lambda gpu: None
            ),
            sharing=config.driver.sharing_policy(),
            crash_hook=self._crash_hook,
        )
        preparer.reconcile_on_start()
        return preparer

    def _restart(self) -> None:
        self.preparer.close(0)
        self.preparer = self._start()

    def _key(self, name: str) -> ClaimKey:
        return ClaimKey("default", name, f"uid-{name}")

    def _fits(self, name: str) -> bool:
        spec = self.by_name[name]
        return all(spec.fits_beside(self.by_name[o]) for o in self.prepared if o != name)

    # -- rules -------------------------------------------------------------------------------
    @initialize()
    def clean(self) -> None:
        assert self.preparer.checkpoint.claims == {}

    @rule(data=st.data())
    def prepare(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.by_name)), label="claim")
        expected = name in self.prepared or self._fits(name)
        (result,) = self.preparer.prepare([self._key(name)]).values()
        assert (result.error == "") == expected, (name, sorted(self.prepared), result.error)
        if expected:
            self.prepared.add(name)

    @rule(data=st.data())
    def unprepare(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.by_name)), label="claim")
        (result,) = self.preparer.unprepare([self._key(name)]).values()
        assert result.error == ""
        self.prepared.discard(name)

    @rule()
    def restart(self) -> None:
        self._restart()

    @rule(data=st.data())
    def crash_in_prepare(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.by_name)), label="claim")
        self.crash_at = point = data.draw(st.sampled_from(PREPARE_POINTS), label="point")
        fits = name in self.prepared or self._fits(name)
        try:
            (result,) = self.preparer.prepare([self._key(name)]).values()
        except Crash:
            if point == "after-completed":
                self.prepared.add(name)
            else:
                self.prepared.discard(name)  # rolled back by the next start
        else:
            assert (result.error == "") == fits, (name, point, result.error)
            if fits:
                self.prepared.add(name)
        self.crash_at = None
        self._restart()

    @rule(data=st.data())
    def crash_in_unprepare(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.prepared or self.by_name)), label="claim")
        self.crash_at = point = data.draw(st.sampled_from(UNPREPARE_POINTS), label="point")
        try:
            self.preparer.unprepare([self._key(name)])
        except Crash:
            if point == "after-unprepare-commit":
                self.prepared.discard(name)
            # after-unprepare-undo: still prepared; the start makes it whole again
        else:
            self.prepared.discard(name)
        self.crash_at = None
        self._restart()

    # -- what must always hold ---------------------------------------------------------------
    @invariant()
    def checkpoint_is_the_prepared_claims(self) -> None:
        claims = self.preparer.checkpoint.claims
        assert {e.name for e in claims.values()} == self.prepared
        assert all(e.state == PREPARE_COMPLETED for e in claims.values())
        specs_on_disk = {p.name for p in (self.run / "cdi").glob("*-claim_*.json")}
        assert specs_on_disk == {f"k8s.{DRIVER}-claim_uid-{n}.json" for n in self.prepared}

    @invariant()
    def mig_instances_are_the_prepared_placements(self) -> None:
        for gpu in (0, 1, 2):
            want = sorted(
                self.by_name[n].placement  # type: ignore[misc]
                for n in self.prepared
                if self.by_name[n].gpu == gpu and self.by_name[n].placement
            )
            have = sorted(
                (i.profile_name, i.placement.start)
                for i in mig_instances(self.node.state / "sim", MODEL, gpu)
            )
            assert have == want, f"GPU {gpu}"

    @invariant()
    def time_slices_and_daemons_follow_the_claims(self) -> None:
        state = sharing(self.node.state / "sim", MODEL)
        intervals = {self.by_name[n].interval for n in self.prepared if self.by_name[n].interval}
        assert state.gpus[1].timeslice == (INTERVALS[intervals.pop()] if intervals else 0)
        records = {e.mps.pid for e in self.preparer.checkpoint.claims.values() if e.mps is not None}
        assert {d.pid for d in mps_daemons(self.node.state / "sim", MODEL)} == records
        assert len(records) == sum(1 for n in self.prepared if self.by_name[n].mps)

    def teardown(self) -> None:
        self.preparer.close(0)
        reap_mps_daemons(self.node.state / "sim", MODEL)


def play(node: Node, short_tmp: Path, examples: int) -> None:
    """Each game runs in a directory of its own under ``short_tmp``: the MPS control sockets
    live there and a unix socket path is at most 107 bytes."""
    counter = iter(range(1_000_000))
    SharingMachine.node = node
    SharingMachine.runs = (short_tmp / f"run-{i}" for i in counter)
    run_state_machine_as_test(
        SharingMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_sharing_state_machine(node: Node, short_tmp: Path) -> None:
    """A few games in `make test` (each starts MPS daemons and simulated tools)."""
    play(node, short_tmp, examples=5)


@pytest.mark.reliability
@pytest.mark.timeout(3600)
def test_sharing_state_machine_long(node: Node, short_tmp: Path) -> None:
    """`make reliability`: many more games."""
    play(node, short_tmp, examples=200)
