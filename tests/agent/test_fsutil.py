"""``agent.fsutil.disk_trouble``: whether a directory's file system can take a write now (the
agent's ``disk`` readiness check). The real disks (a full and a read-only tmpfs) are in
tests/integration/test_disk_trouble.py; here the file system's answers are given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.fsutil import DISK_HEADROOM_BYTES, disk_trouble, read_regular_file


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


# --- read_regular_file: files in directories others can write (issue 23, item 10) ---


def test_read_regular_file_reads_a_small_regular_file(tmp_path: Path) -> None:
    p = tmp_path / "spec.json"
    p.write_bytes(b'{"a": 1}')
    assert read_regular_file(p, 100) == b'{"a": 1}'


def test_read_regular_file_does_not_block_on_a_fifo(tmp_path: Path) -> None:
    """A FIFO with no writer would block a plain open() (and the agent's start) forever."""
    p = tmp_path / "spec.json"
    os.mkfifo(p)
    with pytest.raises(OSError, match=r"not a regular file \(a FIFO\)") as info:
        read_regular_file(p, 100)
    assert str(p) in str(info.value)


def test_read_regular_file_does_not_follow_a_symlink(tmp_path: Path) -> None:
    """A link to /dev/zero would be read without end; a link to a regular file is refused too
    (it could name any file the agent may read)."""
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    with pytest.raises(OSError, match="a symbolic link, not followed"):
        read_regular_file(zero, 100)
    target = tmp_path / "real"
    target.write_bytes(b"{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(OSError, match="a symbolic link, not followed"):
        read_regular_file(link, 100)


def test_read_regular_file_refuses_a_device_and_a_directory(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"not a regular file \(a character device\)"):
        read_regular_file(Path("/dev/zero"), 100)
    with pytest.raises(OSError, match=r"not a regular file \(a directory\)"):
        read_regular_file(tmp_path, 100)


def test_read_regular_file_refuses_a_large_file_before_reading_it(tmp_path: Path) -> None:
    """A sparse 300 MB file costs no disk; reading it whole would cost 300 MB of memory."""
    p = tmp_path / "big.json"
    with p.open("wb") as f:
        f.truncate(300 * 1024 * 1024)
    with pytest.raises(OSError, match=r"314572800 bytes, more than the 4096 allowed"):
        read_regular_file(p, 4096)
    exact = tmp_path / "exact.json"
    exact.write_bytes(b"x" * 4096)
    assert len(read_regular_file(exact, 4096)) == 4096


def test_read_regular_file_missing_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "absent", 100)


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
