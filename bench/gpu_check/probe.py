"""What NVML says about every GPU of a node, as flat facts, by reads only.

:func:`probe` asks NVML (through the facade's error-translating API, so the real pynvml and the
simulator answer alike) everything ``make gpu-check`` compares, and returns one
:class:`Fact` per path (``gpu[0].giProfile[enum=2].memorySizeMB``). :func:`read_state` is the
part of it that an administrator's changes would alter (MIG mode, GPU and compute instances,
compute mode): the guard compares it before and after, and the simulator is made to hold the
same state before it is probed.

Nothing here changes a GPU: every NVML function called is a query (``Get``/``Query``, and the
process-local event set of the XID check). ``tests/bench/test_gpu_check.py`` scans this package
for NVML calls and fails on any that sets, creates, destroys or resets.

Values are NVML's, in NVML's units, and the path says the unit where NVML's name does not
(``_mW``, ``_MHz``, ``_C``, ``_KBps``, ``_bytes``; ``memorySizeMB`` is MiB, as NVML means it).
A call that fails is recorded as a marker: ``<NOT_SUPPORTED>`` (any NVML return code by its
``NVML_ERROR_`` name), or ``<not simulated>`` when the simulator does not have the function.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pynvml

from agent.nvml.errors import NvmlError
from agent.nvml.events import EventWatcher
from agent.nvml.facade import Nvml, sysfs_bus_id, text
from agent.nvml.telemetry import FIELDS

Json = Any
"""A JSON-ready value: str, int, float, bool, None, or lists and dicts of them."""

COMPARE_VALUE = "value"
"""Both sides must have the same value."""
COMPARE_KIND = "kind"
"""Both sides must have the same kind of value (a type, or the same failure): live readings and
identities (UUIDs, serial numbers) differ between any two GPUs."""
COMPARE_UNITS = "units"
"""A live reading in NVML's units: the same kind, and two positive numbers within a factor of 10
of each other (a unit error is a factor of 1000: W for mW, Hz for MHz, bytes for KiB)."""

NOT_SIMULATED = "<not simulated>"
MISSING_FROM_PYNVML = "<not in this pynvml>"
MAX_INSTANCES = 8
"""Room for the GPU or compute instances of one profile (at most 7 on any MIG GPU)."""

_ERROR_NAMES: dict[int, str] = {
    value: name.removeprefix("NVML_ERROR_")
    for name, value in vars(pynvml).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}
_SHARED_ENGINES = 0
"""NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED: the only engine profile NVML offers."""
_TEMPERATURE_GPU, _CLOCK_SM, _CLOCK_MEM, _PCIE_TX, _PCIE_RX = 0, 1, 2, 0, 1
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
"""nvmlValueType_t -> the member of the field value's union that holds it."""
_GI_FIELDS = (
    "id",
    "sliceCount",
    "instanceCount",
    "multiprocessorCount",
    "copyEngineCount",
    "decoderCount",
    "encoderCount",
    "jpegCount",
    "ofaCount",
    "memorySizeMB",
    "isP2pSupported",
)
_CI_FIELDS = (
    "id",
    "sliceCount",
    "instanceCount",
    "multiprocessorCount",
    "sharedCopyEngineCount",
    "sharedDecoderCount",
    "sharedEncoderCount",
    "sharedJpegCount",
    "sharedOfaCount",
)
_ATTRIBUTE_FIELDS = (
    "multiprocessorCount",
    "sharedCopyEngineCount",
    "sharedDecoderCount",
    "sharedEncoderCount",
    "sharedJpegCount",
    "sharedOfaCount",
    "gpuInstanceSliceCount",
    "computeInstanceSliceCount",
    "memorySizeMB",
)


@dataclass(frozen=True)
class Fact:
    value: Json
    compare: str = COMPARE_VALUE


Facts = dict[str, Fact]


def marker(exc: NvmlError) -> str:
    """``<NOT_SUPPORTED>``: an NVML failure by its return code's name."""
    return f"<{_ERROR_NAMES.get(exc.code, f'NVML code {exc.code}')}>"


