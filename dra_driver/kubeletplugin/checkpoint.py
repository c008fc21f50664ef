"""The driver's checkpoint: which claims are prepared on this node, with which devices.

File format (version 1), written with sorted keys::

    {"apiVersion": "tessera.dev/v1", "kind": "Checkpoint", "version": 1, "bootID": "<boot id>",
     "claims": {"<claim uid>": {"uid", "namespace", "name", "state", "updatedAt", "recovered"?,
                                "rebuiltFrom"?,
                                "devices": [{"requestNames", "pool", "device", "cdiDeviceIDs",
                                             "kind", "gpuUUID", "gpuMinor", "migUUID",
                                             "gpuInstanceID", "computeInstanceID"}]}},
     "checksum": "sha256:<hex>"}

The checksum covers the canonical JSON (sorted keys, no whitespace, UTF-8) of the object without
``checksum``. Decoding (with the one field reader, :mod:`agent.decode.fields`) is lenient about
unknown fields (a later build of the same version may add some) and strict about types: a wrong
type is treated like any other corruption, its message naming the field path.

Older formats are converted step by step through ``MIGRATIONS`` (version N -> N+1,
:mod:`dra_driver.kubeletplugin.checkpoint_migrations`). Version 0 is
the pre-release shape (no apiVersion, kind or checksum)::

    {"version": 0, "bootId": "<boot id>",
     "preparedClaims": [{"uid", "namespace", "name", "status": "PrepareStarted|PrepareCompleted",
                         "devices": [{"requests": [...], "pool", "device", "cdiDevices": [...],
                                      "type": "gpu|mig", "uuid", "minor",
                                      "migUuid"?, "giId"?, "ciId"?}]}]}

It had no update time; converted claims get ``updatedAt`` 0.

Version 2 adds optional fields for sharing and dynamic MIG (``placement``, ``sharing``,
``interval``, ``shareID``, ``memoryBytes`` per device; ``mps``, ``pods`` per claim). Version 3
adds a device's power limit (``powerLimitMilliwatts``: what the claim asked;
``powerRestoreMilliwatts``: the GPU's limit before, to set back). A file is version 3 only while a
claim caps a GPU, so that a build that does not know power limits refuses it (``CheckpointTooNew``)
rather than reading it and never restoring the GPU's limit. Version 4 adds the device kinds
``vfio`` and ``vgpu`` (a GPU handed to a virtual machine) and their fields (``pciBusID``,
``iommuGroup``, ``vfioFunctions``: ``[[BDF, driver it had], ...]``, ``vgpuTypeID``, ``mdevUUID``);
a file is version 4 only while a claim holds such a device, for the same reason (a build that
does not know them would call the kind corrupt and never bind the GPU back).

Crash safety: ``save`` replaces the file atomically (temp file, fsync, rename, fsync the
directory). ``load`` never loses a file it cannot read: a corrupt file is moved aside to
``<name>.corrupt-<UTC timestamp>`` (never overwriting an earlier one) and an empty checkpoint is
returned; a file from a newer Tessera is left alone and ``CheckpointTooNew`` raised. A checkpoint
from another boot (the node rebooted: partitions, MPS daemons and device state are gone) loads
as empty with ``rebooted=True``. ``LoadResult.authoritative`` says whether the result proves
anything about claims it does not list (only a file of this boot that decoded does); the
preparer keeps the CDI specs such a result cannot vouch for as ``recovered`` claims, whose
``recovered`` flag is written only when set (so older builds read the file unchanged).

``encode``, ``decode`` and the migrations are pure; ``CheckpointStore`` does the I/O.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.decode import fields, load_json
from agent.errors import DecodeError, TesseraError
from agent.fsutil import atomic_write, holds, move_aside
from agent.jsonout import indented_json
from agent.logs import fields_
from dra_driver.errors import CheckpointCorrupt, CheckpointError, CheckpointTooNew
from dra_driver.kubeletplugin.checkpoint_devices import device_from, device_json
from dra_driver.kubeletplugin.checkpoint_migrations import MIGRATIONS
from dra_driver.kubeletplugin.checkpoint_records import (
    VFIO,
    VGPU,
    VM_KINDS,
    Checkpoint,
    ClaimEntry,
    MpsRecord,
    PreparedDevice,
)

__all__ = [  # the records are defined in checkpoint_records.py and used from here
    "API_VERSION",
    "CHECKPOINT_VERSION",
    "KIND",
    "MIGRATIONS",
    "PREPARE_COMPLETED",
    "PREPARE_STARTED",
    "VFIO",
    "VGPU",
    "VM_KINDS",
    "Checkpoint",
    "CheckpointStore",
    "ClaimEntry",
    "LoadResult",
    "MpsRecord",
    "PreparedDevice",
    "checksum_of",
    "decode",
    "encode",
    "to_json",
]

CHECKPOINT_VERSION = 4
"""The newest format this build reads and writes. A checkpoint is written at the lowest version
that holds its content: version 1 while no claim uses sharing or dynamic MIG (so an older build
still reads it), version 2 once one does, version 3 while one caps a GPU's power, version 4
while one holds a GPU handed to a virtual machine."""
API_VERSION = "tessera.dev/v1"
KIND = "Checkpoint"
PREPARE_STARTED = "PrepareStarted"
PREPARE_COMPLETED = "PrepareCompleted"
STATES = (PREPARE_STARTED, PREPARE_COMPLETED)
CHECKSUM_PREFIX = "sha256:"
FILE_MODE = 0o600
LOWEST_WRITTEN_VERSION = 1
"""Files of this version and newer are current formats; older ones were converted."""
MAX_FILE_BYTES = 64 * 1024 * 1024
"""A checkpoint larger than this is corrupt (10,000 claims take about 10 MiB)."""


@dataclass(frozen=True)
class LoadResult:
    checkpoint: Checkpoint
    rebooted: bool
    """The stored boot id differs from this boot's: the prepared state was discarded."""
    corrupt_moved_to: Path | None
    """A corrupt file was moved here and an empty checkpoint returned."""
    migrated_from: int | None
    """An older format version was read and converted."""
    corrupt_reason: str | None = None
    """Why the moved file was corrupt (for the log and events)."""
    missing: bool = False
    """There was no checkpoint file at all (a first start, or a state directory that was lost)."""

    @property
    def authoritative(self) -> bool:
        """The checkpoint was read from this boot's file: a claim it does not list was released.
        (A missing, corrupt or other-boot checkpoint proves nothing about CDI specs on disk.)"""
        return not (self.missing or self.rebooted or self.corrupt_moved_to is not None)


