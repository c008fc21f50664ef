"""KEP-5304 metadata on the prepare path: a VM device's claim is answered with the metadata's CDI
device once its files are written, before the claim is recorded as prepared; unprepare and a
failed prepare remove them; the start removes those of claims the checkpoint does not hold; the
kubelet's own client sees the id. The VM device is a simulated passthrough node's (tests/vmnode.py:
the agent's own discovery and device model), its GPU bound to vfio-pci and back by the prepare
through the simulator's kernel."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.pcihost.vm_types import NVIDIA, VFIO_PCI
from dra_driver.errors import CdiError
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED, CheckpointStore
from dra_driver.kubeletplugin.claim_sources import DirClaimSource
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.device_metadata import DeviceMetadataWriter
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.health_stream import HealthBoard
from dra_driver.kubeletplugin.prepare import Preparer
from dra_driver.kubeletplugin.server import PluginServer
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.dra_driver.test_device_metadata import POOL, read_like_kubevirt
from tests.k8sschema import VERSIONS, validate
from tests.vmnode import VmNode

DRIVER = "gpu.tessera.dev"
VM_DEVICE, CONTAINER_DEVICE = "gpu-2-vfio", "gpu-3"  # the passthrough node's two L4s
ANNOTATION = "resource.kubernetes.io/pod-claim-name"


def claim(name: str, device: str, pod_claim: str | None = None) -> tuple[dict[str, Any], ClaimKey]:
    """An allocated ResourceClaim (checked against the API's schemas) and its key."""
    key = ClaimKey("vms", name, f"0a1b2c3d-0000-4000-8000-{zlib.crc32(name.encode()):012d}")
    meta: dict[str, Any] = {"name": name, "namespace": key.namespace, "uid": key.uid}
    if pod_claim is not None:
        meta["annotations"] = {ANNOTATION: pod_claim}
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "vfio.gpu.tessera.dev"}}
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": DRIVER, "pool": POOL, "device": device}
                    ]
                }
            }
        },
    }
    for version in VERSIONS:
        validate(obj, version)
    return obj, key


