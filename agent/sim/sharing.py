"""The simulated driver's GPU-sharing settings and MPS control daemons, and their on-disk store.

A sibling of :mod:`agent.sim.state` (MIG) and :mod:`agent.sim.telemetry_state` (load, faults):
``<state_dir>/sharing-state.json`` under ``<state_dir>/sharing-state.lock``, with the same
discipline (lock -> reload -> pure change -> atomic save), so that a running agent, the simulated
``nvidia-smi`` and ``nvidia-cuda-mps-control`` (:mod:`agent.sim.tools`) and ``tessera sim`` see
the same node:

* per GPU: the compute mode (NVML's ``NVML_COMPUTEMODE_*`` values) and the time-slice
  (``nvidia-smi compute-policy --set-timeslice``: 0 default, 1 short, 2 medium, 3 long);
* every MPS control daemon started with the simulated ``nvidia-cuda-mps-control -d``: its pid,
  pipe and log directories, the devices it serves and the defaults its clients set.

Everything here except :class:`SharingStore`, :func:`start_ticks` and :func:`live_daemons` is
pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent.sim.jsonstore import SharedJsonStore
from agent.sim.model import NodeModel

STATE_FILE = "sharing-state.json"
LOCK_FILE = "sharing-state.lock"
API_VERSION = "tessera.sim/v1"
KIND = "SharingState"

COMPUTE_MODE_DEFAULT = 0
COMPUTE_MODE_EXCLUSIVE_THREAD = 1
"""Removed from NVML (CUDA 4.0 replaced it); never a valid setting."""
COMPUTE_MODE_PROHIBITED = 2
COMPUTE_MODE_EXCLUSIVE_PROCESS = 3
COMPUTE_MODES = (COMPUTE_MODE_DEFAULT, COMPUTE_MODE_PROHIBITED, COMPUTE_MODE_EXCLUSIVE_PROCESS)
"""The compute modes a GPU can be set to."""

TIMESLICES = ("DEFAULT", "SHORT", "MEDIUM", "LONG")
"""``nvidia-smi compute-policy --set-timeslice`` values, by number (0..3)."""

DEFAULT_ACTIVE_THREAD_PERCENTAGE = 100.0


class SharingFormatError(ValueError):
    """A sharing state file that cannot be decoded."""


@dataclass(frozen=True)
class GpuSharing:
    """The sharing settings of one whole GPU."""

    index: int
    uuid: str
    compute_mode: int = COMPUTE_MODE_DEFAULT
    timeslice: int = 0
    persistence_mode: int = 1
    """``NVML_FEATURE_ENABLED`` (1) as nvidia-persistenced leaves a data-centre GPU (the
    simulated driver root runs it), 0 once turned off (``nvmlDeviceSetPersistenceMode``)."""


@dataclass(frozen=True)
class MpsDaemon:
    """An MPS control daemon of the simulated node."""

    pid: int
    start_ticks: int
    """The process's start time (``/proc/<pid>/stat`` field 22): tells a reused pid apart."""
    pipe_dir: str
    log_dir: str
    devices: tuple[str, ...]
    """UUIDs (``GPU-…`` or ``MIG-…``) of the devices it serves, in CUDA_VISIBLE_DEVICES order."""
    active_thread_percentage: float = DEFAULT_ACTIVE_THREAD_PERCENTAGE
    pinned_mem_limits: tuple[tuple[str, int], ...] = ()
    """(device UUID, limit in MiB) for the devices that have a default pinned memory limit."""


@dataclass(frozen=True)
class SharingState:
    model: str
    gpus: tuple[GpuSharing, ...]
    mps_daemons: tuple[MpsDaemon, ...] = ()

    def with_gpu(self, gpu: GpuSharing) -> SharingState:
        """A copy with ``gpu`` replacing the GPU of the same index (pure)."""
        return replace(self, gpus=tuple(gpu if g.index == gpu.index else g for g in self.gpus))

    def with_daemon(self, daemon: MpsDaemon) -> SharingState:
        """A copy where ``daemon`` replaces any record of the same pipe directory (pure)."""
        others = tuple(d for d in self.mps_daemons if d.pipe_dir != daemon.pipe_dir)
        return replace(self, mps_daemons=(*others, daemon))

    def without_daemon(self, pid: int, pipe_dir: str) -> SharingState:
        """A copy without the daemon ``pid`` of ``pipe_dir`` (pure)."""
        kept = tuple(d for d in self.mps_daemons if not (d.pid == pid and d.pipe_dir == pipe_dir))
        return replace(self, mps_daemons=kept)


def initial_sharing(model: NodeModel) -> SharingState:
    """A freshly booted node: every GPU in the Default compute mode and time-slice (pure)."""
    return SharingState(
        model=model.name, gpus=tuple(GpuSharing(g.index, g.uuid) for g in model.gpus)
    )