# --- encoding (pure) --------------------------------------------------------------------------


def _canonical(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def checksum_of(obj: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``obj`` without its ``checksum``. Pure."""
    body = {k: v for k, v in obj.items() if k != "checksum"}
    return CHECKSUM_PREFIX + hashlib.sha256(_canonical(body)).hexdigest()


def _mps_json(m: MpsRecord) -> dict[str, Any]:
    return {
        "pid": m.pid,
        "startedAt": m.started_at,
        "pipeDir": m.pipe_dir,
        "logDir": m.log_dir,
        "shmDir": m.shm_dir,
        "devices": list(m.devices),
        "threadPercentage": m.thread_percentage,
        "pinnedMemory": {uuid: b for uuid, b in m.pinned},
    }


def _claim_json(c: ClaimEntry) -> dict[str, Any]:
    out = {
        "uid": c.uid,
        "namespace": c.namespace,
        "name": c.name,
        "state": c.state,
        "devices": [device_json(d) for d in c.devices],
        "updatedAt": c.updated_at,
    }
    if c.recovered:  # written only when set: older builds read the file as before
        out["recovered"] = True
    if c.mps is not None:
        out["mps"] = _mps_json(c.mps)
    if c.pods:
        out["pods"] = list(c.pods)
    if c.rebuilt_from is not None:  # written only when set, like recovered
        out["rebuiltFrom"] = c.rebuilt_from
    return out


def _version(cp: Checkpoint) -> int:
    """The lowest version that holds ``cp`` (see ``CHECKPOINT_VERSION``)."""
    if any(c.needs_v4 for c in cp.claims.values()):
        return 4
    if any(c.needs_v3 for c in cp.claims.values()):
        return 3
    return 2 if any(c.needs_v2 for c in cp.claims.values()) else 1


def to_json(cp: Checkpoint) -> dict[str, Any]:
    """The file object of ``cp`` at the lowest version that holds it, checksum included. Pure."""
    obj: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "version": _version(cp),
        "bootID": cp.boot_id,
        "claims": {uid: _claim_json(cp.claims[uid]) for uid in sorted(cp.claims)},
    }
    obj["checksum"] = checksum_of(obj)
    return obj


def encode(cp: Checkpoint) -> bytes:
    """The file contents for ``cp`` (indented for people; the checksum is over the canonical
    form). Pure."""
    return indented_json(to_json(cp))


# --- decoding (pure): agent.decode.fields, unknown fields ignored ------------------------------


def _mps(value: Any, where: str) -> MpsRecord | None:
    if value is None:
        return None
    obj = fields.obj(value, where)
    g = obj.get
    return MpsRecord(
        pid=fields.integer(g("pid"), f"{where}.pid"),
        started_at=fields.number(g("startedAt"), f"{where}.startedAt"),
        pipe_dir=fields.text(g("pipeDir"), f"{where}.pipeDir"),
        log_dir=fields.text(g("logDir"), f"{where}.logDir"),
        shm_dir=fields.text(g("shmDir"), f"{where}.shmDir"),
        devices=fields.texts(g("devices"), f"{where}.devices", required=True),
        thread_percentage=fields.opt_integer(g("threadPercentage"), f"{where}.threadPercentage"),
        pinned=_pinned(g("pinnedMemory"), f"{where}.pinnedMemory"),
    )


def _pinned(value: Any, where: str) -> tuple[tuple[str, int], ...]:
    if value is None:
        return ()
    obj = fields.obj(value, where)
    return tuple(sorted((k, fields.integer(v, f"{where}[{k!r}]")) for k, v in obj.items()))


def _claim(uid: str, value: Any, where: str) -> ClaimEntry:
    obj = fields.obj(value, where)
    g = obj.get
    stored_uid = fields.text(g("uid"), f"{where}.uid")
    if stored_uid != uid:
        raise fields.FieldError(where, f"stored under {uid!r} but has uid {stored_uid!r}")
    return ClaimEntry(
        uid=uid,
        namespace=fields.text(g("namespace"), f"{where}.namespace"),
        name=fields.text(g("name"), f"{where}.name"),
        state=fields.one_of(g("state"), f"{where}.state", STATES),
        devices=tuple(
            device_from(d, f"{where}.devices[{i}]")
            for i, d in enumerate(fields.objects(g("devices"), f"{where}.devices", required=True))
        ),
        updated_at=fields.number(g("updatedAt"), f"{where}.updatedAt"),
        recovered=fields.flag(obj.get("recovered", False), f"{where}.recovered", default=None),
        mps=_mps(g("mps"), f"{where}.mps"),
        pods=fields.texts(g("pods"), f"{where}.pods", required="pods" in obj),
        rebuilt_from=fields.opt_text(g("rebuiltFrom"), f"{where}.rebuiltFrom"),
    )


def _from_current(obj: Mapping[str, Any]) -> Checkpoint:
    claims = fields.obj(obj.get("claims"), "checkpoint.claims")
    return Checkpoint(
        boot_id=fields.text(obj.get("bootID"), "checkpoint.bootID"),
        claims={uid: _claim(uid, c, f"claims[{uid!r}]") for uid, c in claims.items()},
    )


def decode(data: bytes, source: str = "<checkpoint>") -> tuple[Checkpoint, int | None]:
    """The checkpoint stored in ``data`` and the older version it was migrated from (or None).

    Pure. Raises CheckpointCorrupt (unreadable JSON, wrong kind, bad checksum, wrong types) or
    CheckpointTooNew (a version newer than ``CHECKPOINT_VERSION``; ``source`` names the file).
    """
    try:
        obj = load_json(data, "checkpoint", MAX_FILE_BYTES)
    except DecodeError as exc:
        raise CheckpointCorrupt(str(exc)) from exc
    if not isinstance(obj, dict):
        raise CheckpointCorrupt(f"expected a JSON object, got {type(obj).__name__}")
    try:
        return _decode(obj, source)
    except fields.FieldError as exc:
        raise CheckpointCorrupt(str(exc)) from exc


def _decode(obj: dict[str, Any], source: str) -> tuple[Checkpoint, int | None]:
    version = fields.integer(obj.get("version"), "checkpoint.version")
    if version >= 1 and obj.get("kind") != KIND:
        raise CheckpointCorrupt(f"kind is {obj.get('kind')!r}, not {KIND!r}")
    if version > CHECKPOINT_VERSION:
        raise CheckpointTooNew(source, version, CHECKPOINT_VERSION)
    if version not in MIGRATIONS and version != CHECKPOINT_VERSION:
        raise CheckpointCorrupt(f"unknown checkpoint version {version}")
    if version >= 1:
        if obj.get("apiVersion") != API_VERSION:
            raise CheckpointCorrupt(f"apiVersion is {obj.get('apiVersion')!r}, not {API_VERSION!r}")
        stored = fields.text(obj.get("checksum"), "checkpoint.checksum")
        if stored != checksum_of(obj):
            raise CheckpointCorrupt("checksum mismatch: the file was changed or partly written")
    current = obj
    for v in range(version, CHECKPOINT_VERSION):
        current = MIGRATIONS[v](current)
    # version 1 is current too (it is what a checkpoint without version-2 content is written as)
    return _from_current(current), (version if version < LOWEST_WRITTEN_VERSION else None)


# --- I/O --------------------------------------------------------------------------------------


class CheckpointStore:
    """The checkpoint file at ``path`` for the boot ``boot_id``.

    Not locked: the caller serializes load/save (prepare holds its lock around both).
    ``clock`` (unix seconds) only names moved-aside corrupt files; ``log`` gets what ``load``
    found (a corrupt file moved aside, an older format converted, another boot's state).
    ``guard`` is entered around every write (the state directory's lock,
    ``agent.statelock.StateLock.guard``: a process that does not hold the directory never writes
    the checkpoint); a TesseraError it raises becomes a CheckpointError.
    """

    def __init__(
        self,
        path: Path,
        boot_id: str,
        *,
        clock: Callable[[], float] = time.time,
        log: logging.Logger | None = None,
        guard: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        self.path = Path(path)
        self.boot_id = boot_id
        self._clock = clock
        self._log = log or logging.getLogger("tessera.checkpoint")
        self._guard = guard

    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        try:
            with self._guard():
                yield
        except CheckpointError:
            raise
        except TesseraError as exc:
            raise CheckpointError(f"cannot {what} checkpoint {self.path}: {exc}") from exc

    def load(self) -> LoadResult:
        """Read the checkpoint (see the module docstring for what each case returns).

        Raises CheckpointTooNew for a newer format (the file is left alone) and CheckpointError
        when the file cannot be read or a corrupt one cannot be moved aside.
        """
        empty = Checkpoint(self.boot_id)
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return LoadResult(
                empty, rebooted=False, corrupt_moved_to=None, migrated_from=None, missing=True
            )
        except OSError as exc:
            raise CheckpointError(
                f"cannot read checkpoint {self.path}: {exc.strerror or exc}"
            ) from exc
        try:
            stored, migrated_from = decode(data, str(self.path))
        except CheckpointCorrupt as exc:
            moved = self._move_aside()
            self._log.warning(
                "checkpoint is corrupt; moved it aside and starting empty",
                extra=fields_(path=str(self.path), moved_to=str(moved), reason=str(exc)),
            )
            return LoadResult(
                empty,
                rebooted=False,
                corrupt_moved_to=moved,
                migrated_from=None,
                corrupt_reason=str(exc),
            )
        if migrated_from is not None:
            self._log.info(
                "checkpoint converted from an older format",
                extra=fields_(path=str(self.path), version=migrated_from),
            )
        if stored.boot_id != self.boot_id:
            self._log.info(
                "checkpoint is from another boot; prepared state discarded",
                extra=fields_(path=str(self.path), claims=len(stored.claims)),
            )
            return LoadResult(
                empty, rebooted=True, corrupt_moved_to=None, migrated_from=migrated_from
            )
        return LoadResult(
            stored, rebooted=False, corrupt_moved_to=None, migrated_from=migrated_from
        )

    def holds(self, cp: Checkpoint) -> bool:
        """Whether the file holds ``cp`` exactly as :meth:`save` would write it."""
        return holds(self.path, encode(cp))

    def save(self, cp: Checkpoint) -> None:
        """Replace the file with ``cp`` atomically (mode 0600). Raises CheckpointError."""
        try:
            with self._writing("write"):
                atomic_write(self.path, encode(cp), mode=FILE_MODE)
        except OSError as exc:
            raise CheckpointError(
                f"cannot write checkpoint {self.path}: {exc.strerror or exc}"
            ) from exc

    def _move_aside(self) -> Path:
        """Rename the file to ``<name>.corrupt-<UTC timestamp>[.N]``, never replacing a file."""
        try:
            with self._writing("move aside the corrupt"):
                return move_aside(self.path, self._clock())
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint {self.path} is corrupt and cannot be moved aside: "
                f"{exc.strerror or exc}"
            ) from exc
