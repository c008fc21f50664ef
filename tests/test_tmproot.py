"""The session's temporary directory goes to a tmpfs only when it has room in bytes and in inodes
(a CI machine's /dev/shm ran out of one of them late in a run: tests/tmproot.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests import tmproot


class _Stats:
    def __init__(self, free_bytes: int, free_inodes: int) -> None:
        self.f_frsize = 4096
        self.f_bavail = free_bytes // self.f_frsize
        self.f_favail = free_inodes


def _choose(monkeypatch: pytest.MonkeyPatch, shm: Path, stats: _Stats) -> tuple[Path | None, Any]:
    monkeypatch.delenv("TMPDIR", raising=False)
    monkeypatch.delenv(tmproot.CHOICE, raising=False)
    monkeypatch.delenv(tmproot.OWNER, raising=False)
    monkeypatch.setattr(tmproot, "SHM", shm)
    monkeypatch.setattr(tmproot, "_is_tmpfs", lambda path: path == shm)
    monkeypatch.setattr(tmproot.os, "statvfs", lambda path: stats)
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)  # choose() clears the cache
    config = SimpleNamespace(option=SimpleNamespace(basetemp=None))
    return tmproot.choose(config), config  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("free_bytes", "free_inodes"),
    [(tmproot.MIN_FREE - 4096, 10 * tmproot.MIN_INODES), (8 * tmproot.MIN_FREE, 131_072)],
    ids=["too-few-bytes", "too-few-inodes"],
)
def test_a_tmpfs_short_of_bytes_or_inodes_is_not_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, free_bytes: int, free_inodes: int
) -> None:
    root, config = _choose(monkeypatch, tmp_path, _Stats(free_bytes, free_inodes))
    assert root is None
    assert config.option.basetemp is None
    assert "TMPDIR" not in os.environ
    assert list(tmp_path.iterdir()) == []


def test_a_tmpfs_with_room_holds_the_session_and_its_pytest_base(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stats = _Stats(tmproot.MIN_FREE, tmproot.MIN_INODES)
    root, config = _choose(monkeypatch, tmp_path, stats)
    assert root is not None and root.parent == tmp_path
    assert os.environ["TMPDIR"] == str(root)
    assert config.option.basetemp == str(root / "pytest")