def compute_mode_name(mode: int) -> str:
    """``nvidia-smi``'s spelling of a compute mode in queries: ``Exclusive_Process`` (pure)."""
    names = {
        COMPUTE_MODE_DEFAULT: "Default",
        COMPUTE_MODE_EXCLUSIVE_THREAD: "Exclusive_Thread",
        COMPUTE_MODE_PROHIBITED: "Prohibited",
        COMPUTE_MODE_EXCLUSIVE_PROCESS: "Exclusive_Process",
    }
    return names.get(mode, f"Unknown ({mode})")


# -- JSON codec (pure) --------------------------------------------------------------------------


def sharing_to_json(state: SharingState) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "model": state.model,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "computeMode": g.compute_mode,
                "timeslice": g.timeslice,
                "persistenceMode": g.persistence_mode,
            }
            for g in state.gpus
        ],
        "mpsDaemons": [
            {
                "pid": d.pid,
                "startTicks": d.start_ticks,
                "pipeDirectory": d.pipe_dir,
                "logDirectory": d.log_dir,
                "devices": list(d.devices),
                "activeThreadPercentage": d.active_thread_percentage,
                "pinnedMemLimitsMiB": dict(d.pinned_mem_limits),
            }
            for d in state.mps_daemons
        ],
    }


def _int(raw: dict[str, Any], key: str) -> int:
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise SharingFormatError(f"{key} must be an integer, got {value!r}")
    return value


def _str(raw: dict[str, Any], key: str) -> str:
    value = raw[key]
    if not isinstance(value, str):
        raise SharingFormatError(f"{key} must be a string, got {value!r}")
    return value


def _daemon_from_json(d: dict[str, Any]) -> MpsDaemon:
    percentage = d["activeThreadPercentage"]
    if not isinstance(percentage, int | float) or isinstance(percentage, bool):
        raise SharingFormatError(f"activeThreadPercentage must be a number, got {percentage!r}")
    limits = d["pinnedMemLimitsMiB"]
    if not isinstance(limits, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in limits.values()
    ):
        raise SharingFormatError(f"pinnedMemLimitsMiB must map devices to integers: {limits!r}")
    devices = d["devices"]
    if not isinstance(devices, list) or not all(isinstance(u, str) for u in devices):
        raise SharingFormatError(f"devices must be a list of UUIDs, got {devices!r}")
    return MpsDaemon(
        pid=_int(d, "pid"),
        start_ticks=_int(d, "startTicks"),
        pipe_dir=_str(d, "pipeDirectory"),
        log_dir=_str(d, "logDirectory"),
        devices=tuple(devices),
        active_thread_percentage=float(percentage),
        pinned_mem_limits=tuple(sorted((str(k), v) for k, v in limits.items())),
    )


def sharing_from_json(raw: object) -> SharingState:
    """Decode :func:`sharing_to_json`'s output; :class:`SharingFormatError` otherwise (pure)."""
    try:
        if not isinstance(raw, dict):
            raise SharingFormatError("state must be a JSON object")
        if raw.get("apiVersion") != API_VERSION or raw.get("kind") != KIND:
            raise SharingFormatError(
                f"unsupported apiVersion/kind {raw.get('apiVersion')!r}/{raw.get('kind')!r}"
            )
        gpus = tuple(
            GpuSharing(
                index=_int(g, "index"),
                uuid=_str(g, "uuid"),
                compute_mode=_int(g, "computeMode"),
                timeslice=_int(g, "timeslice"),
                # absent in a state written before the simulator kept it: the boot default
                persistence_mode=_int(g, "persistenceMode") if "persistenceMode" in g else 1,
            )
            for g in raw["gpus"]
        )
        daemons = tuple(_daemon_from_json(d) for d in raw["mpsDaemons"])
        return SharingState(model=str(raw["model"]), gpus=gpus, mps_daemons=daemons)
    except (KeyError, TypeError, AttributeError) as exc:
        raise SharingFormatError(f"malformed sharing state: {exc!r}") from exc


def belongs_to(state: SharingState, model: NodeModel) -> bool:
    """Whether a decoded state describes this model's GPUs (pure)."""
    return state.model == model.name and [(g.index, g.uuid) for g in state.gpus] == [
        (g.index, g.uuid) for g in model.gpus
    ]


# -- the store (I/O) ----------------------------------------------------------------------------


class SharingStore(SharedJsonStore[SharingState]):
    """The sharing state of one model in ``<state_dir>/sharing-state.json``, shared between
    processes."""

    def __init__(self, state_dir: Path, model: NodeModel) -> None:
        super().__init__(
            Path(state_dir),
            STATE_FILE,
            LOCK_FILE,
            encode=sharing_to_json,
            decode=sharing_from_json,
            belongs=lambda s: belongs_to(s, model),
            empty=initial_sharing(model),
            format_error=SharingFormatError,
        )


# -- which recorded daemons still run (I/O) -------------------------------------------------


def start_ticks(pid: int) -> int | None:
    """A process's start time in clock ticks (``/proc/<pid>/stat`` field 22); None when there is
    no such process or it is a zombie (it has exited)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def live_daemons(state: SharingState) -> list[MpsDaemon]:
    """The recorded MPS daemons whose process still runs (a killed one leaves its record)."""
    return [d for d in state.mps_daemons if start_ticks(d.pid) == d.start_ticks]
