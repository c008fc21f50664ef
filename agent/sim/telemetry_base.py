"""Simulated telemetry: the load model's controls, faults, and what every telemetry call shares.

:class:`TelemetryBase` extends the simulated NVML core with

* an injected ``clock`` (``time.monotonic`` by default; tests pass a fake one). Every value a
  telemetry call returns is computed from the state and the clock, nothing else. Processes
  sharing a state directory should share the clock (CLOCK_MONOTONIC is system-wide); a clock
  reading earlier than the stored state at construction is taken for a reboot (the driver was
  loaded anew: :meth:`~TelemetryBase.reload_driver`);
* the telemetry state (load, counters, health, event log, injected failures) in
  ``<state_dir>/telemetry-state.json`` (:mod:`agent.sim.telemetry_state`), shared by every
  process on the same directory like the MIG state;
* simulator controls (not pynvml functions): :meth:`~TelemetryBase.set_load`,
  :meth:`~TelemetryBase.add_process`, :meth:`~TelemetryBase.remove_process`,
  :meth:`~TelemetryBase.inject_xid`, :meth:`~TelemetryBase.inject_errors`,
  :meth:`~TelemetryBase.lose_gpu`, :meth:`~TelemetryBase.recover_gpu`,
  :meth:`~TelemetryBase.reload_driver`, :meth:`~TelemetryBase.fail_call`,
  :meth:`~TelemetryBase.clear_failures`;
* a ``/proc`` for the processes that run in a pod (``add_process(pod_uid=...)``):
  ``<state_dir>/proc/<pid>/{cgroup,stat}`` as a Kubernetes node has them
  (:mod:`agent.sim.procfs`), kept in step with the processes (a process that ends, or a driver
  reload, removes its directory);
* GpuIsLost: once a GPU is lost, every call that takes one of its handles (GPU, MIG device, GPU
  or compute instance) raises ``NVMLError_GpuIsLost``; handles can still be obtained by index.

The pynvml-named calls are in :mod:`agent.sim.telemetry_calls` (device reads, field values,
processes) and :mod:`agent.sim.telemetry_events` (events, GPM); the load model's arithmetic in
:mod:`agent.sim.telemetry_model`.
"""

from __future__ import annotations

import ctypes
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pynvml

from agent.errors import ConfigError
from agent.sim import handles, telemetry_model
from agent.sim.handles import Ref
from agent.sim.mig import nvml_error
from agent.sim.model import GpuSlot, NodeModel
from agent.sim.nvml_core import NvmlCore
from agent.sim.procfs import CLK_TCK, sync_proc
from agent.sim.state import ComputeInstance, GpuInstance
from agent.sim.telemetry_state import (
    CallFailure,
    SimGpu,
    SimProcess,
    TelemetryState,
    TelemetryStore,
    initial_telemetry,
)

XID_GPU_FELL_OFF_THE_BUS = 79
XID_DOUBLE_BIT_ECC = 48
"""NVIDIA's XID catalog: 48 is "DBE (Double Bit Error) ECC Error", an uncorrectable error the
driver counts in the double-bit (uncorrected) ECC totals (NVML_FI_DEV_ECC_DBE_VOL_TOTAL and
_AGG_TOTAL, nvmlDeviceGetTotalEccErrors with NVML_MEMORY_ERROR_TYPE_UNCORRECTED) and signals as
nvmlEventTypeDoubleBitEccError besides the XID."""
POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
"""A pod's UID as the API server makes it (a lower-case UUID)."""
NOT_MIG = 0xFFFFFFFF
"""NVML's GPU/compute instance id for "not in a MIG device"."""

EVENT_SET_TAG = 0x7E57
GPM_SAMPLE_TAG = 0x7E58


def make_pointer(pointer_type: Any, tag: int, object_id: int) -> Any:
    """A pynvml opaque pointer (event set, GPM sample) naming simulator object ``object_id``."""
    pointer = pointer_type()
    ctypes.c_void_p.from_buffer(pointer).value = (tag << 48) | object_id
    return pointer


def pointer_id(obj: object, pointer_type: Any, tag: int) -> int | None:
    """The object id of a pointer made by :func:`make_pointer`, else None."""
    if not isinstance(obj, pointer_type):
        return None
    address = int(ctypes.cast(obj, ctypes.c_void_p).value or 0)
    return address & 0xFFFFFFFFFFFF if address >> 48 == tag else None


