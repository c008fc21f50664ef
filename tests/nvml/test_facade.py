"""The NVML facade against the simulator, and against the real pynvml where that is meaningful."""

from typing import Any

import pynvml
import pytest

from agent.nvml.errors import DriverNotFoundError, NvmlError, NvmlInvalidArgument, NvmlNotSupported
from agent.nvml.facade import Nvml, nvml_bus_id, sysfs_bus_id
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from agent.sim.specs import gpu_specs
from tests.hardware import needs_no_driver

MIB = 1024 * 1024


def facade(tmp_path, model: str, **kw: Any) -> Nvml:
    nv = Nvml(FakeNvml(load_model(model), tmp_path, **kw))
    nv.init()
    return nv


def test_bus_id_forms_round_trip():
    assert sysfs_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert sysfs_bus_id(b"00000000:1B:00.0") == "0000:1b:00.0"
    assert nvml_bus_id("0000:1b:00.0") == "00000000:1B:00.0"


@needs_no_driver
def test_real_pynvml_without_driver_is_driver_not_found():
    """Without libnvidia-ml the production module must say 'no driver'."""
    with pytest.raises(DriverNotFoundError, match="no NVIDIA driver"):
        Nvml(pynvml).init()


def test_system_versions(tmp_path):
    s = facade(tmp_path, "dgx-h100").system()
    assert s.driver_version == "550.90.07"
    assert s.cuda_driver_version == "12.4"


def test_h100_identity_and_mig_profiles(tmp_path):
    nv = facade(tmp_path, "dgx-h100")
    devs = nv.devices()
    assert len(devs) == 8
    d = devs[0]
    assert d.name == "NVIDIA H100 80GB HBM3"
    assert d.pci_bus_id == "0000:1b:00.0"
    assert d.pci_device_id == 0x233010DE
    assert d.architecture == "Hopper"
    assert d.compute_capability == (9, 0)
    assert d.memory.total == 81559 * MIB
    assert d.memory.reserved is not None
    assert d.uuid.startswith("GPU-")
    assert [x.minor for x in devs] == list(range(8))
    assert d.mig_capable and not d.mig_enabled
    assert d.mig_instances == ()
    spec = gpu_specs()["H100-SXM5-80GB"]
    got = {p.profile_id: p for p in d.mig_profiles}
    assert set(got) == {p.profile_id for p in spec.mig_profiles}
    for ps in spec.mig_profiles:
        p = got[ps.profile_id]
        assert p.name == ps.name
        assert p.memory_bytes == ps.memory_mib * MIB
        assert p.multiprocessors == ps.multiprocessors
        assert [pl.start for pl in p.placements] == list(ps.placement_starts)
        assert {pl.size for pl in p.placements} == {ps.memory_slots}


def test_h100_nvlinks_all_go_to_switches(tmp_path):
    d = facade(tmp_path, "dgx-h100").device(3)
    active = [link for link in d.nvlinks if link.active]
    assert len(active) == 18
    assert {link.remote_device_type for link in active} == {"switch"}


def test_a100_balanced_mig_instances(tmp_path):
    d = facade(tmp_path, "dgx-a100").device(0)
    assert d.mig_enabled
    assert sorted(m.profile_name for m in d.mig_instances) == [
        "1g.5gb",
        "1g.5gb",
        "2g.10gb",
        "3g.20gb",
    ]
    for m in d.mig_instances:
        assert m.uuid.startswith("MIG-")
        assert m.memory_bytes > 0
    assert len({m.gpu_instance_id for m in d.mig_instances}) == 4
    placements = sorted((m.placement.start, m.placement.size) for m in d.mig_instances)
    slots = [s for start, size in placements for s in range(start, start + size)]
    assert len(slots) == len(set(slots)), "MIG instances overlap"


def test_pcie_gpus_have_no_mig_and_no_nvlink(tmp_path):
    d = facade(tmp_path, "l40s-pcie").device(0)
    assert d.mig_mode is None and d.mig_profiles == () and d.nvlinks == ()
    assert d.architecture == "Ada Lovelace"


def test_bridged_pair_links_point_at_the_peer(tmp_path):
    nv = facade(tmp_path, "mixed")
    a, b = nv.device(0), nv.device(1)
    assert {link.remote_pci_bus_id for link in a.nvlinks if link.active} == {b.pci_bus_id}
    assert {link.remote_device_type for link in a.nvlinks if link.active} == {"gpu"}
    assert sum(link.active for link in a.nvlinks) == 12
    assert nv.device(2).nvlinks == ()


def test_errors_name_the_call_and_device(tmp_path):
    nv = facade(tmp_path, "dgx-h100")
    with pytest.raises(NvmlInvalidArgument) as e:
        nv.device(42)
    assert e.value.call == "nvmlDeviceGetHandleByIndex"
    assert e.value.device == "42"
    assert "GPU 42" in str(e.value)


def test_calls_before_init_fail_with_nvml_error(tmp_path):
    nv = Nvml(FakeNvml(load_model("dgx-h100"), tmp_path))
    with pytest.raises(NvmlError) as e:
        nv.device_count()
    assert e.value.code == pynvml.NVML_ERROR_UNINITIALIZED


