"""The root of Tessera's exceptions, and the errors every layer may raise.

Each layer owns its errors in its own ``errors`` module, all subclasses of :class:`TesseraError`
(docs/architecture.md draws the whole tree)::

    agent.errors             TesseraError, ConfigError          (every layer)
    agent.nvml.errors        DriverNotFoundError, NvmlError and its codes
    agent.discovery.errors   DiscoveryError
    agent.pcihost.errors     PciHostError                       (sysfs reads and writes)
    agent.sim.errors         ModelError, MigError               (the simulator)
    dra_driver.errors        KubeError, ClaimError, ParamsError, CheckpointError, CdiError, ...

Errors from libraries (NVML, gRPC, the Kubernetes client, the file system) are translated at the
boundary with ``raise ... from exc`` so callers only ever handle these. ``temporary`` on an error
says whether retrying the same operation later may succeed.
"""

from __future__ import annotations


class TesseraError(Exception):
    """Base of every error Tessera raises on purpose."""

    temporary: bool = False


class ConfigError(TesseraError):
    """A configuration value is wrong.

    The message names the setting, the offending value and what is allowed.
    """


class StateDirInUse(TesseraError):
    """Another agent holds the state directory's lock (one agent per state directory).

    ``path`` is the lock file, ``holder`` the PID written in it (None when unknown)."""

    def __init__(self, path: str, holder: int | None) -> None:
        self.path = path
        self.holder = holder
        who = f"PID {holder}" if holder is not None else "a process whose PID is not recorded"
        super().__init__(
            f"another Tessera agent ({who}) holds {path}: one agent per state directory; stop it"
            " or choose another --state-dir"
        )


class StateDirNotHeld(TesseraError):
    """A write to the state directory was refused: this agent does not hold its lock (not yet,
    while it waits for the agent before it to hand over, or no more, after handing over).

    ``path`` is the lock file."""

    temporary = True

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(
            f"this agent does not hold {path} (it waits for the agent before it to hand the state"
            " directory over, or has handed it over): nothing in the directory is written"
        )


class StateDirLost(StateDirNotHeld):
    """A write to the state directory was refused: the directory (with the lock file in it) was
    deleted or replaced while the agent runs, so the lock no longer keeps a second agent out of
    it. Nothing is written there until a restart takes the directory again (``/healthz`` fails
    its ``state-dir`` check so that the kubelet restarts the agent).

    ``path`` is the lock file."""

    def __init__(self, path: str) -> None:
        self.path = path
        TesseraError.__init__(
            self,
            f"the state directory was deleted or replaced while the agent runs ({path} is no"
            " longer the lock file this agent holds): nothing is written there until the agent"
            " restarts and takes it again",
        )


class DecodeError(TesseraError):
    """Bytes that do not decode within their limits (size, nesting, integer length, YAML
    aliases); the message names what was read and why. Callers turn it into their own error."""