def is_marker(value: Json) -> bool:
    return isinstance(value, str) and value.startswith("<") and value.endswith(">")


class _Reader:
    """Calls NVML functions by name and turns failures into markers."""

    def __init__(self, api: Any, absent: str) -> None:
        self.api = api
        self.absent = absent

    def call(self, name: str, *args: Any) -> tuple[bool, Any]:
        try:
            fn = getattr(self.api, name)
        except AttributeError:
            return False, self.absent
        try:
            return True, fn(*args)
        except NvmlError as exc:
            return False, marker(exc)


# -- the state an administrator changes -----------------------------------------------------------


@dataclass(frozen=True, order=True)
class ComputeInstanceState:
    start: int
    size: int
    id: int
    profile_id: int


@dataclass(frozen=True, order=True)
class GpuInstanceState:
    start: int
    size: int
    id: int
    profile_id: int
    compute_instances: tuple[ComputeInstanceState, ...]


@dataclass(frozen=True)
class GpuState:
    """What ``nvidia-smi -mig``, ``nvidia-smi mig -cgi/-cci`` and ``nvidia-smi -c`` change."""

    index: int
    bus: str
    """sysfs form, ``0000:1b:00.0``."""
    mig_mode: Json
    """``[current, pending]``, or a marker (no MIG)."""
    compute_mode: Json
    gpu_instances: tuple[GpuInstanceState, ...] | str
    """By placement; a marker when NVML lists none (MIG disabled)."""

    def facts(self, prefix: str) -> Facts:
        out: Facts = {
            f"{prefix}.migMode": Fact(self.mig_mode),
            f"{prefix}.computeMode": Fact(self.compute_mode),
        }
        if isinstance(self.gpu_instances, str):
            out[f"{prefix}.gpuInstances"] = Fact(self.gpu_instances)
            return out
        out[f"{prefix}.gpuInstances"] = Fact(len(self.gpu_instances))
        for gi in self.gpu_instances:
            p = f"{prefix}.gpuInstance[start={gi.start}]"
            out[p] = Fact("present")
            out[f"{p}.size"] = Fact(gi.size)
            out[f"{p}.id"] = Fact(gi.id)
            out[f"{p}.profileId"] = Fact(gi.profile_id)
            for ci in gi.compute_instances:
                c = f"{p}.computeInstance[start={ci.start}]"
                out[c] = Fact("present")
                out[f"{c}.size"] = Fact(ci.size)
                out[f"{c}.id"] = Fact(ci.id)
                out[f"{c}.profileId"] = Fact(ci.profile_id)
        return out


def gi_profile_ids(api: Any, handle: Any) -> list[int]:
    """The GPU-instance profile ids the GPU offers (none without MIG)."""
    ids: list[int] = []
    for enum in range(api.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = api.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum)
        except NvmlError:
            continue
        if info.instanceCount:
            ids.append(int(info.id))
    return ids


def _gpu_instances(api: Any, handle: Any, profile_id: int) -> list[Any]:
    arr = (api.c_nvmlGpuInstance_t * MAX_INSTANCES)()
    count = ctypes.c_uint(MAX_INSTANCES)
    api.nvmlDeviceGetGpuInstances(handle, profile_id, arr, ctypes.byref(count))
    return [arr[i] for i in range(count.value)]


def _compute_instances(api: Any, gi_handle: Any) -> list[ComputeInstanceState]:
    out: list[ComputeInstanceState] = []
    for enum in range(api.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            profile = api.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi_handle, enum, _SHARED_ENGINES
            )
        except NvmlError:
            continue
        arr = (pynvml.c_nvmlComputeInstance_t * MAX_INSTANCES)()
        count = ctypes.c_uint(MAX_INSTANCES)
        api.nvmlGpuInstanceGetComputeInstances(gi_handle, profile.id, arr, ctypes.byref(count))
        for i in range(count.value):
            info = api.nvmlComputeInstanceGetInfo(arr[i])
            out.append(
                ComputeInstanceState(
                    start=int(info.placement.start),
                    size=int(info.placement.size),
                    id=int(info.id),
                    profile_id=int(info.profileId),
                )
            )
    return sorted(set(out))


