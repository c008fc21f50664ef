"""FakeNvml answers like pynvml on a real node of each model: values, types, units and errors."""

import ctypes
from dataclasses import dataclass

import pynvml
import pytest

from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml

MIB = 1024 * 1024


@dataclass(frozen=True)
class Expect:
    names: list[str]
    buses: list[str]  # NVML form
    cc: list[tuple[int, int]]
    arch: list[int]
    memory_mib: list[int]
    driver: str
    cuda: int
    pci_device_ids: list[int]


def nvml_buses(buses: str) -> list[str]:
    """``"1B 43"`` -> NVML bus ids ``["00000000:1B:00.0", "00000000:43:00.0"]``."""
    return [f"00000000:{b}:00.0" for b in buses.split()]


def same(n: int, value):
    return [value] * n


EXPECT = {
    "dgx-h100": Expect(
        names=same(8, "NVIDIA H100 80GB HBM3"),
        buses=nvml_buses("1B 43 52 61 9D C3 D1 DF"),
        cc=same(8, (9, 0)),
        arch=same(8, pynvml.NVML_DEVICE_ARCH_HOPPER),
        memory_mib=same(8, 81559),
        driver="550.90.07",
        cuda=12040,
        pci_device_ids=same(8, 0x233010DE),
    ),
    "dgx-a100": Expect(
        names=same(8, "NVIDIA A100-SXM4-40GB"),
        buses=nvml_buses("07 0F 47 4E 87 90 B7 BD"),
        cc=same(8, (8, 0)),
        arch=same(8, pynvml.NVML_DEVICE_ARCH_AMPERE),
        memory_mib=same(8, 40960),
        driver="550.90.07",
        cuda=12040,
        pci_device_ids=same(8, 0x20B010DE),
    ),
    "hgx-h200": Expect(
        names=same(8, "NVIDIA H200"),
        buses=nvml_buses("18 2A 3A 5D 9A AB BA DB"),
        cc=same(8, (9, 0)),
        arch=same(8, pynvml.NVML_DEVICE_ARCH_HOPPER),
        memory_mib=same(8, 143771),
        driver="560.35.03",
        cuda=12060,
        pci_device_ids=same(8, 0x233510DE),
    ),
    "l40s-pcie": Expect(
        names=same(4, "NVIDIA L40S"),
        buses=nvml_buses("19 1A CD CE"),
        cc=same(4, (8, 9)),
        arch=same(4, pynvml.NVML_DEVICE_ARCH_ADA),
        memory_mib=same(4, 46068),
        driver="550.90.07",
        cuda=12040,
        pci_device_ids=same(4, 0x26B910DE),
    ),
    "mixed": Expect(
        names=["NVIDIA A100 80GB PCIe"] * 2 + ["NVIDIA L4"] * 2,
        buses=nvml_buses("3D 3E B3 B4"),
        cc=[(8, 0), (8, 0), (8, 9), (8, 9)],
        arch=[7, 7, 8, 8],
        memory_mib=[81920, 81920, 23034, 23034],
        driver="550.90.07",
        cuda=12040,
        pci_device_ids=[0x20B510DE, 0x20B510DE, 0x27B810DE, 0x27B810DE],
    ),
}


