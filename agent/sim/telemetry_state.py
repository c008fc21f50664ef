"""The simulated driver's load, counters, health and event log, and their on-disk store.

A sibling of :mod:`agent.sim.state` (the MIG state): ``<state_dir>/telemetry-state.json``, with
the same discipline so that separate processes (the daemon, ``tessera sim fault``, a restarted
daemon) see the same load, counters and faults:

* every change is ``lock -> reload -> mutate -> save`` under an exclusive ``fcntl.flock`` on
  ``<state_dir>/telemetry-state.lock`` (plus a thread lock for threads of one process);
* a save writes a temporary file, fsyncs it, ``os.replace``-s it over the state file and fsyncs
  the directory;
* a read reloads only when the file changed (inode, mtime or size).

Counters are kept as "value at ``since``" plus the current rates (the load), so that a reader
computes the value at any later time without writing: see :mod:`agent.sim.telemetry_model`.
Everything here except :class:`TelemetryStore` is pure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from agent.sim.jsonstore import SharedJsonStore
from agent.sim.model import NodeModel

log = logging.getLogger(__name__)

STATE_FILE = "telemetry-state.json"
LOCK_FILE = "telemetry-state.lock"
API_VERSION = "tessera.sim/v1"
KIND = "TelemetryState"
MAX_EVENTS = 1024
"""Events kept in the log; older ones are dropped (an event set that far behind misses them)."""

T = TypeVar("T")


class TelemetryFormatError(ValueError):
    """A telemetry state file that cannot be decoded."""


@dataclass(frozen=True)
class SimProcess:
    """A compute process the simulator runs on a GPU (or in one of its MIG devices)."""

    pid: int
    used_memory_bytes: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    sm_utilization: float | None = None
    """Share of the whole GPU's SMs (0-1); None: NVML has no utilization sample for it."""
    pod_uid: str | None = None
    """The pod it runs in (its cgroup in the simulated ``/proc``); None: not in a pod."""
    start_time: int = 0
    """When it started, in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""


@dataclass(frozen=True)
class SimGpu:
    """Load, counters and health of one simulated GPU."""

    index: int
    uuid: str
    lost: bool = False
    utilization: float = 0.0
    """Scripted utilization (0-1), added to the processes' SM utilization."""
    memory_used_bytes: int = 0
    """Scripted memory use, added to the processes' memory."""
    processes: tuple[SimProcess, ...] = ()
    since: float = 0.0
    """Clock time the accumulated counters below are valid at."""
    energy_mj: float = 0.0
    nvlink_tx_kib: float = 0.0
    """Per active link (every active link carries the same traffic)."""
    nvlink_rx_kib: float = 0.0
    busy: tuple[tuple[str, float], ...] = ()
    """SM-busy integrals (utilization x seconds) for GPM: ``gpu`` and ``gi<id>``."""
    pcie_replays: int = 0
    ecc_corrected_volatile: int = 0
    ecc_uncorrected_volatile: int = 0
    ecc_corrected_aggregate: int = 0
    ecc_uncorrected_aggregate: int = 0
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remap_pending: bool = False
    power_limit_mw: int | None = None
    """The power limit set with ``nvmlDeviceSetPowerManagementLimit`` since the driver loaded
    (None: the default); kept until a driver reload, as NVML keeps it."""

    def busy_value(self, key: str) -> float:
        return next((v for k, v in self.busy if k == key), 0.0)


@dataclass(frozen=True)
class SimEvent:
    """One NVML event in the node's log; ``seq`` increases by one per event."""

    seq: int
    gpu: int
    event_type: int
    data: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(frozen=True)
class CallFailure:
    """An injected failure: ``call`` (on ``gpu``, or any GPU) raises NVML error ``code``."""

    call: str
    gpu: int | None
    code: int
    remaining: int | None
    """How many more calls fail; None: every call until cleared."""


