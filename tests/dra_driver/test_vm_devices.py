"""--virtualization: the devices GPUs offer VMs (vfio, vgpu), their counters, and what the GPU
still offers containers beside them (design24 section 3)."""

from __future__ import annotations

import pytest

from agent.discovery.inventory import NodeInventory
from dra_driver.device_model import (
    GIB,
    AdvertisedDevice,
    DeviceModel,
    DevicePolicy,
    advertised_devices,
)
from dra_driver.vm_devices import gpu_selector, vgpu_type_name
from tests.dra_driver.conftest import Fits, Inventory
from tests.dra_driver.vm_inventories import H200_TYPES, passthrough, vgpu

PASSTHROUGH = DevicePolicy(virtualization="passthrough")
VGPU = DevicePolicy(virtualization="vgpu")


def attrs(dev: AdvertisedDevice) -> dict[str, object]:
    return {k: next(iter(v.values())) for k, v in dev.attributes}


def consumed(dev: AdvertisedDevice) -> dict[str, dict[str, int]]:
    return {s: {c: int(q) for c, q in counters} for s, counters in dev.consumes_counters}


def counter_sets(model: DeviceModel) -> dict[str, dict[str, int]]:
    return {cs.name: {c: int(q) for c, q in cs.counters} for cs in model.counter_sets}


def names(model: DeviceModel) -> list[str]:
    return [d.name for d in model.devices]


# -- passthrough ---------------------------------------------------------------------------------


def test_each_gpu_is_also_a_vfio_device_after_its_whole_gpu(inventory: Inventory) -> None:
    inv = passthrough(inventory("dgx-h100"))
    model = advertised_devices(inv, PASSTHROUGH)
    assert names(model) == [n for i in range(8) for n in (f"gpu-{i}", f"gpu-{i}-vfio")]
    gpu0 = inv.gpus[0]
    vfio = model.device("gpu-0-vfio")
    whole = model.device("gpu-0")
    a = attrs(vfio)
    assert a["type"] == "vfio"
    assert a["uuid"] == gpu0.device.uuid == vfio.uuid == vfio.parent_uuid
    assert (a["pciVendorID"], a["pciDeviceID"], a["iommuGroup"]) == ("10de", "2330", 40)
    assert a["resource.kubernetes.io/pciBusID"] == gpu0.pcie.bus_id == vfio.bus_id
    assert a["resource.kubernetes.io/pcieRoot"] == gpu0.pcie.pcie_root
    assert a["resource.kubernetes.io/numaNode"] == gpu0.pcie.numa_node
    assert a["productName"] == "NVIDIA H100 80GB HBM3" and a["architecture"] == "Hopper"
    assert "cudaDriverVersion" not in a  # the guest runs its own driver
    assert "sharing" not in a and "powerLimitMaxWatts" not in a  # container-side settings
    assert (vfio.kind, vfio.iommu_group, vfio.vgpu_type) == ("vfio", 40, None)
    assert dict(vfio.capacity) == {"memory": str(gpu0.device.memory.total)}
    # one counter set per GPU: all its memory; the whole GPU and the vfio device take all of it
    total = gpu0.device.memory.total
    assert counter_sets(model)["gpu-0-counter-set"] == {"memory": total}
    assert len(model.counter_sets) == 8
    assert consumed(vfio) == consumed(whole) == {"gpu-0-counter-set": {"memory": total}}
    # the whole GPU is otherwise what it was
    plain = advertised_devices(inventory("dgx-h100"), DevicePolicy()).device("gpu-0")
    assert (whole.attributes, whole.capacity) == (plain.attributes, plain.capacity)


