"""The checks of the node's files: the directories the agent writes (CDI specs, the kubelet's
plugin directories, its state directory) and the state directory's lock, the container runtime
that must read the CDI specs, and the NVIDIA Container Toolkit's hook binary.

The agent's directories are checked where the agent sees them (the flags); host files (runtime
configuration, the hook) under ``--host-root``. A CDI directory is taken to be the same path on
the host as in the agent's container (the DaemonSet mounts it so), which is what the runtime's
``cdi_spec_dirs`` must list.

The hook: NVIDIA's toolkit writes ``/usr/bin/nvidia-cdi-hook`` into the specs it generates
(``defaultNvidiaCDIHookPath`` in NVIDIA/nvidia-container-toolkit ``internal/discover/hooks.go``);
the GPU operator installs the toolkit under ``/usr/local/nvidia/toolkit``
(``DefaultNvidiaCDIHookPath`` in NVIDIA/mig-parted); toolkits before ``nvidia-cdi-hook`` existed
ran the same hooks as ``nvidia-ctk hook``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agent.doctor.hostfs import (
    command_line,
    lock_holder,
    nearest_existing,
    probe_write,
    resolve,
)
from agent.doctor.runtime import RuntimeCdi, read_containerd, read_crio
from agent.doctor.verdict import Verdict, fail, ok, skip, warn
from agent.fsutil import disk_trouble
from agent.statelock import LOCK_FILE

"""Finds the toolkit's hook binary on the host (its host path) given the host root."""


def writable_dir(
    check: str, path: Path, flag: str, *, must_exist: str | None = None, subject: str = ""
) -> Verdict:
    """``path`` is a directory the agent can write in. A missing one passes when the agent
    creates it and its nearest existing parent is writable, unless ``must_exist`` says why it
    must be there already."""
    fix_other = f"or choose another directory with {flag}"
    if path.is_dir():
        problem = probe_write(path)
        full = disk_trouble(path) if problem is None else None  # an empty file fits a full disk
        if problem is None and full is None:
            return ok(check, f"{path} is writable", subject=subject)
        if full is not None:
            return fail(
                check,
                f"{full}: the agent's writes there fail",
                f"free space on the file system that holds {path} (df -h {path}) {fix_other}",
                subject=subject,
            )
        return fail(
            check,
            f"{path} is not writable: {problem}",
            f"make it writable for the agent (mounted read-only? mount it read-write) {fix_other}",
            subject=subject,
        )
    if path.exists() or path.is_symlink():
        return fail(
            check,
            f"{path} is not a directory (a file is in the way)",
            f"remove what is at {path} {fix_other}",
            subject=subject,
        )
    parent = nearest_existing(path)
    if must_exist is not None:
        return fail(
            check,
            f"{path} does not exist ({must_exist})",
            f"set {flag} to the directory that exists for this, e.g. <kubelet --root-dir>/"
            f"{path.name}",
            subject=subject,
        )
    if not parent.is_dir():
        return fail(
            check,
            f"{path} cannot be created: {parent} is not a directory",
            f"remove what is at {parent} {fix_other}",
            subject=subject,
        )
    problem = probe_write(parent)
    if problem is not None:
        return fail(
            check,
            f"{path} does not exist and cannot be created: {parent} is not writable ({problem})",
            f"create {path} for the agent {fix_other}",
            subject=subject,
        )
    return ok(
        check,
        f"{path} does not exist yet; the agent creates it ({parent} is writable)",
        subject=subject,
    )


def check_cdi_dir(cdi_root: Path) -> Verdict:
    return writable_dir("cdi-dir", cdi_root, "--cdi-root")


def check_kubelet_dirs(registry_dir: Path, plugins_dir: Path) -> list[Verdict]:
    """The kubelet's plugin registry must exist (the kubelet watches it; missing means another
    kubelet root); the plugins directory the agent creates when needed."""
    return [
        writable_dir(
            "kubelet-dirs",
            registry_dir,
            "--kubelet-registry-dir",
            must_exist="the kubelet makes it and watches it for plugins' registration sockets",
            subject="registry",
        ),
        writable_dir("kubelet-dirs", plugins_dir, "--kubelet-plugins-dir", subject="plugins"),
    ]


