from pathlib import Path

import pytest

from agent.bootid import BOOT_ID, read_boot_id
from agent.errors import ConfigError

BOOT = "6f1c3c1e-4e1a-4b8a-9d51-0c1f6f1b2a3d"


def test_read_boot_id(tmp_path: Path) -> None:
    f = tmp_path / "boot_id"
    f.write_text(BOOT + "\n")
    assert read_boot_id(f) == BOOT
    with pytest.raises(ConfigError, match="cannot read the boot id"):
        read_boot_id(tmp_path / "missing")
    f.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        read_boot_id(f)


@pytest.mark.skipif(not BOOT_ID.exists(), reason="no /proc boot id here")
def test_read_real_boot_id() -> None:
    assert len(read_boot_id()) == 36


def test_read_boot_time(tmp_path: Path) -> None:
    from agent.bootid import PROC_STAT, read_boot_time

    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nintr 5\nbtime 1764547200\nprocesses 9\n")
    assert read_boot_time(stat) == 1764547200.0
    stat.write_text("cpu  1 2 3\n")
    with pytest.raises(ConfigError, match="no 'btime <seconds>' line"):
        read_boot_time(stat)
    if PROC_STAT.exists():
        assert read_boot_time() > 0