@pytest.mark.parametrize("model", list(EXPECT), ids=str)
def test_identity(make_fake, model):
    fake, want = make_fake(model), EXPECT[model]
    assert fake.nvmlSystemGetDriverVersion() == want.driver
    assert fake.nvmlSystemGetCudaDriverVersion_v2() == want.cuda
    assert fake.nvmlSystemGetCudaDriverVersion() == want.cuda
    assert fake.nvmlSystemGetNVMLVersion() == f"{want.cuda // 1000}.{want.driver}"
    n = fake.nvmlDeviceGetCount()
    assert n == len(want.names)
    handles = [fake.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    assert all(isinstance(h, pynvml.c_nvmlDevice_t) for h in handles)
    assert [fake.nvmlDeviceGetName(h) for h in handles] == want.names
    assert [fake.nvmlDeviceGetIndex(h) for h in handles] == list(range(n))
    assert [fake.nvmlDeviceGetMinorNumber(h) for h in handles] == list(range(n))
    assert [fake.nvmlDeviceGetCudaComputeCapability(h) for h in handles] == want.cc
    assert [fake.nvmlDeviceGetArchitecture(h) for h in handles] == want.arch
    brands = [g.spec.brand for g in load_model(model).gpus]
    assert [fake.nvmlDeviceGetBrand(h) for h in handles] == brands
    pci = [fake.nvmlDeviceGetPciInfo(h) for h in handles]
    assert all(isinstance(p, pynvml.nvmlPciInfo_t) for p in pci)
    assert [p.busId for p in pci] == want.buses  # str: pynvml's struct decodes char arrays
    assert [p.busIdLegacy for p in pci] == [b[4:] for b in want.buses]
    assert [p.pciDeviceId for p in pci] == want.pci_device_ids
    assert [(p.domain, p.bus, p.device) for p in pci] == [
        (0, int(b[9:11], 16), 0) for b in want.buses
    ]
    mem = [fake.nvmlDeviceGetMemoryInfo(h) for h in handles]
    assert all(isinstance(m, pynvml.c_nvmlMemory_t) for m in mem)
    assert [m.total for m in mem] == [x * MIB for x in want.memory_mib]  # bytes
    uuids = [fake.nvmlDeviceGetUUID(h) for h in handles]
    assert all(isinstance(u, str) and u.startswith("GPU-") for u in uuids)
    assert len(set(uuids)) == n
    serials = [fake.nvmlDeviceGetSerial(h) for h in handles]
    assert all(isinstance(s, str) and s.isdigit() for s in serials)


def test_memory_v2_has_reserved_and_adds_up(make_fake):
    fake = make_fake("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    v2 = fake.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)
    assert isinstance(v2, pynvml.c_nvmlMemory_v2_t)
    assert v2.version == pynvml.nvmlMemory_v2
    assert v2.total == 81559 * MIB and v2.reserved > 0
    assert v2.free + v2.used + v2.reserved == v2.total
    v1 = fake.nvmlDeviceGetMemoryInfo(h)
    assert v1.free == v2.free and v1.used == v2.used + v2.reserved
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        fake.nvmlDeviceGetMemoryInfo(h, 1)


def test_handles_by_pci_bus_id_and_uuid(make_fake):
    fake = make_fake("dgx-h100")
    h3 = fake.nvmlDeviceGetHandleByIndex(3)
    for form in ("00000000:61:00.0", "0000:61:00.0", b"0000:61:00.0", "61:00.0", "0:61:0"):
        assert fake.nvmlDeviceGetHandleByPciBusId(form) == h3, form
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetHandleByPciBusId("0000:62:00.0")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByPciBusId("not a bus id")
    uuid = fake.nvmlDeviceGetUUID(h3)
    assert fake.nvmlDeviceGetHandleByUUID(uuid) == h3
    assert fake.nvmlDeviceGetHandleByUUID(uuid.encode()) == h3
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")


def test_numa_node_id_is_not_supported_on_x86(make_fake):
    fake = make_fake("dgx-h100")
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetNumaNodeId(fake.nvmlDeviceGetHandleByIndex(0))


# -- MIG device handles ---------------------------------------------------------------------------


def test_mig_device_handles_and_uuids(make_fake, tmp_path):
    fake = make_fake("dgx-a100")  # balanced by default
    h = fake.nvmlDeviceGetHandleByIndex(1)
    migs = [fake.nvmlDeviceGetMigDeviceHandleByIndex(h, i) for i in range(4)]
    for i in range(4, 7):
        with pytest.raises(pynvml.NVMLError_NotFound):
            fake.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(h, 7)
    assert all(isinstance(m, pynvml.c_nvmlDevice_t) for m in migs)
    flag = fake.nvmlDeviceIsMigDeviceHandle(migs[0])
    assert isinstance(flag, ctypes.c_uint) and flag.value == 1
    assert fake.nvmlDeviceIsMigDeviceHandle(h).value == 0
    assert all(fake.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m) == h for m in migs)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)
    assert [fake.nvmlDeviceGetGpuInstanceId(m) for m in migs] == [1, 2, 3, 4]
    assert [fake.nvmlDeviceGetComputeInstanceId(m) for m in migs] == [0, 0, 0, 0]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetGpuInstanceId(h)
    names = [fake.nvmlDeviceGetName(m) for m in migs]
    assert names == [
        f"NVIDIA A100-SXM4-40GB MIG {p}" for p in ("3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb")
    ]
    assert [fake.nvmlDeviceGetMemoryInfo(m).total for m in migs] == [
        x * MIB for x in (20096, 9984, 4864, 4864)
    ]
    uuids = [fake.nvmlDeviceGetUUID(m) for m in migs]
    assert all(u.startswith("MIG-") for u in uuids) and len(set(uuids)) == 4
    assert fake.nvmlDeviceGetHandleByUUID(uuids[2]) == migs[2]
    # deterministic: another node of the same model has the same UUIDs
    other = FakeNvml(load_model("dgx-a100"), tmp_path / "other")
    other.nvmlInit()
    oh = other.nvmlDeviceGetHandleByIndex(1)
    assert [
        other.nvmlDeviceGetUUID(other.nvmlDeviceGetMigDeviceHandleByIndex(oh, i)) for i in range(4)
    ] == uuids
    # calls that need a whole GPU refuse a MIG device handle
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetMigMode(migs[0])