def gpu_state(api: Any, index: int) -> GpuState:
    """The MIG mode, GPU and compute instances and compute mode of GPU ``index``, read only."""
    reader = _Reader(api, NOT_SIMULATED)
    handle = api.nvmlDeviceGetHandleByIndex(index)
    bus = sysfs_bus_id(api.nvmlDeviceGetPciInfo(handle).busId)
    ok, mode = reader.call("nvmlDeviceGetMigMode", handle)
    mig_mode = [int(mode[0]), int(mode[1])] if ok else mode
    _, compute_mode = reader.call("nvmlDeviceGetComputeMode", handle)
    instances: tuple[GpuInstanceState, ...] | str
    try:
        found: list[GpuInstanceState] = []
        for profile_id in gi_profile_ids(api, handle) if ok else []:
            for gi in _gpu_instances(api, handle, profile_id):
                info = api.nvmlGpuInstanceGetInfo(gi)
                found.append(
                    GpuInstanceState(
                        start=int(info.placement.start),
                        size=int(info.placement.size),
                        id=int(info.id),
                        profile_id=int(info.profileId),
                        compute_instances=tuple(_compute_instances(api, gi)),
                    )
                )
        instances = tuple(sorted(found)) if ok else str(mig_mode)
    except NvmlError as exc:
        instances = marker(exc)
    return GpuState(index, bus, mig_mode, compute_mode, instances)


def read_state(nvml: Nvml) -> tuple[GpuState, ...]:
    """:func:`gpu_state` of every GPU."""
    api = nvml.api()
    return tuple(gpu_state(api, i) for i in range(api.nvmlDeviceGetCount()))


# -- everything else ------------------------------------------------------------------------------


def probe(nvml: Nvml, labels: Mapping[int, str] | None = None, *, simulated: bool = False) -> Facts:
    """Every fact of the node's NVML: ``system.*``, and per GPU ``<label>.*`` where
    ``labels[index]`` names it (default ``gpu[<index>]``)."""
    api = nvml.api()
    reader = _Reader(api, NOT_SIMULATED if simulated else MISSING_FROM_PYNVML)
    facts: Facts = {}
    _system(reader, facts)
    count = api.nvmlDeviceGetCount()
    xid = _xid_registration(nvml)
    for index in range(count):
        label = (labels or {}).get(index, f"gpu[{index}]")
        _gpu(reader, api, index, label, facts)
        facts[f"{label}.events.xidCriticalError"] = Fact(xid.get(index, "not watched"))
    return facts


def _system(reader: _Reader, facts: Facts) -> None:
    for name, path, convert in (
        ("nvmlSystemGetDriverVersion", "system.driverVersion", text),
        ("nvmlSystemGetCudaDriverVersion_v2", "system.cudaDriverVersion", int),
        ("nvmlSystemGetNVMLVersion", "system.nvmlVersion", text),
    ):
        ok, value = reader.call(name)
        facts[path] = Fact(convert(value) if ok else value)


def _xid_registration(nvml: Nvml) -> dict[int, str]:
    """Per GPU: ``registered`` or ``skipped``, as the agent's XID event watcher finds it (an
    event set is local to this process: registering changes nothing on the GPU)."""
    try:
        with EventWatcher(nvml) as watcher:
            out = dict.fromkeys(watcher.registered, "registered")
            out |= dict.fromkeys(watcher.skipped, "skipped")
            return out
    except NvmlError as exc:
        return {i: marker(exc) for i in range(nvml.device_count())}


def _put_call(
    reader: _Reader,
    facts: Facts,
    path: str,
    name: str,
    *args: Any,
    compare: str = COMPARE_VALUE,
    convert: Callable[[Any], Json] = lambda v: v,
) -> Any:
    ok, value = reader.call(name, *args)
    facts[path] = Fact(convert(value) if ok else value, compare)
    return value if ok else None


