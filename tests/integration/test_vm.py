"""GPUs for virtual machines end to end: a real `tessera run --simulate` daemon per mode, driven
through the test kubelet over its unix sockets; the simulated node's sysfs, NVML (the daemon's
/metrics and slices) and the CDI results and KEP-5304 metadata checked after each step."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon, SharedDaemon
from tests.integration.test_rediscovery import wait_for
from tests.integration.vm import (
    attr,
    binding,
    cdi_nodes,
    claim,
    group,
    metadata,
    metadata_files,
    metadata_id,
    prepare,
    published,
    sysfs,
    unprepare,
    validated,
)
from tests.tmproot import short_tmp_dir

NVIDIA, VFIO = "nvidia", "vfio-pci"
CDI_KIND = f"k8s.{DRIVER}/claim"


def shared(model: str, *extra: str) -> Iterator[SharedDaemon]:
    with short_tmp_dir() as state:
        daemon = SharedDaemon(state, model, *extra)
        try:
            yield daemon
        finally:
            daemon.close()


@pytest.fixture(scope="module")
def shared_passthrough() -> Iterator[SharedDaemon]:
    # a short telemetry interval: a sampler tick falls inside every rebinding
    yield from shared("dgx-h100", "--virtualization", "passthrough", "--telemetry-interval", "0.1")


@pytest.fixture
def passthrough(
    shared_passthrough: SharedDaemon, request: pytest.FixtureRequest
) -> Iterator[Daemon]:
    with shared_passthrough.lend(request.node.nodeid) as d:
        yield d


def gpu_series(d: Daemon, uuid: str) -> dict[str, float]:
    """The daemon's /metrics samples of GPU ``uuid``: sample name -> value (one each)."""
    out: dict[str, float] = {}
    for name, samples in d.scrape().items():
        for labels, value in samples.items():
            if ("uuid", uuid) in labels and name.startswith("tessera_gpu_"):
                out.setdefault(name, value)
    return out


def index_of(d: Daemon, device: str) -> int | None:
    found = published(d).get(device)
    return None if found is None else int(attr(found, "index"))


def kubelet_health(d: Daemon) -> dict[str, str]:
    """Each device's health as the kubelet's health stream gives it now."""
    with KubeletClient(d.dra_socket) as k:
        (devices,) = list(k.watch_health(max_messages=1, timeout=10))
    return {x["deviceName"]: x["health"] for x in devices}


def health_changes(d: Daemon, uuid: str) -> list[dict[str, Any]]:
    """Health changes and Node events of GPU ``uuid`` logged during the test."""
    health = ("GPU health changed", "GPU health published")
    return [
        r
        for r in d.logs[d.since :]
        if (r.get("uuid") == uuid and r.get("msg") in health)
        or (r.get("msg") == "node event" and uuid in str(r.get("message", "")))
    ]


