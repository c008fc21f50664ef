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

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from agent.fsutil import fsync_dir
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


class StateStore:
    """The state of one model, kept in a directory and shared between processes."""

    def __init__(self, state_dir: Path, model: NodeModel) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / STATE_FILE
        self._lock_path = self.dir / LOCK_FILE
        self._model = model
        self._thread_lock = threading.RLock()
        self._state = initial_state(model)
        self._seen: tuple[int, int, int] | None = None

    # -- locking and raw I/O ----------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing the descriptor releases the flock

    def _stat_key(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _decode_file(self) -> SimState:
        """Read and decode the file; :class:`StateFormatError` when it is unusable."""
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StateFormatError(f"cannot read {self.path}: {exc}") from exc
        return state_from_json(raw)

    def _save(self, state: SimState) -> None:
        data = json.dumps(state_to_json(state), indent=1, sort_keys=True) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=".nvml-state.", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        fsync_dir(self.dir)
        self._state = state
        self._seen = self._stat_key()

    def _refresh(self) -> None:
        """Reload when the file changed since it was last seen; keep the cache otherwise."""
        key = self._stat_key()
        if key is None or key == self._seen:
            return
        try:
            state = self._decode_file()
        except StateFormatError as exc:
            log.error("ignoring unreadable simulator state %s: %s", self.path, exc)
            self._seen = key
            return
        if not belongs_to(state, self._model):
            log.error("ignoring simulator state %s of another model %r", self.path, state.model)
            self._seen = key
            return
        self._state = state
        self._seen = key

    # -- public -----------------------------------------------------------------------------
    def open(self, init: Callable[[SimState | None], SimState]) -> SimState:
        """Load the stored state and pass it (or None when absent or unusable) through ``init``.

        A corrupt file is moved aside to ``nvml-state.json.corrupt``; a state of another model is
        treated as absent. ``init``'s result is saved and becomes the current state.
        """
        with self._locked():
            stored: SimState | None = None
            if self.path.exists():
                try:
                    stored = self._decode_file()
                except StateFormatError as exc:
                    aside = self.path.with_name(STATE_FILE + ".corrupt")
                    log.warning(
                        "simulator state %s is unusable (%s); moved to %s", self.path, exc, aside
                    )
                    os.replace(self.path, aside)
                if stored is not None and not belongs_to(stored, self._model):
                    log.warning(
                        "simulator state %s belongs to model %r, not %r; starting fresh",
                        self.path,
                        stored.model,
                        self._model.name,
                    )
                    stored = None
            self._save(init(stored))
            return self._state

    def read(self) -> SimState:
        """The current state, reloaded from disk when another writer changed it."""
        with self._thread_lock:
            self._refresh()
            return self._state

    def update(self, change: Callable[[SimState], tuple[SimState, T]]) -> T:
        """Apply ``change`` under the lock to the freshest state; save when it changed.

        ``change`` returns ``(new_state, result)``; an exception leaves the stored state as it
        was. Returns ``result``.
        """
        with self._locked():
            self._refresh()
            new_state, result = change(self._state)
            if new_state != self._state:
                self._save(new_state)
            return result