def _gpu(reader: _Reader, api: Any, index: int, label: str, facts: Facts) -> None:
    h = api.nvmlDeviceGetHandleByIndex(index)
    pci = api.nvmlDeviceGetPciInfo(h)
    facts[f"{label}.pciBusId"] = Fact(text(pci.busId))
    facts[f"{label}.pciDeviceId"] = Fact(f"0x{int(pci.pciDeviceId):08X}")
    put = _bind(_put_call, reader, facts)
    put(f"{label}.name", "nvmlDeviceGetName", h, convert=text)
    put(f"{label}.brand", "nvmlDeviceGetBrand", h)
    put(f"{label}.architecture", "nvmlDeviceGetArchitecture", h)
    put(f"{label}.cudaComputeCapability", "nvmlDeviceGetCudaComputeCapability", h, convert=list)
    put(f"{label}.minor", "nvmlDeviceGetMinorNumber", h, compare=COMPARE_KIND)
    put(f"{label}.uuid", "nvmlDeviceGetUUID", h, compare=COMPARE_KIND, convert=text)
    put(f"{label}.serial", "nvmlDeviceGetSerial", h, compare=COMPARE_KIND, convert=text)
    _memory(reader, api, h, label, facts)
    put(f"{label}.maxMigDeviceCount", "nvmlDeviceGetMaxMigDeviceCount", h)
    put(f"{label}.enforcedPowerLimit_mW", "nvmlDeviceGetEnforcedPowerLimit", h)
    put(f"{label}.powerManagementLimit_mW", "nvmlDeviceGetPowerManagementLimit", h)
    put(f"{label}.maxClock.sm_MHz", "nvmlDeviceGetMaxClockInfo", h, _CLOCK_SM)
    put(f"{label}.maxClock.memory_MHz", "nvmlDeviceGetMaxClockInfo", h, _CLOCK_MEM)
    put(
        f"{label}.gpmSupported",
        "nvmlGpmQueryDeviceSupport",
        h,
        convert=lambda s: int(s.isSupportedDevice),
    )
    _nvlinks(reader, h, label, facts)
    _telemetry(reader, h, label, facts)
    state = gpu_state(api, index)
    facts |= state.facts(label)
    _gi_profiles(reader, api, h, label, facts)
    _ci_profiles(reader, api, h, state, label, facts)
    _mig_devices(reader, api, h, state, label, facts)


def _bind(fn: Callable[..., Any], reader: _Reader, facts: Facts) -> Callable[..., Any]:
    """``fn`` with its reader and facts bound."""

    def bound(path: str, name: str, *args: Any, **kw: Any) -> Any:
        return fn(reader, facts, path, name, *args, **kw)

    return bound


def _memory(reader: _Reader, api: Any, h: Any, label: str, facts: Facts) -> None:
    """Totals are the product's; ``used`` and ``free`` are live, not compared."""
    ok, v1 = reader.call("nvmlDeviceGetMemoryInfo", h)
    facts[f"{label}.memory.total_bytes"] = Fact(int(v1.total) if ok else v1)
    ok2, v2 = reader.call("nvmlDeviceGetMemoryInfo", h, api.nvmlMemory_v2)
    if not ok2:
        facts[f"{label}.memory.v2"] = Fact(v2)
        return
    facts[f"{label}.memory.v2.reserved_bytes"] = Fact(int(v2.reserved))
    same = "same as v1" if ok and int(v2.total) == int(v1.total) else int(v2.total)
    facts[f"{label}.memory.v2.total_bytes"] = Fact(same)


def _nvlinks(reader: _Reader, h: Any, label: str, facts: Facts) -> None:
    """How many links NVML answers for (the product's), how many are active and what they
    reach (the node's wiring, which the simulator is given)."""
    links, active, remote = 0, 0, set()
    first_failure: str | None = None
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        ok, state = reader.call("nvmlDeviceGetNvLinkState", h, link)
        if not ok:
            first_failure = str(state)
            break
        links += 1
        if state:
            active += 1
            ok, kind = reader.call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
            remote.add(int(kind) if ok else str(kind))
    facts[f"{label}.nvlink.links"] = Fact(links)
    facts[f"{label}.nvlink.afterLastLink"] = Fact(first_failure)
    facts[f"{label}.nvlink.active"] = Fact(active)
    facts[f"{label}.nvlink.remoteDeviceTypes"] = Fact(sorted(remote, key=str))


