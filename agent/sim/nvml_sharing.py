"""The simulated NVML's compute-mode calls, and the simulator's sharing controls.

Compute mode is a property of a whole GPU: a MIG device handle gets NOT_SUPPORTED (as every
whole-GPU call of the simulator does), a lost GPU GpuIsLost, ``EXCLUSIVE_THREAD`` (removed from
NVML) and unknown values INVALID_ARGUMENT. The settings live in :mod:`agent.sim.sharing`'s store,
which the simulated ``nvidia-smi`` and ``nvidia-cuda-mps-control`` (:mod:`agent.sim.tools`)
share with every other process on the same state directory.
"""

from __future__ import annotations

from dataclasses import replace

import pynvml

from agent.nvml import api_types as api
from agent.sim.mig import nvml_error
from agent.sim.nvml_core import NvmlCore
from agent.sim.sharing import COMPUTE_MODES, TIMESLICES, MpsDaemon, SharingState


class SharingCalls(NvmlCore):
    """nvmlDeviceGetComputeMode / nvmlDeviceSetComputeMode, nvmlDeviceSetPersistenceMode,
    time-slices and MPS daemons."""

    # -- pynvml calls ----------------------------------------------------------------------------
    def nvmlDeviceGetComputeMode(self, handle: api.DeviceHandle) -> int:
        """An ``NVML_COMPUTEMODE_*`` value (Default after boot)."""
        slot = self._gpu(handle)
        return self._sharing.read().gpus[slot.index].compute_mode

    def nvmlDeviceSetComputeMode(self, handle: api.DeviceHandle, mode: int) -> None:
        """DEFAULT (0), PROHIBITED (2) or EXCLUSIVE_PROCESS (3); takes effect at once."""
        slot = self._gpu(handle)
        if mode not in COMPUTE_MODES:
            raise nvml_error(
                pynvml.NVML_ERROR_INVALID_ARGUMENT,
                f"compute mode {mode!r}; allowed: {', '.join(map(str, COMPUTE_MODES))}",
            )
        self._sharing.update(
            lambda s: (s.with_gpu(replace(s.gpus[slot.index], compute_mode=mode)), None)
        )

    def nvmlDeviceSetPersistenceMode(self, handle: api.DeviceHandle, mode: int) -> None:
        """NVML_FEATURE_DISABLED (0) or NVML_FEATURE_ENABLED (1) on a whole GPU (Linux only, root
        only on a real node; the simulator does not model permissions)."""
        slot = self._gpu(handle)
        if mode not in (pynvml.NVML_FEATURE_DISABLED, pynvml.NVML_FEATURE_ENABLED):
            raise nvml_error(
                pynvml.NVML_ERROR_INVALID_ARGUMENT, f"persistence mode {mode!r}; allowed: 0, 1"
            )
        self._sharing.update(
            lambda s: (s.with_gpu(replace(s.gpus[slot.index], persistence_mode=mode)), None)
        )

    # -- simulator controls (not pynvml functions) -------------------------------------------
    @property
    def sharing_state(self) -> SharingState:
        """Compute modes, time-slices and MPS daemons (reloaded when another process changed
        them)."""
        return self._sharing.read()

    def get_timeslice(self, handle: api.DeviceHandle) -> int:
        """The GPU's time-slice (0 default .. 3 long); NVML's errors for bad or lost handles."""
        slot = self._gpu(handle)
        return self._sharing.read().gpus[slot.index].timeslice

    def set_timeslice(self, handle: api.DeviceHandle, timeslice: int) -> None:
        """Set what ``nvidia-smi compute-policy --set-timeslice`` sets (0..3)."""
        slot = self._gpu(handle)
        if not 0 <= timeslice < len(TIMESLICES):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"time-slice {timeslice!r}")
        self._sharing.update(
            lambda s: (s.with_gpu(replace(s.gpus[slot.index], timeslice=timeslice)), None)
        )

    def record_mps_daemon(self, daemon: MpsDaemon) -> None:
        """Record a started MPS control daemon (replacing a stale record of its pipe dir)."""
        self._sharing.update(lambda s: (s.with_daemon(daemon), None))

    def forget_mps_daemon(self, pid: int, pipe_dir: str) -> None:
        """Remove the record of an MPS control daemon that exits."""
        self._sharing.update(lambda s: (s.without_daemon(pid, pipe_dir), None))
