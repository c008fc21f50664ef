"""The NVML facade: the only code that calls NVML.

``Nvml(api)`` takes an :class:`~agent.nvml.api.NvmlApi`: the pynvml module itself, or the
simulator (:class:`agent.sim.nvml.FakeNvml`). Discovery gets plain frozen values of
``agent.nvml.types`` from it (:meth:`Nvml.system`, :meth:`Nvml.devices`); NVML errors become
``agent.nvml.errors.Nvml*`` errors naming the call and the device; ``NotSupported`` on optional
fields yields ``None`` ("absent") instead of an error.

The other NVML readers (the telemetry reader, the XID event watcher) call NVML functions by
attribute through :meth:`Nvml.api`: the same :class:`~agent.nvml.api.NvmlApi`, every function of
which raises those errors instead of pynvml's (one wrapper, :func:`translating`). It is the one
way into the facade; nothing outside it touches the module it was given.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from agent.nvml import vgpu_types as vgpu
from agent.nvml.api import NvmlApi
from agent.nvml.api_types import DeviceHandle
from agent.nvml.errors import (
    DriverNotFoundError,
    NvmlError,
    NvmlGpuLost,
    NvmlInsufficientResources,
    NvmlInUse,
    NvmlInvalidArgument,
    NvmlNotFound,
    NvmlNotSupported,
)
from agent.nvml.types import (
    GpuDevice,
    MemoryInfo,
    MigInstance,
    MigMode,
    MigProfile,
    NvLink,
    Placement,
    PowerLimits,
    SystemInfo,
)
from agent.pcihost.vm_types import VgpuType

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
MIB = 1024 * 1024

ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
}
BRANDS = {
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "GRID",
    5: "GeForce",
    6: "Titan",
    14: "Nvidia",
}
REMOTE_TYPES = {0: "gpu", 1: "ibmnpu", 2: "switch"}

_FUNCTION_NOT_FOUND = 13
# NVML return codes (stable C ABI values) -> our error classes.
_ERROR_CLASSES: dict[int, type[NvmlError]] = {
    2: NvmlInvalidArgument,
    3: NvmlNotSupported,
    6: NvmlNotFound,
    _FUNCTION_NOT_FOUND: NvmlNotSupported,  # an older driver lacks the call
    15: NvmlGpuLost,
    19: NvmlInUse,
    23: NvmlInsufficientResources,
}
_NO_DRIVER = {9, 12}  # DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND


def text(value: str | bytes) -> str:
    """pynvml returns str from most calls but bytes from some struct fields and old versions."""
    return value.decode() if isinstance(value, bytes) else value


def sysfs_bus_id(nvml_bus_id: str | bytes) -> str:
    """``00000000:1B:00.0`` (NVML) -> ``0000:1b:00.0`` (sysfs)."""
    bus = text(nvml_bus_id).lower()
    domain, rest = bus.split(":", 1)
    return f"{domain[-4:]}:{rest}"


def nvml_bus_id(sysfs_id: str) -> str:
    """``0000:1b:00.0`` (sysfs) -> ``00000000:1B:00.0`` (NVML)."""
    domain, rest = sysfs_id.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


def translate(call: str, exc: Exception, device: str | None) -> NvmlError:
    """The ``agent.nvml.errors`` error for pynvml's ``exc`` raised by ``call`` on ``device``.

    pynvml's ``NVMLLibraryMismatchError`` (an unversioned call the driver lacks) has no code: it
    is FUNCTION_NOT_FOUND, so NotSupported, like the versioned calls' answer."""
    code = int(getattr(exc, "value", _FUNCTION_NOT_FOUND))
    cls = _ERROR_CLASSES.get(code, NvmlError)
    return cls(call, code, str(exc), device)


