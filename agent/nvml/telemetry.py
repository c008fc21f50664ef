"""Telemetry reads through the NVML facade: one :class:`~agent.nvml.samples.GpuSample` per GPU.

Use one :class:`TelemetryReader` per facade (the composition root owns it) and call
:meth:`TelemetryReader.read` once per GPU per tick. It calls NVML through the facade's
:meth:`~agent.nvml.facade.Nvml.api` (one per GPU, so errors name the GPU), by attribute, typed by
:class:`~agent.nvml.api.NvmlApi`. The reader is not thread-safe:
one sampler thread owns it. Between reads it keeps, per GPU: the handle and UUID, the MIG
devices (handles, GPU/compute instance ids, UUIDs), the calls that answered NotSupported (not
asked again), the last process-utilization timestamp and the GPM sample buffers.

NVML calls per GPU per read, once warm (the first read also looks up the handle, UUID and MIG
devices and learns what is unsupported):

* 1 ``nvmlDeviceGetFieldValues`` for every field-value metric: energy, memory temperature, PCIe
  replays, NVLink data TX/RX (``scopeId`` 0xFFFFFFFF: summed over links), volatile ECC
  corrected/uncorrected, remapped rows correctable/uncorrectable/pending;
* utilization, memory, power, GPU temperature, SM clock, memory clock, clocks-event reasons,
  PCIe TX, PCIe RX, running compute processes: 10 calls (utilization is skipped on MIG-enabled
  GPUs, where NVML does not support it);
* process utilization: 1 call, only when processes run (and not on MIG-enabled GPUs);
* per MIG device: its memory (1 call); per GPU instance on Hopper+: 1 GPM sample + 1 GPM
  metrics call (the second sample is the previous read's, so the first read has no MIG
  utilization).

So a whole GPU costs at most 12 calls per read; a MIG-enabled GPU 10 + (MIG devices) + 2 x (GPU
instances on Hopper). The MIG device list is re-enumerated every ``mig_refresh_reads`` reads,
when a MIG handle stops working, or when a process shows up in an unknown GPU instance.

Results follow :mod:`agent.nvml.samples`: base units (W, J, Hz, bytes, ratios); NotSupported ->
``None``; GpuIsLost anywhere -> ``GpuSample(lost=True)``; any other NVML error -> that field
``None`` and the call's name in ``errors``. A call the driver or pynvml lacks
(FUNCTION_NOT_FOUND, pynvml's ``NVMLLibraryMismatchError``) counts as NotSupported. PCIe
throughput (NVML "KB/s") is taken as KiB/s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from agent.nvml.api_types import FieldValue, FieldValueUnion
from agent.nvml.errors import NvmlError, NvmlGpuLost, NvmlNotFound, NvmlNotSupported
from agent.nvml.facade import Nvml, text
from agent.nvml.gpu_reads import SUCCESS, GpuState, Lost, call
from agent.nvml.mig_reads import enumerate_mig, free_gpm, mig_samples
from agent.nvml.samples import GpuSample, ProcessSample
from agent.nvml.types import MemoryInfo

NOT_MIG = 0xFFFFFFFF
ALL_LINKS = 0xFFFFFFFF
VALUE_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF
"""NVML_VALUE_NOT_AVAILABLE for unsigned long long (usedGpuMemory under WDDM / without rights)."""

# NVML field ids (stable C ABI values) -> the sample field each feeds, and its scope.
FIELDS: tuple[tuple[str, str, int, int], ...] = (
    ("energy", "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 83, 0),
    ("memory_temp", "NVML_FI_DEV_MEMORY_TEMP", 82, 0),
    ("pcie_replays", "NVML_FI_DEV_PCIE_REPLAY_COUNTER", 94, 0),
    ("nvlink_tx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138, ALL_LINKS),
    ("nvlink_rx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139, ALL_LINKS),
    ("ecc_corrected", "NVML_FI_DEV_ECC_SBE_VOL_TOTAL", 3, 0),
    ("ecc_uncorrected", "NVML_FI_DEV_ECC_DBE_VOL_TOTAL", 4, 0),
    ("remapped_correctable", "NVML_FI_DEV_REMAPPED_COR", 142, 0),
    ("remapped_uncorrectable", "NVML_FI_DEV_REMAPPED_UNC", 143, 0),
    ("remap_pending", "NVML_FI_DEV_REMAPPED_PENDING", 144, 0),
)
_FIELD_REQUEST: tuple[tuple[int, int], ...] = tuple((f, scope) for _, _, f, scope in FIELDS)
# nvmlValueType_t (NVML_VALUE_TYPE_DOUBLE .. _UNSIGNED_SHORT) -> the member of the value union
_VALUE_MEMBERS: tuple[Callable[[FieldValueUnion], float], ...] = (
    lambda v: v.dVal,
    lambda v: v.uiVal,
    lambda v: v.ulVal,
    lambda v: v.ullVal,
    lambda v: v.sllVal,
    lambda v: v.siVal,
    lambda v: v.usVal,
)
_NOT_SUPPORTED, _FUNCTION_NOT_FOUND, _GPU_IS_LOST = 3, 13, 15
_VERSION_MISMATCH = 25
_TEMPERATURE_GPU = 0
_CLOCK_SM, _CLOCK_MEM = 1, 2
_PCIE_TX, _PCIE_RX = 0, 1
MHZ = 1_000_000
KIB = 1024


class TelemetryReader:
    """Reads :class:`GpuSample` values through an :class:`~agent.nvml.facade.Nvml` facade."""

    def __init__(self, nvml: Nvml, *, mig_refresh_reads: int = 60) -> None:
        self._nvml = nvml
        self._gpus: dict[int, GpuState] = {}
        self._uuids: dict[int, str] = {}
        self._expected: dict[int, str] = {}
        self._mig_refresh_reads = mig_refresh_reads
        self._asks_lock = threading.Lock()
        self._asks = 0
        """Refresh requests so far (``refresh`` is called from other threads than the reading
        one): a GPU whose state has seen fewer asks than its latest is re-enumerated."""
        self._asked: dict[int | None, int] = {}
        """GPU index (None: every GPU) -> the number of the latest ask for it."""

    # -- public ------------------------------------------------------------------------------
    def read(self, index: int, now: float) -> GpuSample:
        """One sample of GPU ``index``, stamped ``now`` (the sampler's monotonic clock)."""
        try:
            gpu = self._gpu(index)
            return self._read(index, gpu, now, [])
        except (Lost, NvmlGpuLost):
            self.forget(index)
            return GpuSample(index=index, uuid=self._uuids.get(index, ""), timestamp=now, lost=True)

    def read_all(self, now: float) -> tuple[GpuSample, ...]:
        """A sample of every GPU NVML counts (one ``nvmlDeviceGetCount`` more)."""
        return tuple(self.read(i, now) for i in range(self._nvml.device_count()))

    def refresh(self, index: int | None = None) -> None:
        """Re-enumerate MIG devices and re-probe unsupported calls at the next read of GPU
        ``index`` (None: of every GPU). Safe from any thread: the reading thread takes the ask
        at its next read (reads that began before it may not have seen it)."""
        with self._asks_lock:
            self._asks += 1
            self._asked[index] = self._asks

    def expect(self, uuids: Mapping[int, str]) -> None:
        """The GPUs' UUIDs by NVML index after a rediscovery (indexes shift when a GPU leaves or
        returns): a cached handle whose UUID is not the one now expected at its index is dropped
        at that index's next read (by the reading thread) and looked up again."""
        self._expected = dict(uuids)

    def forget(self, index: int) -> None:
        """Drop everything cached for GPU ``index`` (its handle is looked up again)."""
        gpu = self._gpus.pop(index, None)
        if gpu is not None:
            for gi in list(gpu.gpm):
                free_gpm(gpu, gi)

    def close(self) -> None:
        """Free the GPM sample buffers."""
        for index in list(self._gpus):
            self.forget(index)

    def _gpu(self, index: int) -> GpuState:
        gpu = self._gpus.get(index)
        expected = self._expected.get(index)
        if gpu is not None and expected is not None and gpu.uuid != expected:
            self.forget(index)
            gpu = None
        if gpu is None:
            api = self._nvml.api(str(index))
            handle = self._nvml.handle(index)
            uuid = text(api.nvmlDeviceGetUUID(handle))
            gpu = self._gpus[index] = GpuState(api=api, handle=handle, uuid=uuid)
            self._uuids[index] = uuid
        with self._asks_lock:
            asked = max(self._asked.get(index, 0), self._asked.get(None, 0))
        if asked > gpu.asks_seen:
            gpu.asks_seen = asked
            gpu.mig_stale = True
        return gpu

    # -- one read ------------------------------------------------------------------------------
    def _read(self, index: int, gpu: GpuState, now: float, errors: list[str]) -> GpuSample:
        gpu.reads_since_enumeration += 1
        if gpu.mig_stale or gpu.reads_since_enumeration > self._mig_refresh_reads:
            enumerate_mig(gpu, errors)
        api, h, get = gpu.api, gpu.handle, call

        fields = self._fields(gpu, errors)
        util = get(gpu, errors, "util", api.nvmlDeviceGetUtilizationRates, h)
        memory = self._memory(gpu, errors)
        power = get(gpu, errors, "power", api.nvmlDeviceGetPowerUsage, h)
        temperature = get(gpu, errors, "temp", api.nvmlDeviceGetTemperature, h, _TEMPERATURE_GPU)
        sm_clock = get(gpu, errors, "clock_sm", api.nvmlDeviceGetClockInfo, h, _CLOCK_SM)
        mem_clock = get(gpu, errors, "clock_mem", api.nvmlDeviceGetClockInfo, h, _CLOCK_MEM)
        throttle = self._throttle(gpu, errors)
        pcie_tx = get(gpu, errors, "pcie_tx", api.nvmlDeviceGetPcieThroughput, h, _PCIE_TX)
        pcie_rx = get(gpu, errors, "pcie_rx", api.nvmlDeviceGetPcieThroughput, h, _PCIE_RX)
        processes = self._processes(gpu, errors)
        mig = mig_samples(gpu, errors)
        return GpuSample(
            index=index,
            uuid=gpu.uuid,
            timestamp=now,
            utilization_gpu=None if util is None else util.gpu / 100,
            utilization_memory=None if util is None else util.memory / 100,
            memory_used_bytes=None if memory is None else memory.used,
            memory_free_bytes=None if memory is None else memory.free,
            memory_reserved_bytes=None if memory is None else memory.reserved,
            power_watts=None if power is None else power / 1000,
            energy_joules=_scaled(fields["energy"], 1 / 1000),
            temperature_gpu_celsius=None if temperature is None else float(temperature),
            temperature_memory_celsius=_scaled(fields["memory_temp"], 1),
            clock_sm_hertz=None if sm_clock is None else float(sm_clock * MHZ),
            clock_memory_hertz=None if mem_clock is None else float(mem_clock * MHZ),
            throttle_reasons=throttle,
            pcie_tx_bytes_per_second=None if pcie_tx is None else float(pcie_tx * KIB),
            pcie_rx_bytes_per_second=None if pcie_rx is None else float(pcie_rx * KIB),
            pcie_replays=_int(fields["pcie_replays"]),
            nvlink_tx_bytes=_int(fields["nvlink_tx"], KIB),
            nvlink_rx_bytes=_int(fields["nvlink_rx"], KIB),
            ecc_corrected=_int(fields["ecc_corrected"]),
            ecc_uncorrected=_int(fields["ecc_uncorrected"]),
            remapped_rows_correctable=_int(fields["remapped_correctable"]),
            remapped_rows_uncorrectable=_int(fields["remapped_uncorrectable"]),
            remap_pending=None
            if fields["remap_pending"] is None
            else bool(fields["remap_pending"]),
            processes=processes,
            mig=mig,
            errors=tuple(errors),
        )

    def _fields(self, gpu: GpuState, errors: list[str]) -> dict[str, float | None]:
        """Every field-value metric in one call; per field: value, or None (unsupported or
        failed, the failure named in ``errors``)."""
        out: dict[str, float | None] = {key: None for key, _, _, _ in FIELDS}
        values = call(
            gpu, errors, "fields", gpu.api.nvmlDeviceGetFieldValues, gpu.handle, _FIELD_REQUEST
        )
        if values is None:
            return out
        for i, (key, name, _, _) in enumerate(FIELDS):
            v: FieldValue = values[i]
            ret = v.nvmlReturn
            if ret == SUCCESS and 0 <= v.valueType < len(_VALUE_MEMBERS):
                out[key] = _VALUE_MEMBERS[v.valueType](v.value)
            elif ret == _GPU_IS_LOST:
                raise Lost()
            elif ret not in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                errors.append(f"nvmlDeviceGetFieldValues[{name}]")
        return out

    def _memory(self, gpu: GpuState, errors: list[str]) -> MemoryInfo | None:
        """v2 memory info (with ``reserved``) where NVML has it, else v1."""
        api, handle = gpu.api, gpu.handle
        if "memory_v2" not in gpu.skip:
            try:
                m2 = api.nvmlDeviceGetMemoryInfo(handle, api.nvmlMemory_v2)
                return MemoryInfo(m2.total, m2.free, m2.used, m2.reserved)
            except NvmlGpuLost as exc:
                raise Lost() from exc
            except NvmlNotSupported:
                gpu.skip.add("memory_v2")
            except NvmlError as exc:
                if exc.code != _VERSION_MISMATCH:
                    errors.append(exc.call)
                    return None
                gpu.skip.add("memory_v2")
        m = call(gpu, errors, "memory", api.nvmlDeviceGetMemoryInfo, handle)
        return None if m is None else MemoryInfo(m.total, m.free, m.used)

    def _throttle(self, gpu: GpuState, errors: list[str]) -> int | None:
        """Clocks-event reasons; the deprecated throttle-reasons name on older pynvml/drivers."""
        api, h = gpu.api, gpu.handle
        if "events_name" not in gpu.skip:
            if not hasattr(api, "nvmlDeviceGetCurrentClocksEventReasons"):
                gpu.skip.add("events_name")
            else:
                try:
                    return api.nvmlDeviceGetCurrentClocksEventReasons(h)
                except NvmlGpuLost as exc:
                    raise Lost() from exc
                except NvmlNotSupported as exc:
                    gpu.skip.add("events_name")
                    if exc.code != _FUNCTION_NOT_FOUND:
                        gpu.skip.add("throttle")
                except NvmlError as exc:
                    errors.append(exc.call)
                    return None
        return call(gpu, errors, "throttle", api.nvmlDeviceGetCurrentClocksThrottleReasons, h)

    def _processes(self, gpu: GpuState, errors: list[str]) -> tuple[ProcessSample, ...]:
        procs = call(gpu, errors, "procs", gpu.api.nvmlDeviceGetComputeRunningProcesses, gpu.handle)
        if not procs:
            return ()
        sm = self._process_utilization(gpu, errors)
        known_gis = {d.gpu_instance_id for d in gpu.mig}
        out: list[ProcessSample] = []
        for p in procs:
            gi = _instance_id(p.gpuInstanceId)
            if gi is not None and gi not in known_gis:
                gpu.mig_stale = True
            used = p.usedGpuMemory
            out.append(
                ProcessSample(
                    pid=p.pid,
                    used_memory_bytes=None if used is None or used == VALUE_NOT_AVAILABLE else used,
                    gpu_instance_id=gi,
                    compute_instance_id=_instance_id(p.computeInstanceId),
                    sm_utilization=sm.get(p.pid),
                )
            )
        return tuple(sorted(out, key=lambda p: p.pid))

    def _process_utilization(self, gpu: GpuState, errors: list[str]) -> dict[int, float]:
        """pid -> SM share (0-1) from the samples newer than the last read's; NOT_FOUND (no
        samples) gives none."""
        if "proc_util" in gpu.skip:
            return {}
        try:
            samples = gpu.api.nvmlDeviceGetProcessUtilization(
                gpu.handle, gpu.last_process_timestamp
            )
        except NvmlGpuLost as exc:
            raise Lost() from exc
        except NvmlNotFound:
            return {}
        except NvmlNotSupported:
            gpu.skip.add("proc_util")
            return {}
        except NvmlError as exc:
            errors.append(exc.call)
            return {}
        latest: dict[int, tuple[int, float]] = {}
        for s in samples:
            stamp, pid = s.timeStamp, s.pid
            if pid not in latest or stamp >= latest[pid][0]:
                latest[pid] = (stamp, min(1.0, s.smUtil / 100))
            gpu.last_process_timestamp = max(gpu.last_process_timestamp, stamp)
        return {pid: share for pid, (_, share) in latest.items()}


def _instance_id(value: int | None) -> int | None:
    if value is None or value == NOT_MIG:
        return None
    return value


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else float(value) * factor


def _int(value: float | None, factor: int = 1) -> int | None:
    return None if value is None else int(value) * factor