@dataclass(frozen=True)
class TelemetryState:
    model: str
    gpus: tuple[SimGpu, ...]
    driver_generation: int = 0
    """Incremented by every simulated driver reload."""
    next_seq: int = 1
    events: tuple[SimEvent, ...] = ()
    failures: tuple[CallFailure, ...] = ()
    last_start_time: int = 0
    """The latest start time given to a process (clock ticks): a new process starts later, so a
    PID used again is never taken for the process that had it before."""

    def with_gpu(self, gpu: SimGpu) -> TelemetryState:
        return replace(self, gpus=tuple(gpu if g.index == gpu.index else g for g in self.gpus))

    def with_event(
        self, gpu: int, event_type: int, data: int, gi: int | None = None, ci: int | None = None
    ) -> TelemetryState:
        """A copy with one more event at the end of the log (trimmed to MAX_EVENTS) (pure)."""
        event = SimEvent(self.next_seq, gpu, event_type, data, gi, ci)
        events = (*self.events, event)[-MAX_EVENTS:]
        return replace(self, events=events, next_seq=self.next_seq + 1)


def initial_telemetry(model: NodeModel, now: float) -> TelemetryState:
    """Freshly loaded driver at clock time ``now``: idle GPUs, zero counters (pure)."""
    return TelemetryState(
        model=model.name,
        gpus=tuple(SimGpu(index=g.index, uuid=g.uuid, since=now) for g in model.gpus),
    )


# -- JSON codec (pure) --------------------------------------------------------------------------

_GPU_FIELDS = {
    "lost": "lost",
    "utilization": "utilization",
    "memoryUsedBytes": "memory_used_bytes",
    "since": "since",
    "energyMj": "energy_mj",
    "nvlinkTxKib": "nvlink_tx_kib",
    "nvlinkRxKib": "nvlink_rx_kib",
    "pcieReplays": "pcie_replays",
    "eccCorrectedVolatile": "ecc_corrected_volatile",
    "eccUncorrectedVolatile": "ecc_uncorrected_volatile",
    "eccCorrectedAggregate": "ecc_corrected_aggregate",
    "eccUncorrectedAggregate": "ecc_uncorrected_aggregate",
    "remappedCorrectable": "remapped_correctable",
    "remappedUncorrectable": "remapped_uncorrectable",
    "remapPending": "remap_pending",
}