def translating(
    fn: Callable[P, R], call: str, device: str | None, errors: tuple[type[Exception], ...]
) -> Callable[P, R]:
    """``fn`` with the same signature, raising :func:`translate`'s error for any of ``errors``
    (pynvml's), naming ``call`` and ``device``."""

    def translated(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except errors as exc:
            raise translate(call, exc, device) from exc

    translated.__name__ = translated.__qualname__ = call
    return translated


class _Translated:
    """An :class:`NvmlApi` whose functions raise ``agent.nvml.errors`` errors naming the call and
    ``device`` (see :meth:`Nvml.api`); constants and types are the module's own.

    The first lookup of a name wraps the module's function with :func:`translating` and keeps
    it as an instance attribute, so later lookups are plain attribute reads and a call costs
    one extra frame. A name the module lacks raises AttributeError (``hasattr`` works). mypy
    takes it for an ``NvmlApi`` through ``__getattr__``; it is one because every attribute is
    the module's own or a signature-preserving wrapper of it.
    """

    def __init__(
        self, module: NvmlApi, device: str | None, errors: tuple[type[Exception], ...]
    ) -> None:
        self._module = module
        self._device = device
        self._errors = errors

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not NVML's (and never recurse on our own attributes)
            raise AttributeError(name)
        value = getattr(self._module, name)
        if callable(value) and not isinstance(value, type):
            value = translating(value, name, self._device, self._errors)
        setattr(self, name, value)
        return value


class Nvml:
    """Typed, error-translating access to NVML through an :class:`NvmlApi` (pynvml or the
    simulator)."""

    def __init__(self, module: NvmlApi) -> None:
        self._module = module
        mismatch = getattr(module, "NVMLLibraryMismatchError", None)  # not in older pynvml
        extra = (
            (mismatch,) if isinstance(mismatch, type) and issubclass(mismatch, Exception) else ()
        )
        self._errors: tuple[type[Exception], ...] = (module.NVMLError, *extra)
        self._apis: dict[str | None, NvmlApi] = {}
        self._initialized = False

    def api(self, device: str | None = None) -> NvmlApi:
        """The NVML API whose functions raise ``agent.nvml.errors`` errors naming the call and
        ``device`` (a GPU index, or None for calls about no GPU). One object per device, kept:
        look it up once, not per call."""
        api = self._apis.get(device)
        if api is None:
            api = self._apis[device] = _Translated(self._module, device, self._errors)
        return api

    # -- lifecycle -------------------------------------------------------------------------
    def init(self) -> None:
        """Initialize NVML. Raises DriverNotFoundError when no NVIDIA driver is present."""
        try:
            self._module.nvmlInit()
        except self._errors as exc:
            if getattr(exc, "value", None) in _NO_DRIVER:
                raise DriverNotFoundError(
                    "no NVIDIA driver found (libnvidia-ml.so.1 could not be loaded)"
                ) from exc
            raise translate("nvmlInit", exc, None) from exc
        self._initialized = True

    def shutdown(self) -> None:
        if self._initialized:
            self._initialized = False
            self.api().nvmlShutdown()

    def __enter__(self) -> Nvml:
        self.init()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _optional(self, fn: Callable[[], T]) -> T | None:
        """Run ``fn``; a NotSupported answer means "absent"."""
        try:
            return fn()
        except NvmlNotSupported:
            return None

    # -- system ----------------------------------------------------------------------------
    def system(self) -> SystemInfo:
        api = self.api()
        cuda = api.nvmlSystemGetCudaDriverVersion_v2()
        nvml_version = self._optional(lambda: text(api.nvmlSystemGetNVMLVersion()))
        return SystemInfo(
            driver_version=text(api.nvmlSystemGetDriverVersion()),
            cuda_driver_version=f"{cuda // 1000}.{(cuda % 1000) // 10}",
            nvml_version=nvml_version,
        )

    def device_count(self) -> int:
        return self.api().nvmlDeviceGetCount()

    def handle(self, index: int) -> DeviceHandle:
        return self.api(str(index)).nvmlDeviceGetHandleByIndex(index)

    def devices(self) -> tuple[GpuDevice, ...]:
        """Every GPU NVML sees, in NVML index order."""
        return tuple(self.device(i) for i in range(self.device_count()))

    def device(self, index: int) -> GpuDevice:
        h = self.handle(index)
        dev = str(index)
        api = self.api(dev)
        pci = api.nvmlDeviceGetPciInfo(h)
        cc_major, cc_minor = api.nvmlDeviceGetCudaComputeCapability(h)
        arch = api.nvmlDeviceGetArchitecture(h)
        brand = api.nvmlDeviceGetBrand(h)
        mig_mode = self._mig_mode(api, h)
        profiles = self._mig_profiles(api, h) if mig_mode is not None else ()
        instances = (
            self._mig_instances(api, h, dev, profiles) if mig_mode and mig_mode.current else ()
        )
        return GpuDevice(
            index=index,
            minor=api.nvmlDeviceGetMinorNumber(h),
            uuid=text(api.nvmlDeviceGetUUID(h)),
            name=text(api.nvmlDeviceGetName(h)),
            brand=BRANDS.get(brand, "Unknown"),
            architecture=ARCHITECTURES.get(arch, "Unknown"),
            compute_capability=(cc_major, cc_minor),
            pci_bus_id=sysfs_bus_id(pci.busId),
            pci_device_id=pci.pciDeviceId,
            serial=self._optional(lambda: text(api.nvmlDeviceGetSerial(h))),
            memory=self.memory(h, dev),
            mig_mode=mig_mode,
            mig_profiles=profiles,
            mig_instances=instances,
            nvlinks=self._nvlinks(api, h),
            power_limits=self._power_limits(api, h),
        )

    def _power_limits(self, api: NvmlApi, h: DeviceHandle) -> PowerLimits | None:
        """The GPU's power-limit range and default; None where NVML cannot set one."""
        constraints = self._optional(lambda: api.nvmlDeviceGetPowerManagementLimitConstraints(h))
        default = self._optional(lambda: api.nvmlDeviceGetPowerManagementDefaultLimit(h))
        if constraints is None or default is None:
            return None
        low, high = (int(v) for v in constraints)
        return PowerLimits(min_mw=low, max_mw=high, default_mw=int(default))

    def memory(self, handle: DeviceHandle, dev: str) -> MemoryInfo:
        """Memory of a GPU or MIG device handle (of GPU ``dev``); ``reserved`` only where NVML
        has v2."""
        api = self.api(dev)
        try:
            m2 = api.nvmlDeviceGetMemoryInfo(handle, api.nvmlMemory_v2)
            return MemoryInfo(m2.total, m2.free, m2.used, m2.reserved)
        except NvmlNotSupported:
            m = api.nvmlDeviceGetMemoryInfo(handle)
            return MemoryInfo(m.total, m.free, m.used)

    # -- vGPU host ---------------------------------------------------------------------------
    def vgpu_types(self, index: int) -> tuple[VgpuType, ...]:
        """The vGPU types GPU ``index`` supports; empty when it is not in vGPU host mode."""
        return vgpu.vgpu_types(self.api(str(index)), self.handle(index))

    def vgpu_heterogeneous(self, index: int) -> bool:
        """Whether vGPUs of different types may share GPU ``index``."""
        return vgpu.heterogeneous(self.api(str(index)), self.handle(index))

    def vgpu_sriov(self, index: int) -> bool | None:
        """GPU ``index``'s vGPUs are SR-IOV VFs (True), mdevs on it (False); None: no vGPUs."""
        return vgpu.sriov(self.api(str(index)), self.handle(index))

    # -- MIG -------------------------------------------------------------------------------
    def mig_mode(self, index: int) -> MigMode | None:
        """The MIG mode of GPU ``index``; None when the GPU has no MIG."""
        return self._mig_mode(self.api(str(index)), self.handle(index))

    def mig_instances(self, index: int) -> tuple[MigInstance, ...]:
        """The MIG devices (GPU instance + compute instance pairs) of GPU ``index`` now."""
        api, dev = self.api(str(index)), str(index)
        h = self.handle(index)
        if not (mode := self._mig_mode(api, h)) or not mode.current:
            return ()
        return self._mig_instances(api, h, dev, self._mig_profiles(api, h))

    def _mig_mode(self, api: NvmlApi, h: DeviceHandle) -> MigMode | None:
        mode = self._optional(lambda: api.nvmlDeviceGetMigMode(h))
        if mode is None:
            return None
        current, pending = mode
        return MigMode(current=bool(current), pending=bool(pending))

    def _mig_profiles(self, api: NvmlApi, h: DeviceHandle) -> tuple[MigProfile, ...]:
        profiles: list[MigProfile] = []
        for enum in range(api.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = api.nvmlDeviceGetGpuInstanceProfileInfo(h, enum)
            except (NvmlNotSupported, NvmlInvalidArgument, NvmlNotFound):
                continue
            if info.instanceCount == 0:
                continue
            profiles.append(
                MigProfile(
                    profile_id=info.id,
                    enum=enum,
                    name=text(info.name).removeprefix("MIG "),
                    slice_count=info.sliceCount,
                    memory_bytes=info.memorySizeMB * MIB,
                    multiprocessors=info.multiprocessorCount,
                    copy_engines=info.copyEngineCount,
                    decoders=info.decoderCount,
                    encoders=info.encoderCount,
                    jpeg_engines=info.jpegCount,
                    ofa_engines=info.ofaCount,
                    max_instances=info.instanceCount,
                    placements=self._placements(api, h, info.id, info.instanceCount),
                )
            )
        return tuple(sorted(profiles, key=lambda p: (p.slice_count, p.memory_bytes, p.name)))

    def _placements(
        self, api: NvmlApi, h: DeviceHandle, profile_id: int, count: int
    ) -> tuple[Placement, ...]:
        size = max(count, 8)
        arr = (api.c_nvmlGpuInstancePlacement_t * size)()
        n = ctypes.c_uint(size)
        api.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ctypes.byref(n))
        return tuple(Placement(arr[i].start, arr[i].size) for i in range(n.value))

    def _mig_instances(
        self, api: NvmlApi, h: DeviceHandle, dev: str, profiles: tuple[MigProfile, ...]
    ) -> tuple[MigInstance, ...]:
        by_id = {p.profile_id: p for p in profiles}
        out: list[MigInstance] = []
        for i in range(api.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                mh = api.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except NvmlNotFound:
                continue
            gi = api.nvmlDeviceGetGpuInstanceId(mh)
            ci = api.nvmlDeviceGetComputeInstanceId(mh)
            info = api.nvmlGpuInstanceGetInfo(api.nvmlDeviceGetGpuInstanceById(h, gi))
            profile = by_id.get(info.profileId)
            out.append(
                MigInstance(
                    gpu_instance_id=gi,
                    compute_instance_id=ci,
                    profile_id=info.profileId,
                    profile_name=profile.name if profile else f"profile-{info.profileId}",
                    placement=Placement(info.placement.start, info.placement.size),
                    uuid=text(api.nvmlDeviceGetUUID(mh)),
                    memory_bytes=self.memory(mh, dev).total,
                    multiprocessors=profile.multiprocessors if profile else 0,
                )
            )
        return tuple(sorted(out, key=lambda x: (x.placement.start, x.gpu_instance_id)))

    # -- NVLink ----------------------------------------------------------------------------
    def _nvlinks(self, api: NvmlApi, h: DeviceHandle) -> tuple[NvLink, ...]:
        links: list[NvLink] = []
        for link in range(api.NVML_NVLINK_MAX_LINKS):
            try:
                state = api.nvmlDeviceGetNvLinkState(h, link)
            except (NvmlNotSupported, NvmlInvalidArgument):
                break
            if not state:
                links.append(NvLink(link, False, None, "unknown"))
                continue
            remote = api.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
            try:
                kind = api.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
            except NvmlNotSupported:
                kind = -1
            links.append(
                NvLink(
                    link=link,
                    active=True,
                    remote_pci_bus_id=sysfs_bus_id(remote.busId),
                    remote_device_type=REMOTE_TYPES.get(kind, "unknown"),
                )
            )
        return tuple(links)