def test_gpu_instances_listing_fills_a_ctypes_array(make_fake):
    fake = make_fake("dgx-a100", mig_layout="all-1g")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    info = fake.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    arr = (pynvml.c_nvmlGpuInstance_t * info.instanceCount)()
    n = ctypes.c_uint()
    assert fake.nvmlDeviceGetGpuInstances(h, info.id, arr, ctypes.byref(n)) == pynvml.NVML_SUCCESS
    assert n.value == 7
    gi_infos = [fake.nvmlGpuInstanceGetInfo(arr[i]) for i in range(7)]
    assert [i.id for i in gi_infos] == list(range(1, 8))
    assert sorted(i.placement.start for i in gi_infos) == list(range(7))
    assert all(fake.nvmlDeviceGetIndex(i.device) == 0 for i in gi_infos)  # parent in the struct
    ci = fake.nvmlGpuInstanceGetComputeInstanceById(arr[0], 0)
    ci_info = fake.nvmlComputeInstanceGetInfo(ci)
    assert fake.nvmlGpuInstanceGetInfo(ci_info.gpuInstance).id == 1


# -- NVLink ---------------------------------------------------------------------------------------


def links(fake, index):
    """[(state, remote NVML bus id, remote type)] of the GPU's links until NVML says no more."""
    h = fake.nvmlDeviceGetHandleByIndex(index)
    out = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            state = fake.nvmlDeviceGetNvLinkState(h, link)
        except pynvml.NVMLError_InvalidArgument:
            break
        if not state:
            out.append((0, None, None))
            continue
        remote = fake.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
        assert isinstance(remote, pynvml.nvmlPciInfo_t)
        out.append((1, remote.busId, fake.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)))
    return out


@pytest.mark.parametrize(("model", "count"), [("dgx-h100", 18), ("dgx-a100", 12), ("hgx-h200", 18)])
def test_nvswitch_nodes_every_link_goes_to_a_switch(make_fake, model, count):
    fake = make_fake(model)
    switches = {f"0000{s.bus.upper()}" for s in load_model(model).nvswitches}
    for i in range(fake.nvmlDeviceGetCount()):
        got = links(fake, i)
        assert len(got) == count
        assert {state for state, _, _ in got} == {1}
        assert {t for _, _, t in got} == {pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH}
        remote = [bus for _, bus, _ in got]
        assert set(remote) == switches
        # spread over all switches, evenly within one link
        per_switch = [remote.count(b) for b in set(remote)]
        assert max(per_switch) - min(per_switch) <= 1


def test_bridged_a100_pair_and_l4s(make_fake):
    fake = make_fake("mixed")
    assert links(fake, 0) == [(1, "00000000:3E:00.0", pynvml.NVML_NVLINK_DEVICE_TYPE_GPU)] * 12
    assert links(fake, 1) == [(1, "00000000:3D:00.0", pynvml.NVML_NVLINK_DEVICE_TYPE_GPU)] * 12
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetNvLinkRemotePciInfo(h, 0).pciDeviceId == 0x20B510DE
    for index in (2, 3):
        h = fake.nvmlDeviceGetHandleByIndex(index)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            fake.nvmlDeviceGetNvLinkState(h, 0)


