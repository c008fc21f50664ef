"""The NVML facade: the only code that calls pynvml.

It takes the pynvml *module* (or the simulator's object with the same function surface) as a
constructor argument and returns the plain frozen values of ``agent.nvml.types``. NVML errors
become ``agent.nvml.errors.Nvml*`` errors naming the call and the device; ``NotSupported`` on
optional fields yields ``None`` ("absent") instead of an error.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, TypeVar

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
    SystemInfo,
)

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

# NVML return codes (stable C ABI values) -> our error classes.
_ERROR_CLASSES: dict[int, type[NvmlError]] = {
    2: NvmlInvalidArgument,
    3: NvmlNotSupported,
    6: NvmlNotFound,
    13: NvmlNotSupported,  # FUNCTION_NOT_FOUND: an older driver lacks the call
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


class Nvml:
    """Typed, error-translating access to NVML through a pynvml-shaped module."""

    def __init__(self, module: Any) -> None:
        self._m = module
        self._initialized = False

    # -- lifecycle -------------------------------------------------------------------------
    def init(self) -> None:
        """Initialize NVML. Raises DriverNotFoundError when no NVIDIA driver is present."""
        try:
            self._m.nvmlInit()
        except self._m.NVMLError as exc:
            if exc.value in _NO_DRIVER:
                raise DriverNotFoundError(
                    "no NVIDIA driver found (libnvidia-ml.so.1 could not be loaded)"
                ) from exc
            raise self._translate("nvmlInit", exc, None) from exc
        self._initialized = True

    def shutdown(self) -> None:
        if self._initialized:
            self._initialized = False
            self._call("nvmlShutdown")

    def __enter__(self) -> Nvml:
        self.init()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def module(self) -> Any:
        """The pynvml-shaped module this facade calls (for the other facade modules)."""
        return self._m

    # -- error translation -----------------------------------------------------------------
    def _translate(self, call: str, exc: Any, device: str | None) -> NvmlError:
        code = int(getattr(exc, "value", -1))
        cls = _ERROR_CLASSES.get(code, NvmlError)
        return cls(call, code, str(exc), device)

    def _call(self, name: str, *args: Any, device: str | None = None) -> Any:
        """Call ``pynvml.<name>(*args)``, translating NVML errors."""
        try:
            return getattr(self._m, name)(*args)
        except self._m.NVMLError as exc:
            raise self._translate(name, exc, device) from exc

    def _optional(self, fn: Callable[[], T]) -> T | None:
        """Run ``fn``; a NotSupported answer means "absent"."""
        try:
            return fn()
        except NvmlNotSupported:
            return None

    # -- system ----------------------------------------------------------------------------
    def system(self) -> SystemInfo:
        cuda = int(self._call("nvmlSystemGetCudaDriverVersion_v2"))
        nvml_version = self._optional(lambda: text(self._call("nvmlSystemGetNVMLVersion")))
        return SystemInfo(
            driver_version=text(self._call("nvmlSystemGetDriverVersion")),
            cuda_driver_version=f"{cuda // 1000}.{(cuda % 1000) // 10}",
            nvml_version=nvml_version,
        )

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def handle(self, index: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", index, device=str(index))

    def devices(self) -> tuple[GpuDevice, ...]:
        """Every GPU NVML sees, in NVML index order."""
        return tuple(self.device(i) for i in range(self.device_count()))

    def device(self, index: int) -> GpuDevice:
        h = self.handle(index)
        dev = str(index)
        c = self._call
        pci = c("nvmlDeviceGetPciInfo", h, device=dev)
        cc_major, cc_minor = c("nvmlDeviceGetCudaComputeCapability", h, device=dev)
        arch = int(c("nvmlDeviceGetArchitecture", h, device=dev))
        brand = int(c("nvmlDeviceGetBrand", h, device=dev))
        mig_mode = self._mig_mode(h, dev)
        profiles = self._mig_profiles(h, dev) if mig_mode is not None else ()
        instances = self._mig_instances(h, dev, profiles) if mig_mode and mig_mode.current else ()
        return GpuDevice(
            index=index,
            minor=int(c("nvmlDeviceGetMinorNumber", h, device=dev)),
            uuid=text(c("nvmlDeviceGetUUID", h, device=dev)),
            name=text(c("nvmlDeviceGetName", h, device=dev)),
            brand=BRANDS.get(brand, "Unknown"),
            architecture=ARCHITECTURES.get(arch, "Unknown"),
            compute_capability=(int(cc_major), int(cc_minor)),
            pci_bus_id=sysfs_bus_id(pci.busId),
            pci_device_id=int(pci.pciDeviceId),
            serial=self._optional(lambda: text(c("nvmlDeviceGetSerial", h, device=dev))),
            memory=self.memory(h, dev),
            mig_mode=mig_mode,
            mig_profiles=profiles,
            mig_instances=instances,
            nvlinks=self._nvlinks(h, dev),
        )

    def memory(self, handle: Any, dev: str) -> MemoryInfo:
        """Memory of a GPU or MIG device handle; ``reserved`` only where NVML has v2."""
        try:
            m = self._call("nvmlDeviceGetMemoryInfo", handle, self._m.nvmlMemory_v2, device=dev)
            return MemoryInfo(int(m.total), int(m.free), int(m.used), int(m.reserved))
        except NvmlNotSupported:
            m = self._call("nvmlDeviceGetMemoryInfo", handle, device=dev)
            return MemoryInfo(int(m.total), int(m.free), int(m.used))

    # -- MIG -------------------------------------------------------------------------------
    def _mig_mode(self, h: Any, dev: str) -> MigMode | None:
        mode = self._optional(lambda: self._call("nvmlDeviceGetMigMode", h, device=dev))
        if mode is None:
            return None
        current, pending = mode
        return MigMode(current=bool(current), pending=bool(pending))

    def _mig_profiles(self, h: Any, dev: str) -> tuple[MigProfile, ...]:
        m = self._m
        profiles: list[MigProfile] = []
        for enum in range(int(m.NVML_GPU_INSTANCE_PROFILE_COUNT)):
            try:
                info = self._call("nvmlDeviceGetGpuInstanceProfileInfo", h, enum, device=dev)
            except (NvmlNotSupported, NvmlInvalidArgument, NvmlNotFound):
                continue
            if int(info.instanceCount) == 0:
                continue
            profiles.append(
                MigProfile(
                    profile_id=int(info.id),
                    enum=enum,
                    name=text(info.name).removeprefix("MIG "),
                    slice_count=int(info.sliceCount),
                    memory_bytes=int(info.memorySizeMB) * MIB,
                    multiprocessors=int(info.multiprocessorCount),
                    copy_engines=int(info.copyEngineCount),
                    decoders=int(info.decoderCount),
                    encoders=int(info.encoderCount),
                    jpeg_engines=int(info.jpegCount),
                    ofa_engines=int(info.ofaCount),
                    max_instances=int(info.instanceCount),
                    placements=self._placements(h, dev, int(info.id), int(info.instanceCount)),
                )
            )
        return tuple(sorted(profiles, key=lambda p: (p.slice_count, p.memory_bytes, p.name)))

    def _placements(self, h: Any, dev: str, profile_id: int, count: int) -> tuple[Placement, ...]:
        m = self._m
        size = max(count, 8)
        arr = (m.c_nvmlGpuInstancePlacement_t * size)()
        n = ctypes.c_uint(size)
        self._call(
            "nvmlDeviceGetGpuInstancePossiblePlacements",
            h,
            profile_id,
            arr,
            ctypes.byref(n),
            device=dev,
        )
        return tuple(Placement(int(arr[i].start), int(arr[i].size)) for i in range(n.value))

    def _mig_instances(
        self, h: Any, dev: str, profiles: tuple[MigProfile, ...]
    ) -> tuple[MigInstance, ...]:
        by_id = {p.profile_id: p for p in profiles}
        out: list[MigInstance] = []
        for i in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", h, device=dev))):
            try:
                mh = self._call("nvmlDeviceGetMigDeviceHandleByIndex", h, i, device=dev)
            except NvmlNotFound:
                continue
            gi = int(self._call("nvmlDeviceGetGpuInstanceId", mh, device=dev))
            ci = int(self._call("nvmlDeviceGetComputeInstanceId", mh, device=dev))
            gih = self._call("nvmlDeviceGetGpuInstanceById", h, gi, device=dev)
            info = self._call("nvmlGpuInstanceGetInfo", gih, device=dev)
            profile = by_id.get(int(info.profileId))
            out.append(
                MigInstance(
                    gpu_instance_id=gi,
                    compute_instance_id=ci,
                    profile_id=int(info.profileId),
                    profile_name=profile.name if profile else f"profile-{int(info.profileId)}",
                    placement=Placement(int(info.placement.start), int(info.placement.size)),
                    uuid=text(self._call("nvmlDeviceGetUUID", mh, device=dev)),
                    memory_bytes=self.memory(mh, dev).total,
                    multiprocessors=profile.multiprocessors if profile else 0,
                )
            )
        return tuple(sorted(out, key=lambda x: (x.placement.start, x.gpu_instance_id)))

    # -- NVLink ----------------------------------------------------------------------------
    def _nvlinks(self, h: Any, dev: str) -> tuple[NvLink, ...]:
        links: list[NvLink] = []
        for link in range(int(self._m.NVML_NVLINK_MAX_LINKS)):
            try:
                state = self._call("nvmlDeviceGetNvLinkState", h, link, device=dev)
            except (NvmlNotSupported, NvmlInvalidArgument):
                break
            if not state:
                links.append(NvLink(link, False, None, "unknown"))
                continue
            remote = self._call("nvmlDeviceGetNvLinkRemotePciInfo", h, link, device=dev)
            try:
                kind = int(self._call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link, device=dev))
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
