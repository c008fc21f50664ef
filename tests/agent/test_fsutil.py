"""``agent.fsutil.disk_trouble``: whether a directory's file system can take a write now (the
agent's ``disk`` readiness check). The real disks (a full and a read-only tmpfs) are in
tests/integration/test_disk_trouble.py; here the file system's answers are given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.fsutil import DISK_HEADROOM_BYTES, disk_trouble


def statvfs(
    *, blocks_free: int, read_only: bool = False, inodes_free: int = 100
) -> os.statvfs_result:
    """A file system of 4 KiB blocks with ``blocks_free`` free (for root and for others)."""
    flag = os.ST_RDONLY if read_only else 0
    return os.statvfs_result(
        (4096, 4096, 1000, blocks_free, blocks_free, 1000, inodes_free, inodes_free, flag, 255)
    )


def test_a_writable_directory_with_room_has_no_trouble(tmp_path: Path) -> None:
    assert disk_trouble(tmp_path) is None


def test_read_only_full_and_out_of_inodes_each_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def answers(result: os.statvfs_result) -> None:
        monkeypatch.setattr(os, "statvfs", lambda path: result)

    answers(statvfs(blocks_free=1000, read_only=True))
    assert disk_trouble(tmp_path) == f"{tmp_path}: Read-only file system"

    room = DISK_HEADROOM_BYTES + 10 * 4096
    answers(statvfs(blocks_free=room // 4096))
    assert disk_trouble(tmp_path, need=10 * 4096) is None
    assert disk_trouble(tmp_path, need=10 * 4096 + 1) == (
        f"{tmp_path}: No space left on device ({room} bytes free, a write needs {room + 1})"
    )

    answers(statvfs(blocks_free=1000, inodes_free=0))
    assert disk_trouble(tmp_path) == f"{tmp_path}: No space left on device (no free inode)"


def test_a_directory_not_made_yet_is_judged_by_the_one_above(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[Path] = []
    real = os.statvfs

    def statvfs_(path: Path) -> os.statvfs_result:
        asked.append(Path(path))
        return real(path)

    monkeypatch.setattr(os, "statvfs", statvfs_)
    assert disk_trouble(tmp_path / "cdi" / "deeper") is None
    assert asked == [tmp_path / "cdi" / "deeper", tmp_path / "cdi", tmp_path]


def test_read_regular_file_refuses_links_special_files_and_big_files(tmp_path):
    from agent.fsutil import FileRefused, read_regular_file

    (tmp_path / "f").write_bytes(b"x" * 10)
    (tmp_path / "link").symlink_to(tmp_path / "f")
    os.mkfifo(tmp_path / "fifo")  # opened without blocking, refused before any read
    assert read_regular_file(tmp_path / "f", 10) == b"x" * 10
    with pytest.raises(FileRefused, match="a symbolic link"):
        read_regular_file(tmp_path / "link", 10)
    with pytest.raises(FileRefused, match="not a regular file"):
        read_regular_file(tmp_path / "fifo", 10)
    with pytest.raises(FileRefused, match="11 bytes, more than the 10 allowed"):
        (tmp_path / "f").write_bytes(b"x" * 11)
        read_regular_file(tmp_path / "f", 10)
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "missing", 10)
