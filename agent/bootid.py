"""The node's boot id: it changes on every reboot (prepared partitions do not survive one)."""

from __future__ import annotations

from pathlib import Path

from agent.errors import ConfigError

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
PROC_STAT = Path("/proc/stat")


def read_boot_id(path: Path = BOOT_ID) -> str:
    """This boot's id. Raises ConfigError (naming the file) when it is unreadable or empty."""
    try:
        boot_id = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the boot id from {path}: {exc.strerror or exc}") from exc
    if not boot_id:
        raise ConfigError(f"the boot id file {path} is empty")
    return boot_id


def read_boot_time(path: Path = PROC_STAT) -> float:
    """When this boot started, in unix seconds (``btime`` of ``/proc/stat``): a file written
    before it cannot belong to anything running now. Raises ConfigError when unreadable."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the boot time from {path}: {exc.strerror or exc}") from exc
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "btime" and value.strip().isdigit():
            return float(value.strip())
    raise ConfigError(f"{path} has no 'btime <seconds>' line")