def test_the_vfio_device_and_the_whole_gpu_never_fit_together(
    inventory: Inventory, fits: Fits
) -> None:
    model = advertised_devices(passthrough(inventory("l40s-pcie")), PASSTHROUGH)
    for i in range(4):
        vfio, whole = model.device(f"gpu-{i}-vfio"), model.device(f"gpu-{i}")
        assert fits(model, [vfio]) and fits(model, [whole])
        assert not fits(model, [vfio, whole])
    assert fits(model, [model.device("gpu-0-vfio"), model.device("gpu-1")])


def test_dynamic_mig_vfio_consumes_every_counter_of_the_gpu(
    inventory: Inventory, fits: Fits
) -> None:
    inv = inventory("dgx-h100")
    dynamic = DevicePolicy(mig_mode="dynamic")
    model = advertised_devices(
        passthrough(inv), DevicePolicy(mig_mode="dynamic", virtualization="passthrough")
    )
    # the counter sets are dynamic MIG's, unchanged; the vfio device takes each counter in full
    assert model.counter_sets == advertised_devices(inv, dynamic).counter_sets
    vfio = model.device("gpu-0-vfio")
    assert consumed(vfio) == {"gpu-0-counter-set": counter_sets(model)["gpu-0-counter-set"]}
    gpu0 = [n for n in names(model) if n.startswith("gpu-0-") or n == "gpu-0"]
    assert gpu0[0] == "gpu-0" and gpu0[-1] == "gpu-0-vfio"  # after its placements
    for dev in model.devices:
        if dev.gpu_minor == 0 and dev is not vfio:
            assert fits(model, [dev]) and not fits(model, [vfio, dev]), dev.name


def test_dynamic_mode_gpus_without_mig_get_the_memory_counter_set(
    inventory: Inventory, fits: Fits
) -> None:
    """--mig-mode dynamic on GPUs that have no MIG (L40S): as in static mode."""
    inv = passthrough(inventory("l40s-pcie"))
    model = advertised_devices(inv, DevicePolicy(mig_mode="dynamic", virtualization="passthrough"))
    assert model == advertised_devices(inv, PASSTHROUGH)
    assert not fits(model, [model.device("gpu-3"), model.device("gpu-3-vfio")])


def test_a_gpu_without_an_iommu_group_gets_no_vfio_device_and_no_counters(
    inventory: Inventory,
) -> None:
    inv = passthrough(inventory("l40s-pcie"), no_iommu=(1,))
    model = advertised_devices(inv, PASSTHROUGH)
    assert "gpu-1-vfio" not in names(model) and "gpu-0-vfio" in names(model)
    assert model.device("gpu-1").consumes_counters == ()
    assert "gpu-1-counter-set" not in counter_sets(model)


def test_static_mig_gpus_get_no_vfio_device(inventory: Inventory) -> None:
    """Existing MIG devices consume no counters: a VM could not be kept off them."""
    in_mig = advertised_devices(passthrough(inventory("dgx-a100")), PASSTHROUGH)
    assert not [d for d in in_mig.devices if d.kind == "vfio"] and in_mig.counter_sets == ()
    mig_off = advertised_devices(passthrough(inventory("dgx-a100", "none")), PASSTHROUGH)
    assert [d.name for d in mig_off.devices if d.kind == "vfio"] == [
        f"gpu-{i}-vfio" for i in range(8)
    ]
    assert attrs(mig_off.device("gpu-0-vfio"))["pciDeviceID"] == "20b0"


def test_without_virtualization_the_model_is_what_it_was(inventory: Inventory) -> None:
    """Discovery's VM facts change nothing unless --virtualization asks for VM devices."""
    for policy in (DevicePolicy(), DevicePolicy(mig_mode="dynamic")):
        inv = inventory("dgx-h100")
        assert advertised_devices(passthrough(inv), policy) == advertised_devices(inv, policy)
    # and --virtualization without discovery's facts (a GPU it could not read) offers nothing
    inv = inventory("l40s-pcie")
    assert advertised_devices(inv, PASSTHROUGH) == advertised_devices(inv, DevicePolicy())


