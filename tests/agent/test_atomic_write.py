"""``agent.fsutil.atomic_write``: the whole new file or the old one, with exactly the modes asked,
a missing directory made, and no temporary file left behind (the checkpoint, CDI specs and
every state file are written through it)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.fsutil import atomic_write, temp_name_prefix


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask of 000, the one that would make files world-writable if modes were left to it."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _temps(directory: Path, path: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.startswith(temp_name_prefix(path))]


@pytest.mark.parametrize("sync", [True, False], ids=["synced", "unsynced"])
def test_the_file_holds_the_data_with_exactly_its_mode(
    tmp_path: Path, open_umask: None, sync: bool
) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b"old contents, longer than the new")
    atomic_write(path, b"new", mode=0o644, sync=sync)
    assert path.read_bytes() == b"new"
    assert _mode(path) == 0o644
    assert _temps(tmp_path, path) == []


def test_a_missing_directory_and_its_parents_are_made_with_the_mode_asked(
    tmp_path: Path, open_umask: None
) -> None:
    path = tmp_path / "a" / "b" / "spec.json"
    atomic_write(path, b"{}", mode=0o600, dir_mode=0o711)
    assert path.read_bytes() == b"{}"
    assert (_mode(tmp_path / "a"), _mode(tmp_path / "a" / "b")) == (0o711, 0o711)
    assert _mode(path) == 0o600


def test_data_larger_than_one_write_is_written_whole(tmp_path: Path) -> None:
    data = os.urandom(3 << 20) + b"end"
    path = tmp_path / "big"
    atomic_write(path, data, sync=False)
    assert path.read_bytes() == data


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b"old")

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as raised:
        atomic_write(path, b"new")
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert _temps(tmp_path, path) == []
