"""GPUs for virtual machines end to end: a real `tessera run --simulate` daemon per mode, driven
through the test kubelet over its unix sockets; the simulated node's sysfs, NVML (the daemon's
/metrics and slices) and the CDI results and KEP-5304 metadata checked after each step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.daemon import DRIVER, Daemon, SharedDaemon
from tests.integration.test_rediscovery import wait_for
from tests.integration.vm import (
    attr,
    binding,
    cdi_nodes,
    claim,
    group,
    metadata,
    metadata_id,
    prepare,
    published,
    unprepare,
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
    vfio = published(d)["gpu-3-vfio"]
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
    assert "gpu-3-vfio" in published(d)
    wait_for(
        "only the passthrough series",
        lambda: gpu_series(d, uuid) == {"tessera_gpu_passthrough": 1.0},
    )
    assert health_changes(d, uuid) == []  # a GPU a VM holds is neither lost nor unhealthy

    assert unprepare(d, ref, api) == ""
    assert binding(d, bdf) == (NVIDIA, "(null)")
    assert d.cdi_files() == []
    wait_for("advertised as read again", lambda: index_of(d, "gpu-3") == 3)
    wait_for("sampled again", lambda: "tessera_gpu_power_watts" in gpu_series(d, uuid))
    assert gpu_series(d, uuid)["tessera_gpu_passthrough"] == 0
    assert health_changes(d, uuid) == []