def _telemetry(reader: _Reader, h: Any, label: str, facts: Facts) -> None:
    """The calls the agent's telemetry reader makes on a whole GPU: supported or not, and the
    readings in NVML's units."""
    p = f"{label}.telemetry"
    put = _bind(_put_call, reader, facts)
    put(
        f"{p}.utilization_percent",
        "nvmlDeviceGetUtilizationRates",
        h,
        compare=COMPARE_KIND,
        convert=lambda u: {"gpu": int(u.gpu), "memory": int(u.memory)},
    )
    put(f"{p}.power_mW", "nvmlDeviceGetPowerUsage", h, compare=COMPARE_UNITS)
    put(
        f"{p}.temperature_C", "nvmlDeviceGetTemperature", h, _TEMPERATURE_GPU, compare=COMPARE_UNITS
    )
    put(f"{p}.clock.sm_MHz", "nvmlDeviceGetClockInfo", h, _CLOCK_SM, compare=COMPARE_UNITS)
    put(f"{p}.clock.memory_MHz", "nvmlDeviceGetClockInfo", h, _CLOCK_MEM, compare=COMPARE_UNITS)
    put(
        f"{p}.clocksEventReasons", "nvmlDeviceGetCurrentClocksEventReasons", h, compare=COMPARE_KIND
    )
    put(
        f"{p}.clocksThrottleReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        h,
        compare=COMPARE_KIND,
    )
    put(f"{p}.pcie.tx_KBps", "nvmlDeviceGetPcieThroughput", h, _PCIE_TX, compare=COMPARE_KIND)
    put(f"{p}.pcie.rx_KBps", "nvmlDeviceGetPcieThroughput", h, _PCIE_RX, compare=COMPARE_KIND)
    put(
        f"{p}.computeRunningProcesses",
        "nvmlDeviceGetComputeRunningProcesses",
        h,
        compare=COMPARE_KIND,
        convert=lambda procs: [int(x.pid) for x in procs],
    )
    ok, values = reader.call(
        "nvmlDeviceGetFieldValues", h, [(field_id, scope) for _, _, field_id, scope in FIELDS]
    )
    for i, (_, name, _, _) in enumerate(FIELDS):
        path = f"{p}.field.{name.removeprefix('NVML_FI_DEV_')}"
        if not ok:
            facts[path] = Fact(values)
            continue
        v = values[i]
        ret = int(v.nvmlReturn)
        if ret:
            facts[path] = Fact(f"<{_ERROR_NAMES.get(ret, f'NVML code {ret}')}>")
        else:
            facts[path] = Fact(f"valueType {int(v.valueType)}")
    temp = [i for i, (_, name, _, _) in enumerate(FIELDS) if name == "NVML_FI_DEV_MEMORY_TEMP"]
    if ok and temp and not values[temp[0]].nvmlReturn:  # a reading in degrees C
        v = values[temp[0]]
        if 0 <= int(v.valueType) < len(_VALUE_MEMBERS):
            value = getattr(v.value, _VALUE_MEMBERS[int(v.valueType)])
            facts[f"{p}.field.MEMORY_TEMP.value_C"] = Fact(int(value), COMPARE_UNITS)


