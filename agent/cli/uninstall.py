"""``tessera uninstall``: remove what the agent leaves on a node by design, once it is gone.

The agent does not remove its base CDI spec when it stops (a restart, an upgrade: the claims of
the running pods name it). After the DaemonSet is deleted, this removes it, with any claim spec
and temporary file of the driver's left in the CDI directory, on one node (as root on the host,
or in a Job per node: docs/upgrade.md, "Uninstalling"). It refuses, changing nothing, while an
agent holds the state directory, and while the checkpoint lists a claim prepared in this boot
(its pod may still run and its spec names the base spec): unprepare those first. The state
directory itself is left (``rm -rf /var/lib/tessera`` when not reinstalling).
"""

from __future__ import annotations

from pathlib import Path

from agent.cli.framework import Command, Invocation, Uses
from agent.config import Config
from agent.errors import TesseraError

MAX_NAMED = 5
"""A refusal names at most this many prepared claims."""


class UninstallRefused(TesseraError):
    """Uninstalling now would take files that something still uses."""


def _boot_id(config: Config, state_dir: Path) -> str:
    """The boot the agent's checkpoint is compared with (the simulated node's with --simulate)."""
    if config.simulator.simulate is not None:
        from agent.sim.node import simulated_boot_id

        return simulated_boot_id(state_dir / "sim")
    from agent.bootid import read_boot_id

    return read_boot_id()


def prepared_claims(state_dir: Path, boot_id: str) -> list[str]:
    """The claims the checkpoint lists as prepared in this boot (``namespace/name (uid)``); a
    checkpoint of another boot holds none (nothing prepared survives a reboot)."""
    from agent.fsutil import read_regular_file
    from dra_driver.errors import CheckpointError
    from dra_driver.kubeletplugin.checkpoint import MAX_FILE_BYTES, decode

    path = state_dir / "checkpoint.json"
    try:
        data = read_regular_file(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise UninstallRefused(
            f"cannot read the checkpoint {path}: {exc.strerror or exc}; it says which claims"
            " are prepared, so nothing was removed"
        ) from exc
    try:
        cp, _ = decode(data, str(path))
    except CheckpointError as exc:
        raise UninstallRefused(
            f"{exc}; it says which claims are prepared, so nothing was removed"
        ) from exc
    if cp.boot_id != boot_id:
        return []
    return sorted(f"{e.namespace}/{e.name} ({e.uid})" for e in cp.claims.values())


def driver_files(cdi_root: Path, driver_name: str) -> list[Path]:
    """The driver's files in the CDI directory: its base spec, claim specs and the temporary
    files of interrupted writes (``.k8s.<driver>-*.tmp``)."""
    try:
        names = sorted(p for p in cdi_root.iterdir() if p.is_file() or p.is_symlink())
    except FileNotFoundError:
        return []
    ours, temp = f"k8s.{driver_name}-", f".k8s.{driver_name}-"
    return [
        p
        for p in names
        if (p.name.startswith(ours) and p.suffix == ".json")
        or (p.name.startswith(temp) and p.name.endswith(".tmp"))
    ]


def cmd_uninstall(inv: Invocation) -> int:
    from agent.daemon.paths import DEFAULT_STATE_DIR, agent_paths
    from agent.errors import StateDirInUse
    from agent.statelock import StateLock

    config = inv.get(Config)
    state_dir = config.node.state_dir or DEFAULT_STATE_DIR
    cdi_root = agent_paths(config, state_dir).cdi_root
    driver = config.driver.driver_name
    lock = StateLock(state_dir)
    if state_dir.is_dir():
        try:
            lock.acquire()  # held while we look: no agent starts meanwhile
        except StateDirInUse as exc:
            raise UninstallRefused(
                f"an agent still runs with {state_dir} ({exc}); delete the DaemonSet (or stop the"
                " agent) first: docs/upgrade.md, Uninstalling"
            ) from exc
    try:
        held = prepared_claims(state_dir, _boot_id(config, state_dir)) if lock.held else []
        if held:
            named = ", ".join(held[:MAX_NAMED]) + (
                f" and {len(held) - MAX_NAMED} more" if len(held) > MAX_NAMED else ""
            )
            raise UninstallRefused(
                f"{len(held)} claim{'s' if len(held) > 1 else ''} still prepared on this node:"
                f" {named}; delete their pods and claims while the agent runs (the kubelet then"
                " unprepares them), then uninstall: docs/upgrade.md, Uninstalling"
            )
        removed = []
        for path in driver_files(cdi_root, driver):
            path.unlink(missing_ok=True)
            removed.append(path)
    finally:
        lock.release()
    for path in removed:
        inv.out.write(f"removed {path}\n")
    if not removed:
        inv.out.write(f"nothing of {driver} left in {cdi_root}\n")
    return 0


COMMAND = Command(
    "uninstall",
    "remove the driver's CDI specs from this node once no agent runs and no claim is prepared",
    cmd_uninstall,
    (Uses(Config, ("node", "driver", "daemon")),),
    description="Run on a node after the DaemonSet is deleted (as root on the host, or in a Job"
    " per node): removes the base CDI spec the agent leaves by design, and any claim spec or"
    " temporary file of the driver in the CDI directory. Refuses, removing nothing, while an"
    " agent holds the state directory or a claim is still prepared (docs/upgrade.md).",
)
