"""Where the daemon lives on the node: its state directory (taken with its lock before anything
else touches it) and the kubelet and CDI directories it writes outside it, real or simulated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.config import Config
from agent.errors import ConfigError
from agent.fsutil import ensure_dir
from agent.statelock import StateLock

DEFAULT_STATE_DIR = Path("/var/lib/tessera")
KUBELET_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
KUBELET_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
CDI_ROOT = Path("/var/run/cdi")


@dataclass(frozen=True)
class AgentPaths:
    """The directories the agent writes outside its state directory, as the agent sees them."""

    registry_dir: Path
    """The kubelet's plugin registry (the registration socket goes here)."""
    plugins_dir: Path
    """The kubelet's plugins directory (the DRA socket is ``<dir>/<driver>/dra.sock``)."""
    cdi_root: Path
    """Where the CDI specs of prepared claims are written."""


REAL_PATHS = AgentPaths(KUBELET_REGISTRY_DIR, KUBELET_PLUGINS_DIR, CDI_ROOT)


def simulated_paths(state_dir: Path) -> AgentPaths:
    """Where the simulated node's kubelet and container runtime have these directories."""
    return AgentPaths(
        state_dir / "kubelet" / "plugins_registry", state_dir / "kubelet" / "plugins",
        state_dir / "cdi",
    )  # fmt: skip


def agent_paths(config: Config, state_dir: Path) -> AgentPaths:
    """The kubelet and CDI directories ``tessera run`` with this Config uses (``tessera doctor``
    checks the same ones): the flags, else the real node's, or the simulated node's with
    ``--simulate``."""
    default = REAL_PATHS if config.simulator.simulate is None else simulated_paths(state_dir)
    return AgentPaths(
        registry_dir=config.kubelet.kubelet_registry_dir or default.registry_dir,
        plugins_dir=config.kubelet.kubelet_plugins_dir or default.plugins_dir,
        cdi_root=config.cdi.cdi_root or default.cdi_root,
    )


def take_state_dir(state_dir: Path, *, pod_uid: str | None = None, now: bool = True) -> StateLock:
    """Create the state directory if needed and take its lock before anything else touches it
    (one agent per state directory). Raises ConfigError or StateDirInUse, each one line.
    ``now=False`` (a rolling update): the lock is taken later (``Agent.start``)."""
    if state_dir.exists() and not state_dir.is_dir():
        raise ConfigError(f"--state-dir: {state_dir} is not a directory")
    try:
        ensure_dir(state_dir)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename not in (None, str(state_dir)) else ""
        raise ConfigError(
            f"--state-dir: cannot create {state_dir}: {exc.strerror or exc}{where}"
        ) from exc
    if not state_dir.is_dir():
        raise ConfigError(f"--state-dir: {state_dir} is not a directory")
    lock = StateLock(state_dir, pod_uid)
    if now:
        lock.acquire()
    return lock