def _gi_profiles(reader: _Reader, api: Any, h: Any, label: str, facts: Facts) -> None:
    """Every GPU-instance profile NVML knows, asked by its enum through the v2 call (``...V``,
    what the agent uses); the v1 call must agree with it; the possible placements per id."""
    for enum in range(api.NVML_GPU_INSTANCE_PROFILE_COUNT):
        p = f"{label}.giProfile[enum={enum}]"
        ok, info = reader.call("nvmlDeviceGetGpuInstanceProfileInfo", h, enum, 2)
        if not ok:
            facts[p] = Fact(info)
            continue
        facts[p] = Fact("present")
        facts[f"{p}.name"] = Fact(text(info.name))
        for field in _GI_FIELDS:
            facts[f"{p}.{field}"] = Fact(int(getattr(info, field)))
        ok1, v1 = reader.call("nvmlDeviceGetGpuInstanceProfileInfo", h, enum, 1)
        if ok1:
            differ = [
                f"{f}={int(getattr(v1, f))}"
                for f in _GI_FIELDS
                if int(getattr(v1, f)) != int(getattr(info, f))
            ]
            v1 = "same as v2" if not differ else "differs: " + ", ".join(differ)
        facts[f"{p}.v1"] = Fact(v1)
        arr = (api.c_nvmlGpuInstancePlacement_t * MAX_INSTANCES)()
        count = ctypes.c_uint(MAX_INSTANCES)
        ok, failure = reader.call(
            "nvmlDeviceGetGpuInstancePossiblePlacements", h, info.id, arr, ctypes.byref(count)
        )
        placements = [f"{arr[i].start}:{arr[i].size}" for i in range(count.value)]
        facts[f"{p}.placements"] = Fact(placements if ok else failure)


def _ci_profiles(
    reader: _Reader, api: Any, h: Any, state: GpuState, label: str, facts: Facts
) -> None:
    """The compute-instance profiles inside each existing GPU instance. NVML answers them only
    for a GPU instance that exists, and creating one would change the GPU: without one, none."""
    if isinstance(state.gpu_instances, str) or not state.gpu_instances:
        facts[f"{label}.ciProfiles"] = Fact("<no GPU instance to ask; none is created>")
        return
    for gi in state.gpu_instances:
        ok, gih = reader.call("nvmlDeviceGetGpuInstanceById", h, gi.id)
        base = f"{label}.gpuInstance[start={gi.start}]"
        if not ok:
            facts[f"{base}.ciProfiles"] = Fact(gih)
            continue
        for enum in range(api.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            p = f"{base}.ciProfile[enum={enum}]"
            ok, info = reader.call(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo", gih, enum, _SHARED_ENGINES, 2
            )
            if not ok:
                facts[p] = Fact(info)
                continue
            facts[p] = Fact("present")
            facts[f"{p}.name"] = Fact(text(info.name))
            for field in _CI_FIELDS:
                facts[f"{p}.{field}"] = Fact(int(getattr(info, field)))


def _mig_devices(
    reader: _Reader, api: Any, h: Any, state: GpuState, label: str, facts: Facts
) -> None:
    """Each MIG device (a compute instance), named by its GPU and compute instances'
    placements: its name, memory and the attributes NVML gives a MIG device handle."""
    if isinstance(state.gpu_instances, str):
        return
    where = {
        (gi.id, ci.id): f"{label}.migDevice[gi@{gi.start},ci@{ci.start}]"
        for gi in state.gpu_instances
        for ci in gi.compute_instances
    }
    ok, count = reader.call("nvmlDeviceGetMaxMigDeviceCount", h)
    for i in range(count if ok else 0):
        ok, mh = reader.call("nvmlDeviceGetMigDeviceHandleByIndex", h, i)
        if not ok:
            continue
        ids = (api.nvmlDeviceGetGpuInstanceId(mh), api.nvmlDeviceGetComputeInstanceId(mh))
        p = where.get(ids, f"{label}.migDevice[gi={ids[0]},ci={ids[1]}]")
        facts[p] = Fact("present")
        put = _bind(_put_call, reader, facts)
        put(f"{p}.name", "nvmlDeviceGetName", mh, convert=text)
        put(f"{p}.uuid", "nvmlDeviceGetUUID", mh, compare=COMPARE_KIND, convert=text)
        put(
            f"{p}.memory.total_bytes",
            "nvmlDeviceGetMemoryInfo",
            mh,
            convert=lambda m: int(m.total),
        )
        put(
            f"{p}.attributes",
            "nvmlDeviceGetAttributes_v2",
            mh,
            convert=lambda a: {f: int(getattr(a, f)) for f in _ATTRIBUTE_FIELDS},
        )