@pytest.mark.parametrize("index", range(4), ids=lambda i: f"gpu{i}")
def test_pcie_l40s_has_no_nvlink(make_fake, index):
    fake = make_fake("l40s-pcie")
    h = fake.nvmlDeviceGetHandleByIndex(index)
    for call in (
        fake.nvmlDeviceGetNvLinkState,
        fake.nvmlDeviceGetNvLinkRemotePciInfo,
        fake.nvmlDeviceGetNvLinkRemoteDeviceType,
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(h, 0)


@pytest.mark.parametrize("link", [18, 35, 36, -1], ids=str)
def test_links_beyond_the_product_are_invalid(make_fake, link):
    fake = make_fake("dgx-h100")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetNvLinkState(fake.nvmlDeviceGetHandleByIndex(0), link)


# -- lifecycle and bad arguments ------------------------------------------------------------------

BEFORE_INIT = {
    "count": lambda f: f.nvmlDeviceGetCount(),
    "handle": lambda f: f.nvmlDeviceGetHandleByIndex(0),
    "driver": lambda f: f.nvmlSystemGetDriverVersion(),
    "cuda": lambda f: f.nvmlSystemGetCudaDriverVersion_v2(),
    "uuid": lambda f: f.nvmlDeviceGetHandleByUUID("GPU-x"),
    "bus": lambda f: f.nvmlDeviceGetHandleByPciBusId("0000:1b:00.0"),
    "shutdown": lambda f: f.nvmlShutdown(),
}


@pytest.mark.parametrize("call", list(BEFORE_INIT), ids=str)
def test_calls_before_init_are_uninitialized(make_fake, call):
    fake = make_fake("dgx-h100", init=False)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        BEFORE_INIT[call](fake)


def test_handles_stop_working_after_the_last_shutdown(make_fake):
    fake = make_fake("dgx-h100")
    fake.nvmlInitWithFlags(0)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.nvmlShutdown()
    assert fake.nvmlDeviceGetName(h)  # still one init left
    fake.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetName(h)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlShutdown()


@pytest.mark.parametrize("index", [8, 99, -1], ids=str)
def test_unknown_index_is_invalid_argument(make_fake, index):
    fake = make_fake("dgx-h100")
    with pytest.raises(pynvml.NVMLError_InvalidArgument) as e:
        fake.nvmlDeviceGetHandleByIndex(index)
    assert e.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert isinstance(e.value, pynvml.NVMLError)


@pytest.mark.parametrize(
    "bogus",
    [None, 0, "GPU-0", pynvml.c_nvmlDevice_t(), pynvml.c_nvmlGpuInstance_t()],
    ids=["none", "int", "str", "null-device", "wrong-type"],
)
def test_bogus_handles_are_invalid_argument(make_fake, bogus):
    fake = make_fake("dgx-h100")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetUUID(bogus)


def test_the_fake_carries_pynvml_constants_but_not_its_functions(make_fake):
    fake = make_fake("dgx-h100")
    assert fake.NVMLError is pynvml.NVMLError
    assert fake.NVMLError_NotFound is pynvml.NVMLError_NotFound
    assert fake.NVML_ERROR_NOT_FOUND == pynvml.NVML_ERROR_NOT_FOUND
    assert fake.nvmlMemory_v2 == pynvml.nvmlMemory_v2
    assert fake.c_nvmlGpuInstancePlacement_t is pynvml.c_nvmlGpuInstancePlacement_t
    assert fake.NVML_NVLINK_MAX_LINKS == 36
    assert FakeNvml.NVML_GPU_INSTANCE_PROFILE_COUNT == pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    with pytest.raises(AttributeError, match="nvmlDeviceGetFanSpeed"):
        fake.nvmlDeviceGetFanSpeed  # noqa: B018 - not simulated
    assert not hasattr(fake, "nvmlLib")
    assert not hasattr(fake, "byref")
