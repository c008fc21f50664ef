"""The node's boot id: it changes on every reboot (prepared partitions do not survive one)."""

from __future__ import annotations

from pathlib import Path

from agent.errors import ConfigError

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def read_boot_id(path: Path = BOOT_ID) -> str:
    """This boot's id. Raises ConfigError (naming the file) when it is unreadable or empty."""
    try:
        boot_id = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the boot id from {path}: {exc.strerror or exc}") from exc
    if not boot_id:
        raise ConfigError(f"the boot id file {path} is empty")
    return boot_id