class Unsupporting:
    """A pynvml-shaped module whose listed calls answer NOT_SUPPORTED (an older GPU/driver)."""

    def __init__(self, inner: Any, unsupported: set[str]) -> None:
        self._inner = inner
        self._unsupported = unsupported

    def __getattr__(self, name: str) -> Any:
        if name in self._unsupported:

            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

            return refuse
        return getattr(self._inner, name)


def test_optional_fields_are_absent_not_errors(tmp_path):
    fake = FakeNvml(load_model("dgx-h100"), tmp_path)
    nv = Nvml(Unsupporting(fake, {"nvmlDeviceGetSerial", "nvmlSystemGetNVMLVersion"}))
    nv.init()
    d = nv.device(0)
    assert d.serial is None
    assert nv.system().nvml_version is None


def test_memory_falls_back_to_v1_without_reserved(tmp_path):
    fake = FakeNvml(load_model("dgx-h100"), tmp_path)

    class NoV2(Unsupporting):
        def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
            if version:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return self._inner.nvmlDeviceGetMemoryInfo(handle)

    nv = Nvml(NoV2(fake, set()))
    nv.init()
    m = nv.device(0).memory
    assert m.total == 81559 * MIB and m.reserved is None


def test_required_field_not_supported_is_an_error(tmp_path):
    fake = FakeNvml(load_model("dgx-h100"), tmp_path)
    nv = Nvml(Unsupporting(fake, {"nvmlDeviceGetUUID"}))
    nv.init()
    with pytest.raises(NvmlNotSupported, match="nvmlDeviceGetUUID"):
        nv.device(0)


# -- Nvml.api(): the typed, error-translating NVML API -------------------------------------------


def test_api_errors_name_the_call_and_the_device(tmp_path):
    nv = facade(tmp_path, "dgx-h100")
    with pytest.raises(NvmlInvalidArgument) as e:
        nv.api("3").nvmlDeviceGetHandleByIndex(42)
    assert (e.value.call, e.value.device, e.value.code) == ("nvmlDeviceGetHandleByIndex", "3", 2)
    assert str(e.value).startswith("nvmlDeviceGetHandleByIndex on GPU 3 failed:")
    assert isinstance(e.value.__cause__, pynvml.NVMLError_InvalidArgument)
    with pytest.raises(NvmlInvalidArgument) as e:
        nv.api().nvmlDeviceGetHandleByIndex(42)
    assert e.value.device is None and " on GPU " not in str(e.value)


def test_api_answers_as_the_module_and_passes_its_constants_and_types(tmp_path):
    fake = FakeNvml(load_model("dgx-a100"), tmp_path)
    nv = Nvml(fake)
    nv.init()
    api = nv.api("0")
    assert nv.api("0") is api and nv.api("1") is not api
    h = api.nvmlDeviceGetHandleByIndex(0)
    assert api.nvmlDeviceGetUUID(h) == fake.nvmlDeviceGetUUID(h)
    assert api.nvmlDeviceGetMemoryInfo(h, api.nvmlMemory_v2).reserved == 512 * MIB
    assert api.nvmlDeviceGetMemoryInfo(handle=h).total == 40960 * MIB  # pynvml's keywords
    assert api.NVMLError is pynvml.NVMLError
    assert api.c_nvmlGpmMetricsGet_t is pynvml.c_nvmlGpmMetricsGet_t
    assert api.NVML_NVLINK_MAX_LINKS == pynvml.NVML_NVLINK_MAX_LINKS


class Older(Unsupporting):
    """pynvml before some calls existed: the listed names are missing from the module."""

    def __getattr__(self, name: str) -> Any:
        if name in self._unsupported:
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_call_the_module_lacks_is_missing_from_the_api(tmp_path):
    fake = FakeNvml(load_model("dgx-h100"), tmp_path)
    nv = Nvml(Older(fake, {"nvmlGpmMigSampleGet"}))
    assert not hasattr(nv.api("0"), "nvmlGpmMigSampleGet")
    assert hasattr(nv.api("0"), "nvmlGpmSampleAlloc")


class Mismatched(Unsupporting):
    """pynvml newer than the driver: the listed unversioned calls raise NVMLLibraryMismatchError."""

    def __getattr__(self, name: str) -> Any:
        if name in self._unsupported:

            def mismatch(*args: Any, **kwargs: Any) -> Any:
                raise pynvml.NVMLLibraryMismatchError(f"{name} is not in this driver")

            return mismatch
        return getattr(self._inner, name)


def test_a_library_mismatch_is_not_supported(tmp_path):
    fake = FakeNvml(load_model("dgx-h100"), tmp_path)
    nv = Nvml(Mismatched(fake, {"nvmlDeviceGetSerial"}))
    nv.init()
    assert nv.device(0).serial is None  # optional: absent
    with pytest.raises(NvmlNotSupported) as e:
        nv.api("0").nvmlDeviceGetSerial(nv.handle(0))
    assert (e.value.call, e.value.device, e.value.code) == ("nvmlDeviceGetSerial", "0", 13)