def telemetry_to_json(state: TelemetryState) -> dict[str, Any]:
    """Encode a state as a JSON-ready mapping (pure)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "model": state.model,
        "driverGeneration": state.driver_generation,
        "nextSeq": state.next_seq,
        "lastStartTime": state.last_start_time,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                **{key: getattr(g, attr) for key, attr in _GPU_FIELDS.items()},
                "busy": dict(g.busy),
                "powerLimitMw": g.power_limit_mw,
                "processes": [
                    {
                        "pid": p.pid,
                        "usedMemoryBytes": p.used_memory_bytes,
                        "gpuInstanceId": p.gpu_instance_id,
                        "computeInstanceId": p.compute_instance_id,
                        "smUtilization": p.sm_utilization,
                        "podUID": p.pod_uid,
                        "startTime": p.start_time,
                    }
                    for p in g.processes
                ],
            }
            for g in state.gpus
        ],
        "events": [
            {
                "seq": e.seq,
                "gpu": e.gpu,
                "type": e.event_type,
                "data": e.data,
                "gpuInstanceId": e.gpu_instance_id,
                "computeInstanceId": e.compute_instance_id,
            }
            for e in state.events
        ],
        "failures": [
            {"call": f.call, "gpu": f.gpu, "code": f.code, "remaining": f.remaining}
            for f in state.failures
        ],
    }


def _opt_int(value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TelemetryFormatError(f"expected an integer or null, got {value!r}")
    return value


def _opt_str(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TelemetryFormatError(f"expected a string or null, got {value!r}")
    return value


def _gpu_from_json(g: dict[str, Any]) -> SimGpu:
    values: dict[str, Any] = {attr: g[key] for key, attr in _GPU_FIELDS.items()}
    for name in ("utilization", "since", "energy_mj", "nvlink_tx_kib", "nvlink_rx_kib"):
        values[name] = float(values[name])
    for name in ("lost", "remap_pending"):
        if not isinstance(values[name], bool):
            raise TelemetryFormatError(f"{name} must be a boolean, got {values[name]!r}")
    return SimGpu(
        index=int(g["index"]),
        uuid=str(g["uuid"]),
        busy=tuple(sorted((str(k), float(v)) for k, v in dict(g["busy"]).items())),
        power_limit_mw=_opt_int(g.get("powerLimitMw")),  # absent in files of earlier builds
        processes=tuple(
            SimProcess(
                pid=int(p["pid"]),
                used_memory_bytes=int(p["usedMemoryBytes"]),
                gpu_instance_id=_opt_int(p["gpuInstanceId"]),
                compute_instance_id=_opt_int(p["computeInstanceId"]),
                sm_utilization=None if p["smUtilization"] is None else float(p["smUtilization"]),
                pod_uid=_opt_str(p.get("podUID")),  # absent in files of earlier builds
                start_time=int(p.get("startTime", 0)),
            )
            for p in g["processes"]
        ),
        **values,
    )


def telemetry_from_json(raw: object) -> TelemetryState:
    """Decode :func:`telemetry_to_json`'s output; :class:`TelemetryFormatError` otherwise."""
    try:
        if not isinstance(raw, dict):
            raise TelemetryFormatError("state must be a JSON object")
        if raw.get("apiVersion") != API_VERSION or raw.get("kind") != KIND:
            raise TelemetryFormatError(
                f"unsupported apiVersion/kind {raw.get('apiVersion')!r}/{raw.get('kind')!r}"
            )
        return TelemetryState(
            model=str(raw["model"]),
            driver_generation=int(raw["driverGeneration"]),
            next_seq=int(raw["nextSeq"]),
            last_start_time=int(raw.get("lastStartTime", 0)),  # absent in earlier builds' files
            gpus=tuple(_gpu_from_json(g) for g in raw["gpus"]),
            events=tuple(
                SimEvent(
                    seq=int(e["seq"]),
                    gpu=int(e["gpu"]),
                    event_type=int(e["type"]),
                    data=int(e["data"]),
                    gpu_instance_id=_opt_int(e["gpuInstanceId"]),
                    compute_instance_id=_opt_int(e["computeInstanceId"]),
                )
                for e in raw["events"]
            ),
            failures=tuple(
                CallFailure(
                    call=str(f["call"]),
                    gpu=_opt_int(f["gpu"]),
                    code=int(f["code"]),
                    remaining=_opt_int(f["remaining"]),
                )
                for f in raw["failures"]
            ),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, TelemetryFormatError):
            raise
        raise TelemetryFormatError(f"malformed telemetry state: {exc!r}") from exc


def belongs_to(state: TelemetryState, model: NodeModel) -> bool:
    """Whether a decoded state describes this model's GPUs (pure)."""
    return state.model == model.name and [(g.index, g.uuid) for g in state.gpus] == [
        (g.index, g.uuid) for g in model.gpus
    ]


# -- the store (I/O) ----------------------------------------------------------------------------


class TelemetryStore(SharedJsonStore[TelemetryState]):
    """The telemetry state of one model in ``<state_dir>/telemetry-state.json``, shared between
    processes."""

    def __init__(self, state_dir: Path, model: NodeModel) -> None:
        super().__init__(
            Path(state_dir),
            STATE_FILE,
            LOCK_FILE,
            encode=telemetry_to_json,
            decode=telemetry_from_json,
            belongs=lambda s: belongs_to(s, model),
            empty=initial_telemetry(model, 0.0),
            format_error=TelemetryFormatError,
        )
