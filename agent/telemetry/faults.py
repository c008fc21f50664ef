"""Sticky GPU faults that survive a restart of the agent: ``<state-dir>/faults.json``.

A fatal XID holds a GPU unhealthy until a recovery is observed (:mod:`agent.telemetry.gpu_health`).
NVML delivers an XID event once, to the process that was listening, so an agent that restarts
(an upgrade, a crash, a rolling update's handover) would otherwise see a GPU that took a double
bit error as healthy again. The fatal XIDs that hold GPUs now are written here on every change
and restored at start, with the boot id: a reboot resets every GPU, so another boot's faults are
dropped. What a person does about a GPU reset while no agent ran is in docs/reliability.md.

The file is small and ours; one that does not decode (within ``agent.decode``'s limits) or has
the wrong shape is moved aside, logged, and the agent starts without it (the safe side would be
to keep faults, but a broken file names none).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.decode import fields, load_json
from agent.errors import DecodeError
from agent.fsutil import atomic_write, move_aside
from agent.logs import fields_

FAULTS_FILE = "faults.json"
VERSION = 1
MAX_BYTES = 1024 * 1024

Faults = Mapping[str, tuple[int, float]]
"""GPU UUID -> (fatal XID, since: wall-clock seconds when the GPU became unhealthy)."""


def encode(boot_id: str, faults: Faults) -> bytes:
    body = {
        "version": VERSION,
        "bootId": boot_id,
        "gpus": {u: {"xid": x, "since": s} for u, (x, s) in sorted(faults.items())},
    }
    return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()


def decode_faults(raw: bytes, where: str) -> tuple[str, dict[str, tuple[int, float]]]:
    """The boot ID and faults stored in ``raw`` (read with :mod:`agent.decode.fields`; unknown
    fields ignored). Pure; DecodeError naming ``where`` and the field on anything malformed."""
    obj: Any = load_json(raw, where, MAX_BYTES)
    if not isinstance(obj, dict) or obj.get("version") != VERSION:
        raise DecodeError(f"{where}: not a version {VERSION} faults file")
    try:
        boot = fields.text(obj.get("bootId"), "bootId")
        out: dict[str, tuple[int, float]] = {}
        for uuid, entry in fields.obj(obj.get("gpus"), "gpus").items():
            path = f"gpus.{uuid}"
            entry = fields.obj(entry, path)
            xid = fields.integer(entry.get("xid"), f"{path}.xid", low=1)
            out[uuid] = (xid, fields.number(entry.get("since"), f"{path}.since"))
    except fields.FieldError as exc:
        raise DecodeError(f"{where}: {exc}") from exc
    return boot, out


class FaultStore:
    """``<state-dir>/faults.json`` for the boot ``boot_id`` (module docstring)."""

    def __init__(self, state_dir: Path, boot_id: str, log: logging.Logger) -> None:
        self.path = state_dir / FAULTS_FILE
        self.boot_id = boot_id
        self._log = log
        self._saved: dict[str, tuple[int, float]] | None = None

    def load(self, now: float) -> dict[str, tuple[int, float]]:
        """The faults of this boot (empty when there is no file, it is another boot's, or it is
        broken: then it is moved aside and logged)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self._log.error(
                "cannot read the sticky GPU faults; starting without them",
                extra=fields_(path=str(self.path), error=exc.strerror or str(exc)),
            )
            return {}
        try:
            boot, faults = decode_faults(raw, str(self.path))
        except DecodeError as exc:
            try:
                moved: Path | None = move_aside(self.path, now)
            except OSError:
                moved = None
            self._log.error(
                "the sticky GPU faults file is broken; moved aside",
                extra=fields_(path=str(self.path), moved_to=str(moved), reason=str(exc)),
            )
            return {}
        if boot != self.boot_id:
            self._log.info(
                "sticky GPU faults are from another boot (a reboot resets the GPUs); dropped",
                extra=fields_(path=str(self.path), gpus=len(faults)),
            )
            return {}
        self._saved = dict(faults)
        return dict(faults)

    def save(self, faults: Faults) -> None:
        """Write ``faults`` when they differ from what the file holds (atomically, 0640);
        a failure is logged, never raised: the faults still hold in memory."""
        wanted = dict(faults)
        if wanted == self._saved or (not wanted and self._saved is None):
            return
        try:
            atomic_write(self.path, encode(self.boot_id, wanted))
        except OSError as exc:
            self._log.error(
                "cannot save the sticky GPU faults; a restart would forget them",
                extra=fields_(path=str(self.path), error=exc.strerror or str(exc)),
            )
            return
        self._saved = wanted
