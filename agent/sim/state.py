"""The simulated driver's state (MIG mode and instances per GPU) and its on-disk store.

The state is a tree of frozen dataclasses. Everything in this module except :class:`StateStore`
is pure: :func:`initial_state`, :func:`state_to_json` and :func:`state_from_json` compute values
from values. The MIG rules that change a state live in :mod:`agent.sim.mig`.

:class:`StateStore` keeps the state in ``<state_dir>/nvml-state.json`` so that separate processes
(the daemon, a CLI, a restarted daemon) see the same simulated GPUs:

* every change is ``lock -> reload -> mutate -> save`` under an exclusive ``fcntl.flock`` on
  ``<state_dir>/nvml-state.lock`` (plus a thread lock for threads of one process);
* a save writes a temporary file, fsyncs it, ``os.replace``-s it over the state file and fsyncs
  the directory, so a reader never sees a half-written file;
* a read reloads only when the file changed (inode, mtime or size differ from what was last seen).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from agent.sim.jsonstore import SharedJsonStore
from agent.sim.model import NodeModel

log = logging.getLogger(__name__)

STATE_FILE = "nvml-state.json"
LOCK_FILE = "nvml-state.lock"
API_VERSION = "tessera.sim/v1"
KIND = "NvmlState"

T = TypeVar("T")


class StateFormatError(ValueError):
    """A state file that cannot be decoded (corrupt, or written by an incompatible version)."""


@dataclass(frozen=True)
class ComputeInstance:
    """A compute instance inside a GPU instance: compute slices ``[start, start + size)``."""

    id: int
    profile_id: int
    """Compute-instance profile id, equal to its NVML_COMPUTE_INSTANCE_PROFILE_* enum."""
    start: int
    size: int


@dataclass(frozen=True)
class GpuInstance:
    """A GPU instance: memory slots ``[start, start + size)`` of its GPU."""

    id: int
    profile_id: int
    start: int
    size: int
    compute_instances: tuple[ComputeInstance, ...] = ()

    def compute_instance(self, ci_id: int) -> ComputeInstance | None:
        return next((c for c in self.compute_instances if c.id == ci_id), None)


@dataclass(frozen=True)
class GpuState:
    """What the driver remembers about one GPU."""

    index: int
    uuid: str
    mig_current: bool = False
    mig_pending: bool = False
    gpu_instances: tuple[GpuInstance, ...] = ()
    removed: bool = False
    """Hot-removed from the PCI bus (``tessera sim fault remove-gpu``): NVML does not enumerate
    it and sysfs has no function for it until it is added again."""

    def gpu_instance(self, gi_id: int) -> GpuInstance | None:
        return next((g for g in self.gpu_instances if g.id == gi_id), None)

    def mig_devices(self) -> list[tuple[GpuInstance, ComputeInstance]]:
        """Every MIG device (a compute instance with its GPU instance), by (GI id, CI id)."""
        pairs = [(gi, ci) for gi in self.gpu_instances for ci in gi.compute_instances]
        return sorted(pairs, key=lambda p: (p[0].id, p[1].id))


@dataclass(frozen=True)
class SimState:
    """The whole simulated driver state of one node model."""

    model: str
    gpus: tuple[GpuState, ...]

    def with_gpu(self, gpu: GpuState) -> SimState:
        """A copy with ``gpu`` replacing the GPU of the same index (pure)."""
        return replace(self, gpus=tuple(gpu if g.index == gpu.index else g for g in self.gpus))


def initial_state(model: NodeModel) -> SimState:
    """A freshly booted node: MIG disabled everywhere, no instances (pure)."""
    return SimState(
        model=model.name,
        gpus=tuple(GpuState(index=g.index, uuid=g.uuid) for g in model.gpus),
    )


# -- JSON codec (pure) --------------------------------------------------------------------------


def state_to_json(state: SimState) -> dict[str, Any]:
    """Encode a state as a JSON-ready mapping (pure)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "model": state.model,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "migCurrent": g.mig_current,
                "migPending": g.mig_pending,
                "removed": g.removed,
                "gpuInstances": [
                    {
                        "id": gi.id,
                        "profileId": gi.profile_id,
                        "start": gi.start,
                        "size": gi.size,
                        "computeInstances": [
                            {
                                "id": ci.id,
                                "profileId": ci.profile_id,
                                "start": ci.start,
                                "size": ci.size,
                            }
                            for ci in gi.compute_instances
                        ],
                    }
                    for gi in g.gpu_instances
                ],
            }
            for g in state.gpus
        ],
    }


def _int(d: dict[str, Any], key: str) -> int:
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise StateFormatError(f"{key} must be an integer, got {value!r}")
    return value


def _bool(d: dict[str, Any], key: str) -> bool:
    value = d[key]
    if not isinstance(value, bool):
        raise StateFormatError(f"{key} must be a boolean, got {value!r}")
    return value


def state_from_json(raw: object) -> SimState:
    """Decode :func:`state_to_json`'s output; :class:`StateFormatError` when it is not (pure)."""
    try:
        if not isinstance(raw, dict):
            raise StateFormatError("state must be a JSON object")
        if raw.get("apiVersion") != API_VERSION or raw.get("kind") != KIND:
            raise StateFormatError(
                f"unsupported state apiVersion/kind {raw.get('apiVersion')!r}/{raw.get('kind')!r}"
            )
        gpus = tuple(
            GpuState(
                index=_int(g, "index"),
                uuid=str(g["uuid"]),
                mig_current=_bool(g, "migCurrent"),
                mig_pending=_bool(g, "migPending"),
                removed=_bool(g, "removed") if "removed" in g else False,
                gpu_instances=tuple(
                    GpuInstance(
                        id=_int(gi, "id"),
                        profile_id=_int(gi, "profileId"),
                        start=_int(gi, "start"),
                        size=_int(gi, "size"),
                        compute_instances=tuple(
                            ComputeInstance(
                                id=_int(ci, "id"),
                                profile_id=_int(ci, "profileId"),
                                start=_int(ci, "start"),
                                size=_int(ci, "size"),
                            )
                            for ci in gi["computeInstances"]
                        ),
                    )
                    for gi in g["gpuInstances"]
                ),
            )
            for g in raw["gpus"]
        )
        return SimState(model=str(raw["model"]), gpus=gpus)
    except (KeyError, TypeError, AttributeError) as exc:
        raise StateFormatError(f"malformed state: {exc!r}") from exc


def belongs_to(state: SimState, model: NodeModel) -> bool:
    """Whether a decoded state describes this model's GPUs (same name, indices and UUIDs) (pure)."""
    return state.model == model.name and [(g.index, g.uuid) for g in state.gpus] == [
        (g.index, g.uuid) for g in model.gpus
    ]


# -- the store (I/O) ----------------------------------------------------------------------------


class StateStore(SharedJsonStore[SimState]):
    """The MIG state of one model in ``<state_dir>/nvml-state.json``, shared between processes."""

    def __init__(self, state_dir: Path, model: NodeModel) -> None:
        super().__init__(
            Path(state_dir),
            STATE_FILE,
            LOCK_FILE,
            encode=state_to_json,
            decode=state_from_json,
            belongs=lambda s: belongs_to(s, model),
            empty=initial_state(model),
            format_error=StateFormatError,
        )