@dataclass
class EventSet:
    """An event set of this process: registered GPUs and what was delivered."""

    registrations: dict[int, tuple[int, int]] = field(default_factory=dict)
    """GPU index -> (event type mask, first event seq it may receive)."""
    delivered: int = 0
    """Seq of the last event returned by a wait."""


@dataclass(frozen=True)
class GpmSample:
    """A GPM sample buffer; filled by nvmlGpmSampleGet / nvmlGpmMigSampleGet."""

    gpu: int | None = None
    scope: str = ""
    """``gpu`` or ``gi<id>``."""
    time: float = 0.0
    busy: float = 0.0
    """SM-busy integral (utilization x seconds) at ``time``."""
    rate: float = 0.0
    """SM utilization at ``time`` (used when two samples are taken at the same time)."""


def _check_fraction(name: str, value: float | None) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name} must be between 0 and 1, got {value!r}")


class TelemetryBase(NvmlCore):
    """Clock, telemetry store, simulator controls and the helpers of the telemetry calls."""

    def __init__(
        self,
        model: NodeModel,
        state_dir: Path,
        *,
        mig_layout: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(model, state_dir, mig_layout=mig_layout)
        self._clock = clock
        self._telemetry = TelemetryStore(self.state_dir, model)
        now = clock()
        opened = self._telemetry.open(
            lambda stored: stored if stored is not None else initial_telemetry(model, now)
        )
        if any(g.since > now for g in opened.gpus):
            # the clock restarted (CLOCK_MONOTONIC after a reboot): the driver was loaded anew
            self.reload_driver()
        self._objects_lock = threading.Lock()
        self._next_object = 1
        self._event_sets: dict[int, EventSet] = {}
        self._gpm_samples: dict[int, GpmSample] = {}

    # -- simulator controls (not pynvml functions) -------------------------------------------
    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    @property
    def telemetry_state(self) -> TelemetryState:
        """The current load, counters and faults (reloaded when another process changed them)."""
        return self._telemetry.read()

    def set_load(
        self, index: int, utilization: float, memory_used_bytes: int | None = None
    ) -> None:
        """Script GPU ``index``'s utilization (0-1) and, when given, its memory use in bytes
        (else the scripted memory stays). Processes add their own load on top."""
        slot = self._slot(index)
        _check_fraction("utilization", utilization)
        if memory_used_bytes is not None and not 0 <= memory_used_bytes <= slot.spec.memory_bytes:
            raise ConfigError(
                f"memory_used_bytes must be between 0 and {slot.spec.memory_bytes}, "
                f"got {memory_used_bytes}"
            )

        def change(g: SimGpu) -> SimGpu:
            memory = g.memory_used_bytes if memory_used_bytes is None else memory_used_bytes
            return replace(g, utilization=float(utilization), memory_used_bytes=memory)

        self._change_gpu(index, change)

    @property
    def proc_root(self) -> Path:
        """The simulated ``/proc`` of the processes that run in a pod."""
        return self.state_dir / "proc"

    def add_process(
        self,
        index: int,
        pid: int,
        used_memory_bytes: int,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
        sm_utilization: float | None = None,
        pod_uid: str | None = None,
    ) -> None:
        """Run process ``pid`` on GPU ``index`` (replacing one with the same pid there).

        On a MIG-enabled GPU it must run in a MIG device: ``gpu_instance_id`` (the compute
        instance defaults to the GPU instance's first). ``sm_utilization`` is its share of the
        whole GPU's SMs (0-1); None: NVML has no utilization sample for it. ``pod_uid``: it runs
        in that pod (its cgroup in :attr:`proc_root` says so). The same pid in the same pod (on
        this or another GPU) is the same process: its start time is kept; otherwise the pid is a
        new process, started now and later than any process before it.
        """
        self._slot(index)
        _check_fraction("sm_utilization", sm_utilization)
        if used_memory_bytes < 0:
            raise ConfigError(f"used_memory_bytes must not be negative, got {used_memory_bytes}")
        if pid <= 0:
            raise ConfigError(f"a pid is a positive number, got {pid}")
        if pod_uid is not None and not POD_UID.fullmatch(pod_uid):
            raise ConfigError(f"{pod_uid!r} is not a pod UID (a lower-case UUID)")
        gi, ci = self._process_instance(index, gpu_instance_id, compute_instance_id)
        now = int(self._clock() * CLK_TCK)

        def change(s: TelemetryState) -> tuple[TelemetryState, None]:
            same = next(
                (p for g in s.gpus for p in g.processes if (p.pid, p.pod_uid) == (pid, pod_uid)),
                None,
            )
            if same is not None:
                started = same.start_time
            else:
                started = max(now, s.last_start_time + 1)
                s = replace(s, last_start_time=started)
            process = SimProcess(pid, used_memory_bytes, gi, ci, sm_utilization, pod_uid, started)
            g = s.gpus[index]
            others = tuple(p for p in g.processes if p.pid != pid)
            return s.with_gpu(replace(g, processes=(*others, process))), None

        self._change_state(index, change)
        self._sync_proc()

    def remove_process(self, index: int, pid: int) -> None:
        """End process ``pid`` on GPU ``index``."""
        self._slot(index)
        if all(p.pid != pid for p in self.telemetry_state.gpus[index].processes):
            raise ConfigError(f"GPU {index} runs no process {pid}")
        self._change_gpu(
            index, lambda g: replace(g, processes=tuple(p for p in g.processes if p.pid != pid))
        )
        self._sync_proc()

    def free_pid(self) -> int:
        """A pid no simulated process has (from 10000 up: above a fresh node's own)."""
        used = {p.pid for g in self.telemetry_state.gpus for p in g.processes}
        return next(pid for pid in range(10_000, 10_000 + len(used) + 1) if pid not in used)

    def inject_xid(
        self,
        index: int,
        xid: int,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
    ) -> None:
        """Raise XID ``xid`` on GPU ``index`` (in a MIG device when the ids are given): every
        event set registered for XID events on that GPU, in any process, receives it. XID 79
        is what a real one is: the GPU has fallen off the bus, so from then on every call on
        its handles raises GpuIsLost, as after :meth:`lose_gpu`, until :meth:`recover_gpu`.
        XID 48 is a double-bit ECC error: the uncorrected ECC counters move by one and the
        double-bit ECC event is raised too (``XID_DOUBLE_BIT_ECC``)."""
        self._slot(index)
        if xid <= 0:
            raise ConfigError(f"an XID is a positive number, got {xid}")
        if compute_instance_id is not None and gpu_instance_id is None:
            raise ConfigError("a compute instance id needs its GPU instance id")
        event = pynvml.nvmlEventTypeXidCriticalError

        def change(s: TelemetryState) -> tuple[TelemetryState, None]:
            if xid == XID_GPU_FELL_OFF_THE_BUS:
                s = s.with_gpu(replace(s.gpus[index], lost=True))
            if xid == XID_DOUBLE_BIT_ECC:
                g = s.gpus[index]
                s = s.with_gpu(
                    replace(
                        g,
                        ecc_uncorrected_volatile=g.ecc_uncorrected_volatile + 1,
                        ecc_uncorrected_aggregate=g.ecc_uncorrected_aggregate + 1,
                    )
                )
                s = s.with_event(index, pynvml.nvmlEventTypeDoubleBitEccError, 0)
            return s.with_event(index, event, xid, gpu_instance_id, compute_instance_id), None

        self._telemetry.update(change)

    def inject_errors(
        self,
        index: int,
        *,
        ecc_corrected: int = 0,
        ecc_uncorrected: int = 0,
        pcie_replays: int = 0,
        remapped_correctable: int = 0,
        remapped_uncorrectable: int = 0,
        remap_pending: bool | None = None,
    ) -> None:
        """Add to GPU ``index``'s error counters (ECC counts go to the volatile and aggregate
        totals and raise the single/double bit ECC events)."""
        self._slot(index)
        amounts = (
            ecc_corrected,
            ecc_uncorrected,
            pcie_replays,
            remapped_correctable,
            remapped_uncorrectable,
        )
        if min(amounts) < 0:
            raise ConfigError("error counts only grow: amounts must not be negative")

        def change(s: TelemetryState) -> tuple[TelemetryState, None]:
            g = s.gpus[index]
            g = replace(
                g,
                ecc_corrected_volatile=g.ecc_corrected_volatile + ecc_corrected,
                ecc_uncorrected_volatile=g.ecc_uncorrected_volatile + ecc_uncorrected,
                ecc_corrected_aggregate=g.ecc_corrected_aggregate + ecc_corrected,
                ecc_uncorrected_aggregate=g.ecc_uncorrected_aggregate + ecc_uncorrected,
                pcie_replays=g.pcie_replays + pcie_replays,
                remapped_correctable=g.remapped_correctable + remapped_correctable,
                remapped_uncorrectable=g.remapped_uncorrectable + remapped_uncorrectable,
                remap_pending=g.remap_pending if remap_pending is None else remap_pending,
            )
            s = s.with_gpu(g)
            if ecc_corrected:
                s = s.with_event(index, pynvml.nvmlEventTypeSingleBitEccError, 0)
            if ecc_uncorrected:
                s = s.with_event(index, pynvml.nvmlEventTypeDoubleBitEccError, 0)
            return s, None

        self._telemetry.update(change)

    def lose_gpu(self, index: int) -> None:
        """GPU ``index`` falls off the bus: XID 79 is raised, then every call on its handles
        raises GpuIsLost until :meth:`recover_gpu`."""
        self._slot(index)
        xid = pynvml.nvmlEventTypeXidCriticalError

        def change(s: TelemetryState) -> tuple[TelemetryState, None]:
            if s.gpus[index].lost:
                return s, None
            s = s.with_gpu(replace(s.gpus[index], lost=True))
            return s.with_event(index, xid, XID_GPU_FELL_OFF_THE_BUS), None

        self._telemetry.update(change)

    def recover_gpu(self, index: int) -> None:
        """GPU ``index`` is back (reset / re-seated); its counters kept counting."""
        self._slot(index)
        self._telemetry.update(lambda s: (s.with_gpu(replace(s.gpus[index], lost=False)), None))

    def reload_driver(self) -> None:
        """Simulate unloading and loading the NVIDIA driver: energy and the other volatile
        counters restart at 0, processes end and the load returns to idle (lost GPUs stay lost;
        MIG state is not touched)."""
        now = self._clock()

        def change(s: TelemetryState) -> tuple[TelemetryState, None]:
            gpus = tuple(telemetry_model.reload_driver(g, now) for g in s.gpus)
            return replace(s, gpus=gpus, driver_generation=s.driver_generation + 1), None

        self._telemetry.update(change)
        self._sync_proc()

    def fail_call(
        self,
        call: str,
        *,
        gpu: int | None = None,
        code: int = pynvml.NVML_ERROR_UNKNOWN,
        times: int | None = 1,
    ) -> None:
        """Make the next ``times`` calls named ``call`` (on GPU ``gpu``, or any) raise NVML error
        ``code``; ``times=None``: every such call until cleared. Applies to the calls that take a
        device handle in :mod:`agent.sim.telemetry_calls` and :mod:`agent.sim.telemetry_events`,
        and to ``nvmlDeviceGetMemoryInfo``."""
        if not call.startswith("nvml"):
            raise ConfigError(f"{call!r} is not an NVML call name")
        if gpu is not None:
            self._slot(gpu)
        if times is not None and times <= 0:
            raise ConfigError(f"times must be positive, got {times}")
        failure = CallFailure(call, gpu, code, times)
        self._telemetry.update(lambda s: (replace(s, failures=(*s.failures, failure)), None))

    def clear_failures(self) -> None:
        self._telemetry.update(lambda s: (replace(s, failures=()), None))

    # -- helpers --------------------------------------------------------------------------------
    def _slot(self, index: int) -> GpuSlot:
        if index not in self._slots:
            raise ConfigError(
                f"GPU index {index} does not exist; model {self.model.name} has GPUs "
                f"0..{len(self._slots) - 1}"
            )
        return self._slots[index]

    def _process_instance(
        self, index: int, gi_id: int | None, ci_id: int | None
    ) -> tuple[int | None, int | None]:
        g = self._gpu_state(index)
        if not g.mig_current:
            if gi_id is not None or ci_id is not None:
                raise ConfigError(f"GPU {index} is not in MIG mode: no instance ids")
            return None, None
        if gi_id is None:
            raise ConfigError(
                f"GPU {index} is in MIG mode: a process runs in a MIG device (gpu_instance_id)"
            )
        gi = g.gpu_instance(gi_id)
        if gi is None or not gi.compute_instances:
            raise ConfigError(f"GPU {index} has no MIG device in GPU instance {gi_id}")
        if ci_id is None:
            return gi_id, gi.compute_instances[0].id
        if gi.compute_instance(ci_id) is None:
            raise ConfigError(
                f"GPU instance {gi_id} of GPU {index} has no compute instance {ci_id}"
            )
        return gi_id, ci_id

    def _gi_sms(self, index: int) -> dict[int, int]:
        """SMs of each GPU instance of GPU ``index`` (empty without MIG)."""
        spec = self._slots[index].spec
        return {
            gi.id: spec.profile(gi.profile_id).multiprocessors
            for gi in self._gpu_state(index).gpu_instances
        }

    def _change_gpu(self, index: int, change: Callable[[SimGpu], SimGpu]) -> None:
        """Accumulate GPU ``index``'s counters to now at the old load, then apply ``change``."""
        self._change_state(index, lambda s: (s.with_gpu(change(s.gpus[index])), None))

    def _change_state(
        self, index: int, change: Callable[[TelemetryState], tuple[TelemetryState, None]]
    ) -> None:
        """As :meth:`_change_gpu`, with ``change`` seeing the whole state (GPU ``index``'s
        counters accumulated to now)."""
        spec = self._slots[index].spec
        now = self._clock()
        gi_sms = self._gi_sms(index)

        def whole(s: TelemetryState) -> tuple[TelemetryState, None]:
            g = telemetry_model.advance(spec, s.gpus[index], now, gi_sms, spec.multiprocessors)
            return change(s.with_gpu(g))

        self._telemetry.update(whole)

    def _sync_proc(self) -> None:
        """The simulated ``/proc`` follows the processes and the device node holders
        (:func:`agent.sim.procfs.sync_proc`)."""
        processes = (p for g in self.telemetry_state.gpus for p in g.processes)
        sync_proc(self.proc_root, processes, self.vm_state.holders)

    def refresh_proc(self) -> None:
        """Rewrite the simulated ``/proc`` now (after a device node holder came or went)."""
        self._sync_proc()

    def _ref(self, handle: object, pointer_type: Any, kinds: tuple[int, ...]) -> Ref:
        """As NvmlCore's, but every handle of a lost GPU raises GpuIsLost."""
        self._require_init()
        ref = handles.decode(handle, pointer_type)
        if ref is not None and ref.gpu in self._slots and self._telemetry.read().gpus[ref.gpu].lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST, f"GPU {ref.gpu} fell off the bus")
        return super()._ref(handle, pointer_type, kinds)

    def _inject(self, call: str, index: int) -> None:
        """Raise an injected failure of ``call`` on GPU ``index``, if one is armed."""
        failures = self._telemetry.read().failures
        if not any(f.call == call and f.gpu in (None, index) for f in failures):
            return

        def consume(s: TelemetryState) -> tuple[TelemetryState, int | None]:
            for i, f in enumerate(s.failures):
                if f.call == call and f.gpu in (None, index):
                    rest = list(s.failures)
                    if f.remaining is None:
                        return s, f.code
                    if f.remaining > 1:
                        rest[i] = replace(f, remaining=f.remaining - 1)
                    else:
                        del rest[i]
                    return replace(s, failures=tuple(rest)), f.code
            return s, None

        code = self._telemetry.update(consume)
        if code is not None:
            raise nvml_error(code, f"injected failure of {call} on GPU {index}")

    def _telemetry_device(
        self, call: str, handle: object, *, mig_handle: bool
    ) -> tuple[GpuSlot, tuple[GpuInstance, ComputeInstance] | None, SimGpu]:
        """Resolve a telemetry call's device handle: its GPU, MIG device (when ``mig_handle``
        calls accept one; else NOT_SUPPORTED) and load. Applies injected failures."""
        slot, instance = self._device(handle)
        if instance is not None and not mig_handle:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED, f"{call} on a MIG device handle")
        self._inject(call, slot.index)
        return slot, instance, self._telemetry.read().gpus[slot.index]

    def _new_object_id(self) -> int:
        with self._objects_lock:
            object_id = self._next_object
            self._next_object += 1
            return object_id

    def _memory_used(self, index: int, gi_id: int | None) -> int:
        """Bytes in use on GPU ``index`` (or in its GPU instance ``gi_id``) per the load."""
        return telemetry_model.memory_used(self._telemetry.read().gpus[index], gi_id)