@pytest.mark.parametrize("api", ["v1", "v1beta1"])
def test_passthrough_binds_the_gpu_to_vfio_and_gives_it_back(passthrough, api):
    d = passthrough
    wait_for("slices published", lambda: "gpu-3-vfio" in published(d))
    vfio = validated(d)["gpu-3-vfio"]
    bdf, uuid = attr(vfio, "resource.kubernetes.io/pciBusID"), attr(vfio, "uuid")
    iommu = group(d, bdf)
    assert attr(vfio, "type") == "vfio" and attr(vfio, "iommuGroup") == iommu
    assert binding(d, bdf) == (NVIDIA, "(null)")
    assert gpu_series(d, uuid)["tessera_gpu_passthrough"] == 0

    ref = claim(d, "vm", "gpu-3-vfio")
    res = prepare(d, ref, api)
    assert res["error"] == ""
    (dev,) = res["devices"]
    assert dev["deviceName"] == "gpu-3-vfio" and dev["requestNames"] == ["gpu"]
    assert dev["cdiDeviceIds"] == [f"{CDI_KIND}=uid-vm-gpu-3-vfio", metadata_id("uid-vm")]
    assert cdi_nodes(d, "uid-vm") == ["/dev/vfio/vfio", f"/dev/vfio/{iommu}"]
    meta = metadata(d, "vm")
    assert meta["resource.kubernetes.io/pciBusID"] == bdf and meta["type"] == "vfio"
    assert "mdevUUID" not in meta
    assert binding(d, bdf) == (VFIO, VFIO)
    # NVML lost it: discovery keeps it from its last facts (index -1), still advertised
    wait_for("the GPU seen handed over", lambda: index_of(d, "gpu-3") == -1)
    assert "gpu-3-vfio" in validated(d)
    wait_for(
        "only the passthrough series",
        lambda: gpu_series(d, uuid) == {"tessera_gpu_passthrough": 1.0},
    )
    assert health_changes(d, uuid) == []  # a GPU a VM holds is neither lost nor unhealthy
    assert kubelet_health(d)["gpu-3-vfio"] == "HEALTHY"

    assert unprepare(d, ref, api) == ""
    assert binding(d, bdf) == (NVIDIA, "(null)")
    assert d.cdi_files() == [] and metadata_files(d) == []
    wait_for("advertised as read again", lambda: index_of(d, "gpu-3") == 3)
    assert "gpu-3-vfio" in validated(d)
    wait_for("sampled again", lambda: "tessera_gpu_power_watts" in gpu_series(d, uuid))
    assert gpu_series(d, uuid)["tessera_gpu_passthrough"] == 0
    assert health_changes(d, uuid) == []


@pytest.fixture(scope="module")
def shared_vgpu_h200() -> Iterator[SharedDaemon]:
    yield from shared("vgpu-h200", "--virtualization", "vgpu")


@pytest.fixture(scope="module")
def shared_vgpu_t4() -> Iterator[SharedDaemon]:
    yield from shared("vgpu-t4", "--virtualization", "vgpu")