class Node:
    """The agent's files in a directory; ``agent()`` is a (re)started preparer."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "driver").mkdir(parents=True, exist_ok=True)
        (root / "claims").mkdir(exist_ok=True)
        self.crash_points: list[str] = []
        self.on_crash_point: dict[str, Any] = {}
        # the host the VM device's GPU is on: its prepare binds it to vfio-pci (vm_steps)
        self.host = VmNode.of(root / "host", "passthrough")
        self.bus_id = self.host.bus(2)

    def driver(self) -> str | None:
        """The driver the VM device's GPU is bound to now."""
        return self.host.binding().driver(self.bus_id)

    def add(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        path = self.root / "claims" / f"{meta['namespace']}-{meta['name']}.yaml"
        path.write_text(yaml.safe_dump(obj))

    def metadata(self) -> DeviceMetadataWriter:
        return DeviceMetadataWriter(self.root / "plugins" / DRIVER, self.root / "cdi", DRIVER)

    def _crash(self, point: str) -> None:
        self.crash_points.append(point)
        if point in self.on_crash_point:
            self.on_crash_point[point]()

    def agent(self) -> Preparer:
        model = self.host.devices()
        log = logging.getLogger("test.device-metadata")
        p = Preparer(
            driver_name=DRIVER,
            pool=POOL,
            claims=DirClaimSource(self.root / "claims"),
            store=CheckpointStore(self.root / "checkpoint.json", "boot"),
            cdi=CdiWriter(self.root / "cdi", DRIVER, self.root / "driver", "550.90.07"),
            devices=lambda: model,
            log=log,
            effects=Effects(
                mig=None,
                settings=None,
                mps=None,
                devices=lambda: model,
                log=log,
                crash_hook=self._crash,
                vm=self.host.tools(self._crash),
            ),
            crash_hook=self._crash,
            metadata=self.metadata(),
        )
        p.reconcile_on_start()
        return p


class Crash(Exception):
    """The agent dying at a crash point (the rest of the call never runs)."""


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.host.close()


def ids(result: Any) -> list[tuple[str, ...]]:
    assert result.error == ""
    return [d.cdi_device_ids for d in result.devices]


def test_a_vm_claim_is_answered_with_its_metadata_written_before_it_is_prepared(node):
    obj, key = claim("vm-a-gpu-x7k2p", VM_DEVICE, pod_claim="gpu")
    node.add(obj)
    agent = node.agent()
    metadata_id = f"{DRIVER}/metadata={key.uid}_gpu"
    seen: list[tuple[bool, str | None]] = []

    def at_cdi() -> None:  # the last step before the completion is recorded
        entry = agent.checkpoint.claims.get(key.uid)
        host = node.metadata().host_path(key.namespace, key.name, "gpu")
        seen.append((host.exists(), entry.state if entry else None))

    node.on_crash_point["after-cdi"] = at_cdi
    (result,) = agent.prepare([key]).values()
    # a VM device gets no driver files (the VM runs its own driver): no driver=common device
    assert ids(result) == [(f"k8s.{DRIVER}/claim={key.uid}-{VM_DEVICE}", metadata_id)]
    assert seen == [(True, "PrepareStarted")]
    assert node.driver() == VFIO_PCI
    assert agent.checkpoint.claims[key.uid].state == PREPARE_COMPLETED
    (device,) = read_like_kubevirt(node.root / "cdi", "resourceclaimtemplates", "gpu", "gpu")
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": node.bus_id}
    (again,) = agent.prepare([key]).values()  # the kubelet's retry: the same answer
    assert ids(again) == ids(result)
    (gone,) = agent.unprepare([key]).values()
    assert gone.error == "" and node.driver() == NVIDIA
    assert node.metadata().claim_uids() == set()
    assert not (node.root / "plugins" / DRIVER / "dra-device-metadata" / f"vms_{key.name}").exists()
    agent.close(5)


def test_a_container_claim_gets_no_metadata(node):
    obj, key = claim("train", CONTAINER_DEVICE)
    node.add(obj)
    agent = node.agent()
    (result,) = agent.prepare([key]).values()
    assert ids(result) == [
        (f"k8s.{DRIVER}/claim={key.uid}-{CONTAINER_DEVICE}", f"k8s.{DRIVER}/driver=common")
    ]
    assert not (node.root / "plugins").exists()
    assert not list((node.root / "cdi").glob("*_metadata_*"))
    agent.close(5)


def test_a_prepare_failing_after_the_metadata_removes_it(node):
    obj, key = claim("vm-b", VM_DEVICE)
    node.add(obj)
    agent = node.agent()

    def fail() -> None:
        raise CdiError("disk gone")

    node.on_crash_point["after-cdi"] = fail
    (result,) = agent.prepare([key]).values()
    assert "disk gone" in result.error
    assert key.uid not in agent.checkpoint.claims
    assert node.metadata().claim_uids() == set()
    assert not list((node.root / "plugins" / DRIVER / "dra-device-metadata").iterdir())
    agent.close(5)


def test_the_start_removes_the_metadata_of_claims_the_checkpoint_does_not_hold(node):
    """A crash after an unprepare was recorded and before its files went: the next start
    removes them, and keeps a prepared claim's."""
    kept_obj, kept = claim("vm-kept", VM_DEVICE)
    left_obj, left = claim("vm-left", VM_DEVICE)
    node.add(kept_obj)
    node.add(left_obj)
    agent = node.agent()
    assert ids(agent.prepare([left])[left.uid])

    def crash() -> None:
        raise Crash("killed after the release was recorded")

    node.on_crash_point["after-unprepare-commit"] = crash
    agent.unprepare([left])
    assert node.metadata().claim_uids() == {left.uid}  # what the crash left
    agent.close(5)
    node.on_crash_point.clear()
    agent = node.agent()  # restarted: the sweep
    assert node.metadata().claim_uids() == set()
    assert ids(agent.prepare([kept])[kept.uid])
    agent.close(5)
    agent = node.agent()  # a start with the claim held keeps its files
    assert node.metadata().claim_uids() == {kept.uid}
    agent.close(5)


def test_the_kubelet_gets_the_metadata_device_over_its_socket(node, short_tmp):
    obj, key = claim("vm-c", VM_DEVICE)
    node.add(obj)
    agent = node.agent()
    plugin = PluginServer(
        driver_name=DRIVER,
        registry_dir=short_tmp / "r",
        plugins_dir=short_tmp / "p",
        preparer=agent,
        health=HealthBoard(pool=POOL),
        log=logging.getLogger("test.device-metadata.plugin"),
    )
    plugin.start()
    try:
        with KubeletClient(plugin.dra_socket) as kubelet:
            ref = ClaimRef(key.namespace, key.name, key.uid)
            for api in ("v1", "v1beta1"):
                answer = kubelet.prepare([ref], api=api)["claims"][key.uid]
                assert answer["error"] == ""
                (device,) = answer["devices"]
                assert device["cdiDeviceIds"][-1] == f"{DRIVER}/metadata={key.uid}_gpu"
            assert kubelet.unprepare([ref])["claims"][key.uid]["error"] == ""
        assert node.metadata().claim_uids() == set()
    finally:
        plugin.stop()
        agent.close(5)