@pytest.mark.parametrize("how", ["minor", "uuid", "nvml-bus-id", "short-bus-id"])
def test_virtualization_gpus_chooses_the_gpus(inventory: Inventory, how: str) -> None:
    inv = passthrough(inventory("dgx-h100"))
    two, five = inv.gpus[2], inv.gpus[5]
    named = {
        "minor": ("2", "5"),
        "uuid": (two.device.uuid.upper(), five.device.uuid),
        "nvml-bus-id": (two.device.pci_bus_id, five.device.pci_bus_id),
        "short-bus-id": (two.pcie.bus_id[5:], five.pcie.bus_id[5:]),
    }[how]
    policy = DevicePolicy(virtualization="passthrough", virtualization_gpus=named)
    model = advertised_devices(inv, policy)
    assert [d.name for d in model.devices if d.kind == "vfio"] == ["gpu-2-vfio", "gpu-5-vfio"]
    assert sorted(counter_sets(model)) == ["gpu-2-counter-set", "gpu-5-counter-set"]
    assert model.device("gpu-0").consumes_counters == ()


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("3", "3"),
        ("007", "7"),
        ("GPU-ABCDEF01-2345-6789-abcd-ef0123456789", "gpu-abcdef01-2345-6789-abcd-ef0123456789"),
        ("0000:1B:00.0", "0000:1b:00.0"),
        ("00000000:1B:00.0", "0000:1b:00.0"),
        ("1b:00.0", "0000:1b:00.0"),
    ],
)
def test_gpu_selector_canonical_forms(raw: str, canonical: str) -> None:
    assert gpu_selector(raw) == canonical