@pytest.fixture
def vgpu_h200(shared_vgpu_h200: SharedDaemon, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    with shared_vgpu_h200.lend(request.node.nodeid) as d:
        yield d


@pytest.fixture
def vgpu_t4(shared_vgpu_t4: SharedDaemon, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    with shared_vgpu_t4.lend(request.node.nodeid) as d:
        yield d


def first_vgpu(d: Daemon) -> tuple[str, dict[str, Any]]:
    wait_for("slices published", lambda: any("-vgpu-" in n for n in published(d)))
    name = min(n for n in published(d) if n.startswith("gpu-0-vgpu-"))
    return name, validated(d)[name]


def test_a_vgpu_on_an_sr_iov_vf_gets_its_type_and_loses_it(vgpu_h200):
    d = vgpu_h200
    name, dev = first_vgpu(d)
    assert attr(dev, "type") == "vgpu"
    assert "gpu-0" not in published(d)  # the vGPU host runs no CUDA: no whole GPU for containers
    parent, type_id = attr(dev, "parentPciBusID"), attr(dev, "vgpuTypeID")
    vfs = sorted(p.name for p in sysfs(d, parent).glob("virtfn*"))
    assert vfs and all(current_type(d, parent, vf) == 0 for vf in vfs)

    ref = claim(d, "vgpu", name)
    res = prepare(d, ref)
    assert res["error"] == ""
    assert res["devices"][0]["cdiDeviceIds"][1] == metadata_id("uid-vgpu")
    (used,) = [vf for vf in vfs if current_type(d, parent, vf) != 0]
    assert current_type(d, parent, used) == type_id
    vf_bdf = os.path.basename(os.readlink(sysfs(d, parent) / used))
    meta = metadata(d, "vgpu")
    assert meta["resource.kubernetes.io/pciBusID"] == vf_bdf and "mdevUUID" not in meta
    assert meta["vgpuTypeID"] == type_id and meta["parentPciBusID"] == parent
    assert cdi_nodes(d, "uid-vgpu") == ["/dev/vfio/vfio", f"/dev/vfio/{group(d, vf_bdf)}"]
    assert binding(d, parent)[0] == NVIDIA  # the GPU itself stays on the host driver
    series = gpu_series(d, attr(dev, "parentUUID"))  # and is sampled as usual
    assert series["tessera_gpu_passthrough"] == 0 and "tessera_gpu_power_watts" in series

    assert unprepare(d, ref) == ""
    assert all(current_type(d, parent, vf) == 0 for vf in vfs)
    assert metadata_files(d) == []


def test_a_vgpu_of_a_mediated_device_is_made_and_removed(vgpu_t4):
    d = vgpu_t4
    name, dev = first_vgpu(d)
    parent, type_id = attr(dev, "parentPciBusID"), attr(dev, "vgpuTypeID")
    mdevs = d.state / "sim" / "sys" / "bus" / "mdev" / "devices"
    assert mdev_list(d) == []

    ref = claim(d, "mdev", name)
    res = prepare(d, ref)
    assert res["error"] == ""
    (uuid,) = mdev_list(d)
    made = mdevs / uuid
    assert os.path.basename(os.readlink(made / "mdev_type")) == f"nvidia-{type_id}"
    assert made.resolve().parent == sysfs(d, parent).resolve()  # made under its parent GPU
    meta = metadata(d, "mdev")
    assert meta["mdevUUID"] == uuid
    mdev_group = int(os.path.basename(os.readlink(made / "iommu_group")))
    assert cdi_nodes(d, "uid-mdev") == ["/dev/vfio/vfio", f"/dev/vfio/{mdev_group}"]

    assert unprepare(d, ref) == ""
    assert mdev_list(d) == [] and metadata_files(d) == []


def current_type(d: Daemon, parent: str, virtfn: str) -> int:
    return int((sysfs(d, parent) / virtfn / "nvidia" / "current_vgpu_type").read_text())


def mdev_list(d: Daemon) -> list[str]:
    mdevs = d.state / "sim" / "sys" / "bus" / "mdev" / "devices"
    return sorted(p.name for p in mdevs.iterdir()) if mdevs.exists() else []


@pytest.fixture(scope="module")
def shared_dynamic_mig() -> Iterator[SharedDaemon]:
    yield from shared("dgx-h100", "--virtualization", "passthrough", "--mig-mode", "dynamic")


@pytest.fixture
def dynamic_mig(
    shared_dynamic_mig: SharedDaemon, request: pytest.FixtureRequest
) -> Iterator[Daemon]:
    with shared_dynamic_mig.lend(request.node.nodeid) as d:
        yield d


def assert_refused(d: Daemon, ref: Any, device: str, holder: str) -> None:
    """``ref``'s prepare is refused: the GPU is in use by claim ``holder``'s ``device``; the
    reason ``device_in_use`` is logged and counted."""
    res = prepare(d, ref)
    assert res["devices"] == []
    assert f"{device} is prepared for" in res["error"]
    assert f"by claim default/{holder} (uid-{holder})" in res["error"]
    rec = d.wait_log("prepare failed")
    assert rec["reason"] == "device_in_use" and rec["claim"].startswith(f"default/{ref.name}")
    assert d.cdi_files() == [f"k8s.{DRIVER}-claim_uid-{holder}.json"]


@pytest.mark.parametrize("first", ["vm", "containers"])
def test_a_gpu_serves_a_vm_or_containers_whatever_came_first(passthrough, first):
    d = passthrough
    wait_for("slices published", lambda: "gpu-2-vfio" in published(d))
    bdf = attr(validated(d)["gpu-2-vfio"], "resource.kubernetes.io/pciBusID")
    vm, ctr = claim(d, "vm", "gpu-2-vfio"), claim(d, "ctr", "gpu-2")
    held, refused = (vm, ctr) if first == "vm" else (ctr, vm)
    held_device = "gpu-2-vfio" if first == "vm" else "gpu-2"
    assert prepare(d, held)["error"] == ""
    assert_refused(d, refused, held_device, held.name)
    assert binding(d, bdf)[0] == (VFIO if first == "vm" else NVIDIA)
    assert unprepare(d, held) == ""
    assert prepare(d, refused)["error"] == ""  # free once the holder is gone
    assert unprepare(d, refused) == ""


@pytest.mark.parametrize("first", ["vm", "mig"])
def test_a_dynamic_mig_device_and_a_vm_exclude_each_other(dynamic_mig, first):
    d = dynamic_mig
    wait_for("slices published", lambda: "gpu-1-vfio" in published(d))
    mig = min(n for n in validated(d) if n.startswith("gpu-1-mig-"))
    vm, part = claim(d, "vm", "gpu-1-vfio"), claim(d, "part", mig)
    held, refused = (vm, part) if first == "vm" else (part, vm)
    held_device = "gpu-1-vfio" if first == "vm" else mig
    assert prepare(d, held)["error"] == ""
    assert_refused(d, refused, held_device, held.name)
    assert unprepare(d, held) == ""
    assert prepare(d, refused)["error"] == ""
    assert unprepare(d, refused) == ""


def vgpu_types(d: Daemon, minor: int) -> dict[int, list[str]]:
    """The vGPU types GPU ``minor`` advertises now: type id -> its device names."""
    out: dict[int, list[str]] = {}
    for name, dev in sorted(published(d).items()):
        if name.startswith(f"gpu-{minor}-vgpu-"):
            out.setdefault(attr(dev, "vgpuTypeID"), []).append(name)
    return out


def test_a_homogeneous_gpu_offers_only_the_type_in_use(vgpu_h200):
    d = vgpu_h200
    # the daemon is shared: the slices a test before changed (a GPU hosting a vGPU offers only
    # its type) are written again by the publisher after that test's unprepare answered
    wait_for("GPU 0 offering every vGPU type", lambda: len(vgpu_types(d, 0)) > 1)
    name, dev = first_vgpu(d)
    every = vgpu_types(d, 0)
    used = attr(dev, "vgpuTypeID")
    other = min(n for t, names in every.items() if t != used for n in names)
    ref = claim(d, "first", name)
    assert prepare(d, ref)["error"] == ""
    # read again at once (no udev event says so): the scheduler may place only this type here
    wait_for("only the type in use on GPU 0", lambda: set(vgpu_types(d, 0)) == {used})
    assert set(vgpu_types(d, 1)) == set(every)  # the other GPU hosts none: every type
    res = prepare(d, claim(d, "second", other))
    assert res["devices"] == [] and f"'{other}' is not advertised" in res["error"], res
    assert d.wait_log("prepare failed")["reason"] == "unknown_device"
    assert unprepare(d, ref) == ""
    wait_for("every type again", lambda: vgpu_types(d, 0) == every)


def test_a_gpu_held_by_a_vm_stays_with_it_across_a_restart(short_tmp):
    d = Daemon(short_tmp, "dgx-h100", "--virtualization", "passthrough").start()
    try:
        wait_for("slices published", lambda: "gpu-1-vfio" in published(d))
        bdf = attr(published(d)["gpu-1-vfio"], "resource.kubernetes.io/pciBusID")
        uuid = attr(published(d)["gpu-1-vfio"], "uuid")
        ref = claim(d, "vm", "gpu-1-vfio")
        assert prepare(d, ref)["error"] == ""
        assert d.stop() == 0
        d.start()
        d.wait_log("agent started")
        assert binding(d, bdf) == (VFIO, VFIO)  # recorded for its claim: not given back
        wait_for("advertised handed over", lambda: index_of(d, "gpu-1") == -1)
        assert "gpu-1-vfio" in validated(d)
        wait_for(
            "its passthrough series",
            lambda: gpu_series(d, uuid) == {"tessera_gpu_passthrough": 1.0},
        )
        assert health_changes(d, uuid) == []
        assert prepare(d, ref)["error"] == ""  # the kubelet's retry: the same answer
        assert unprepare(d, ref) == ""
        assert binding(d, bdf) == (NVIDIA, "(null)")
        wait_for("read again", lambda: index_of(d, "gpu-1") == 1)
    finally:
        d.kill()