def _runtime_verdict(cdi: RuntimeCdi, host_root: Path, cdi_root: Path) -> Verdict:
    name = cdi.runtime
    where = ", ".join(cdi.files) or "no configuration file: built-in defaults"
    restart = "restart containerd" if name == "containerd" else "restart CRI-O"
    if cdi.problem is not None:
        return fail(
            "cdi-runtime",
            cdi.problem,
            f"fix the configuration ({where}), then {restart}",
            subject=name,
        )
    if cdi.enabled is False:
        return fail(
            "cdi-runtime",
            f"CDI is off ({where}): pods of claims would start without their GPUs",
            f"set enable_cdi = true in {cdi.table} and {restart}",
            subject=name,
        )
    ours = resolve(host_root, str(cdi_root.absolute()))
    reads = {resolve(host_root, d): d for d in cdi.spec_dirs}
    if ours not in reads:
        return fail(
            "cdi-runtime",
            f"reads CDI specs from {', '.join(cdi.spec_dirs) or 'nowhere'}, not from the"
            f" agent's --cdi-root {cdi_root} ({where})",
            f"run the agent with --cdi-root set to one of them, or add {cdi_root} to"
            f" cdi_spec_dirs in {cdi.table} and {restart}",
            subject=name,
        )
    if cdi.enabled is None:
        return warn(
            "cdi-runtime",
            f"enable_cdi is not set ({where}): CDI is {cdi.unset_means}",
            f"on containerd 1.7 set enable_cdi = true in {cdi.table} and {restart}",
            subject=name,
        )
    return ok("cdi-runtime", f"CDI on; reads {reads[ours]} ({where})", subject=name)


def check_runtimes(host_root: Path, cdi_root: Path, *, in_pod: bool = False) -> list[Verdict]:
    """Each container runtime found on the host reads the agent's CDI directory. ``in_pod``
    with the host root ``/``: the doctor runs in a pod that does not mount the host's ``/`` (the
    ``container-driver`` overlay mounts only the driver root), so the pod's own ``/etc`` says
    nothing about the host's runtime: skipped, not a warning about a runtime that is there."""
    if in_pod and host_root == Path("/"):
        return [
            skip(
                "cdi-runtime",
                "not checked: this pod does not see the host's / (no --host-root), so the"
                " host's containerd or CRI-O configuration is not visible here; run `tessera"
                " doctor` on the host, or mount the host's / read-only and set --host-root",
            )
        ]
    found = [r for r in (read_containerd(host_root), read_crio(host_root)) if r is not None]
    if not found:
        return [
            warn(
                "cdi-runtime",
                f"no containerd or CRI-O found under --host-root {host_root} (looked for their"
                " configuration in /etc, their sockets in /run and their binaries)",
                "set --host-root to where the host's / is mounted (the DaemonSet mounts it at"
                " /host-root); the runtime must have CDI on and read --cdi-root",
            )
        ]
    return [_runtime_verdict(r, host_root, cdi_root) for r in found]


def check_cdi_hook(hook: str | None) -> Verdict:
    """The hook the agent's CDI specs run (``agent.daemon.cdi_hook``: --cdi-hook-path, else
    the toolkit's binary found under the driver root), or a warning for the hook-free layout."""
    if hook is None:
        return warn(
            "cdi-hook",
            "no NVIDIA Container Toolkit hook (nvidia-cdi-hook or nvidia-ctk) under the driver"
            " root: the CDI specs use the hook-free layout (the SONAME links mounted as files,"
            " and the libraries under /usr/local/nvidia/lib64)",
            "optional: install the NVIDIA Container Toolkit (nvidia-container-toolkit-base) on"
            " the host for the toolkit's create-symlinks and update-ldcache hooks, or name its"
            " binary with --cdi-hook-path",
        )
    return ok("cdi-hook", f"{hook} (the toolkit's hook, run by the CDI specs)")


def check_state_dir(state_dir: Path) -> Verdict:
    return writable_dir("state-dir", state_dir, "--state-dir")


def _is_agent(argv: Sequence[str]) -> bool:
    """``tessera run`` (however it was started: the script, ``python -m agent.cli``)."""
    names = [Path(a).name for a in argv]
    for i, name in enumerate(names):
        if name in ("tessera", "agent.cli") and "run" in names[i + 1 :]:
            return True
    return False


def check_state_lock(state_dir: Path, proc_root: Path = Path("/proc")) -> Verdict:
    """Whether an agent, or something else, holds the state directory's lock."""
    lock = state_dir / LOCK_FILE
    if not lock.exists():
        return ok("state-lock", f"{lock} does not exist yet: no agent has run here")
    pid = lock_holder(lock, proc_root / "locks")
    if pid is None:
        return ok("state-lock", f"{lock} is free: no agent runs on this state directory")
    argv = command_line(pid, proc_root)
    shown = " ".join(argv)[:120] if argv else "its command line cannot be read"
    if argv and _is_agent(argv):
        return ok("state-lock", f"held by the running agent (PID {pid}: {shown})")
    return fail(
        "state-lock",
        f"{lock} is held by PID {pid} ({shown}), not by a running agent: an agent started on"
        " this state directory exits at once",
        f"stop PID {pid}, or run the agent with another --state-dir",
    )