@pytest.mark.parametrize("raw", ["", "gpu0", "GPU-123", "1b:00", "0000:1b:20.0", "1b:00.8", "-1"])
def test_gpu_selector_refuses_what_names_no_gpu(raw: str) -> None:
    with pytest.raises(ValueError, match=r"is not a GPU: give its minor .* UUID .* PCI address"):
        gpu_selector(raw)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (DevicePolicy(virtualization="kvm"), "virtualization 'kvm': expected one of none, "),
        (
            DevicePolicy(virtualization="passthrough", sharing="time-slicing"),
            "with sharing 'time-slicing'",
        ),
        (DevicePolicy(virtualization="vgpu", mig_mode="dynamic"), "vGPU GPUs have no MIG"),
    ],
)
def test_policies_the_model_refuses(
    inventory: Inventory, policy: DevicePolicy, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        advertised_devices(inventory("l40s-pcie"), policy)


# -- vGPU ----------------------------------------------------------------------------------------


def h200_vgpu(inventory: Inventory, **kw: object) -> NodeInventory:
    return vgpu(inventory("hgx-h200"), H200_TYPES, **kw)  # type: ignore[arg-type]


def test_vgpu_devices_per_type_and_instance_and_no_whole_gpu(inventory: Inventory) -> None:
    inv = h200_vgpu(inventory)
    model = advertised_devices(inv, VGPU)
    gpu0 = [n for n in names(model) if n.startswith("gpu-0-")]
    assert gpu0 == [
        *[f"gpu-0-vgpu-1431-{k}" for k in range(8)],  # 17C, smallest first
        *[f"gpu-0-vgpu-1430-{k}" for k in range(4)],
        *[f"gpu-0-vgpu-1429-{k}" for k in range(2)],
        "gpu-0-vgpu-1428-0",
    ]
    assert len(model.devices) == 8 * 15 and {d.kind for d in model.devices} == {"vgpu"}
    dev, g = model.device("gpu-0-vgpu-1430-3"), inv.gpus[0]
    a = attrs(dev)
    assert a["type"] == "vgpu" and a["vgpuType"] == "H200X-35C"
    assert (a["vgpuTypeID"], a["maxInstances"]) == (1430, 4)
    assert a["parentUUID"] == g.device.uuid and a["parentPciBusID"] == g.pcie.bus_id
    assert a["resource.kubernetes.io/pcieRoot"] == g.pcie.pcie_root
    assert a["resource.kubernetes.io/numaNode"] == g.pcie.numa_node
    assert (a["productName"], a["architecture"]) == ("NVIDIA H200", "Hopper")
    # its own PCI address (a VF's) is known at prepare only: the KEP-5304 metadata gives it
    assert "resource.kubernetes.io/pciBusID" not in a and "uuid" not in a
    assert (dev.uuid, dev.bus_id, dev.vgpu_type) == (None, g.pcie.bus_id, H200_TYPES[2])
    assert dict(dev.capacity) == {"memory": str(35 * GIB)}
    assert consumed(dev) == {"gpu-0-counter-set": {"framebuffer": 35 * GIB}}
    # the most any one type can take: 1 x 141 GiB
    assert counter_sets(model)["gpu-0-counter-set"] == {"framebuffer": 141 * GIB}


def test_vgpu_counters_let_the_scheduler_take_only_what_the_gpu_hosts(
    inventory: Inventory, fits: Fits
) -> None:
    model = advertised_devices(h200_vgpu(inventory), VGPU)

    def of(type_id: int, count: int, minor: int = 0) -> list[AdvertisedDevice]:
        return [model.device(f"gpu-{minor}-vgpu-{type_id}-{k}") for k in range(count)]

    assert fits(model, of(1431, 8)) and fits(model, of(1429, 2)) and fits(model, of(1428, 1))
    assert not fits(model, [*of(1428, 1), *of(1431, 1)])  # the whole framebuffer is taken
    assert fits(model, [*of(1428, 1), *of(1431, 8, minor=1)])  # another GPU's


def test_a_homogeneous_gpu_hosting_a_vgpu_offers_only_its_type(inventory: Inventory) -> None:
    model = advertised_devices(h200_vgpu(inventory, hosted={0: 1430}), VGPU)
    assert [n for n in names(model) if n.startswith("gpu-0-")] == [
        f"gpu-0-vgpu-1430-{k}" for k in range(4)
    ]
    assert counter_sets(model)["gpu-0-counter-set"] == {"framebuffer": 4 * 35 * GIB}
    assert len([n for n in names(model) if n.startswith("gpu-1-")]) == 15
    mixed = advertised_devices(h200_vgpu(inventory, hosted={0: 1430}, heterogeneous=True), VGPU)
    assert len([n for n in names(mixed) if n.startswith("gpu-0-")]) == 15


def test_vgpu_mode_leaves_gpus_without_the_vgpu_host_driver_as_they_were(
    inventory: Inventory,
) -> None:
    inv = passthrough(inventory("dgx-h100"))  # VFIO-capable, no vGPU host driver
    assert advertised_devices(inv, VGPU) == advertised_devices(inv, DevicePolicy())


def test_vgpu_gpus_not_chosen_offer_nothing(inventory: Inventory) -> None:
    """A GPU under the vGPU host driver runs no CUDA on the host: not chosen, it offers
    neither vGPUs nor a whole GPU."""
    policy = DevicePolicy(virtualization="vgpu", virtualization_gpus=("1",))
    model = advertised_devices(h200_vgpu(inventory), policy)
    assert {d.gpu_minor for d in model.devices} == {1}
    assert [cs.name for cs in model.counter_sets] == ["gpu-1-counter-set"]


@pytest.mark.parametrize(
    ("name", "short"),
    [("NVIDIA H200X-35C", "H200X-35C"), ("GRID T4-4Q", "T4-4Q"), ("A100-1-5C", "A100-1-5C")],
)
def test_vgpu_type_names_lose_the_driver_prefix(name: str, short: str) -> None:
    from agent.pcihost.vm_types import VgpuType

    assert vgpu_type_name(VgpuType(1, name, GIB, 1)) == short
