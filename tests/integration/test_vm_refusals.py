"""A passthrough prepare refused end to end, with the simulator's faults on the daemon's node
(`tessera sim fault hold-gpu | foreign-in-group | iommu-off | vfio-unloaded`): the kubelet's
answer names the cause (the holding process, the foreign function, the missing IOMMU), the
reason is logged and counted, and the GPU stays on nvidia, prepared for no one."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tests.integration.daemon import Daemon, SharedDaemon
from tests.integration.test_rediscovery import wait_for
from tests.integration.vm import attr, binding, claim, prepare, published, unprepare
from tests.tmproot import short_tmp_dir


@pytest.fixture(scope="module")
def shared_passthrough() -> Iterator[SharedDaemon]:
    with short_tmp_dir() as state:
        # no periodic re-read: a fault's effect on the advertised devices is not what is tested
        daemon = SharedDaemon(
            state, "dgx-h100", "--virtualization", "passthrough", "--rediscovery-interval", "0"
        )
        try:
            yield daemon
        finally:
            daemon.close()


@pytest.fixture
def node(shared_passthrough: SharedDaemon, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    with shared_passthrough.lend(request.node.nodeid) as d:
        wait_for("slices published", lambda: "gpu-7-vfio" in published(d))
        yield d


def bus_id(d: Daemon, device: str) -> str:
    """The GPU's BDF, from the published slices (read again while a new generation is being
    written)."""
    found: list[str] = []

    def read() -> bool:
        dev = published(d).get(device)
        if dev is not None:
            found.append(attr(dev, "resource.kubernetes.io/pciBusID"))
        return bool(found)

    wait_for(f"{device} published", read)
    return found[0]


def refused(d: Daemon, device: str, reason: str) -> str:
    """Prepare a claim of ``device``; it must be refused for ``reason``, leaving the GPU on
    nvidia with nothing prepared. Returns the error the kubelet got."""
    bdf = bus_id(d, device)
    res = prepare(d, claim(d, "vm", device))
    assert res["devices"] == [] and res["error"].startswith(f"{device}: "), res
    rec = d.wait_log("prepare failed")
    assert rec["reason"] == reason, (rec, res["error"])
    assert binding(d, bdf) == ("nvidia", "(null)")
    assert d.cdi_files() == [] and d.checkpoint()["claims"] == {}
    error: str = res["error"]
    return error


def test_a_process_holding_the_gpu_is_named(node):
    pid = int(node.fault("hold-gpu", "--gpu", "4"))
    try:
        error = refused(node, "gpu-4-vfio", "gpu_in_use")
        assert f"pid {pid} (sleep)" in error and "dev/nvidia4" in error, error
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)  # the fault spawned it from this process
    ref = claim(node, "vm", "gpu-4-vfio")
    assert prepare(node, ref)["error"] == ""  # free once the process is gone
    assert unprepare(node, ref) == ""


def test_a_foreign_function_in_the_gpus_iommu_group_is_named(node):
    bdf = bus_id(node, "gpu-5-vfio")
    foreign = bdf.rsplit(":", 1)[0] + ":1f.0"
    assert "NVMe drive" in node.fault("foreign-in-group", "--gpu", "5")
    error = refused(node, "gpu-5-vfio", "iommu_group_shared")
    assert f"also holds {foreign}, which is not a function of the GPU" in error, error


def test_a_node_without_iommu_says_so(node):
    node.fault("iommu-off")
    try:
        error = refused(node, "gpu-6-vfio", "no_iommu")
        assert "IOMMU" in error, error
    finally:
        node.fault("iommu-on")


def test_vfio_pci_not_loaded_says_so(node):
    node.fault("vfio-unloaded")
    try:
        error = refused(node, "gpu-7-vfio", "vfio_error")
        assert "vfio-pci" in error, error
    finally:
        node.fault("vfio-loaded")
    ref = claim(node, "vm", "gpu-7-vfio")
    assert prepare(node, ref)["error"] == ""
    assert unprepare(node, ref) == ""
