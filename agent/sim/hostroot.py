"""Write the host a simulated node would have, as ``tessera doctor`` reads it through
``--host-root``: device nodes, a containerd configured for CDI and the kubelet's plugin
directories. (The toolkit's hook is looked for under the driver root, as the agent does; the
simulated driver root has none, so a simulated node uses the hook-free layout.)

Layout under ``root`` (as the host has it under ``/``)::

    dev/nvidiactl, dev/nvidia-uvm, dev/nvidia-uvm-tools
    dev/nvidia<minor>                          one per GPU (the minor is the NVML index)
    dev/nvidia-caps/nvidia-cap<N>              N = 1 (mig/config), 2 (mig/monitor) and, for
                                               MIG-capable GPUs, every GPU and compute instance
                                               capability minor of the driver root's tables
    etc/containerd/config.toml                 version 2, enable_cdi = true, cdi_spec_dirs with
                                               the defaults and the agent's CDI directories

Device nodes are empty regular files, not character devices: making those takes CAP_MKNOD, and
the simulator runs unprivileged. The doctor accepts them only when it is told it looks at the
simulator (``stand_in_nodes``). The simulated kubelet's directories and the directory its
containerd reads are the simulator's defaults under ``--state-dir`` (outside ``root``): an agent
told other ones (``--cdi-root``, ``--kubelet-registry-dir``) is misconfigured for this node, and
the doctor says so.

Idempotent, like the driver root: unchanged files are left alone, and the GPU nodes of a model
written earlier that this one lacks are removed.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

from agent.sim.driverroot import (
    COMPUTE_INSTANCES,
    CONFIG_MINOR,
    GPU_INSTANCES,
    MONITOR_MINOR,
    caps_minor,
)
from agent.sim.model import NodeModel
from agent.sim.tree import write_text, write_tree

CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
DEFAULT_CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
_GPU_NODE = re.compile(r"^nvidia[0-9]+$")


def containerd_config(cdi_dirs: Sequence[str]) -> str:
    """A containerd 1.7-style configuration (version 2) with CDI on and ``cdi_spec_dirs``."""
    dirs = ", ".join(json.dumps(d) for d in dict.fromkeys([*DEFAULT_CDI_DIRS, *cdi_dirs]))
    return (
        "# written by the Tessera simulator: containerd with CDI on\n"
        "version = 2\n\n"
        '[plugins."io.containerd.grpc.v1.cri"]\n'
        "  enable_cdi = true\n"
        f"  cdi_spec_dirs = [{dirs}]\n"
    )


def _caps_minors(model: NodeModel) -> list[int]:
    minors = [CONFIG_MINOR, MONITOR_MINOR]
    for gpu in model.gpus:
        if not gpu.spec.mig_capable:
            continue
        for gi in range(GPU_INSTANCES):
            minors.append(caps_minor(gpu.index, gi))
            minors += [caps_minor(gpu.index, gi, ci) for ci in range(COMPUTE_INSTANCES)]
    return minors


def _create(model: NodeModel, root: Path, cdi_dirs: Sequence[str]) -> None:
    """The first write, into an empty root: what ``_write_tree`` leaves, each file made once
    (no comparison, temporary name or pruning over its thousand capability nodes)."""
    dev = root / "dev"
    caps = dev / "nvidia-caps"
    caps.mkdir(parents=True, exist_ok=True)
    for name in (*CONTROL_NODES, *(f"nvidia{g.index}" for g in model.gpus)):
        (dev / name).touch(exist_ok=False)
    for minor in _caps_minors(model):
        (caps / f"nvidia-cap{minor}").touch(exist_ok=False)
    containerd = root / "etc" / "containerd"
    containerd.mkdir(parents=True, exist_ok=True)
    (containerd / "config.toml").write_text(containerd_config(cdi_dirs))


def _write_tree(model: NodeModel, root: Path, cdi_dirs: Sequence[str]) -> None:
    if not root.exists() or not any(root.iterdir()):
        _create(model, root, cdi_dirs)
        return
    dev = root / "dev"
    gpu_nodes = {f"nvidia{g.index}" for g in model.gpus}
    for name in (*CONTROL_NODES, *sorted(gpu_nodes)):
        write_text(dev / name, "")
    for entry in dev.iterdir():  # GPUs an earlier model had
        if _GPU_NODE.match(entry.name) and entry.name not in gpu_nodes:
            entry.unlink()
    caps = dev / "nvidia-caps"
    wanted = {f"nvidia-cap{m}" for m in _caps_minors(model)}
    for name in sorted(wanted):
        write_text(caps / name, "")
    for entry in caps.iterdir():
        if entry.name not in wanted:
            entry.unlink()
    write_text(root / "etc" / "containerd" / "config.toml", containerd_config(cdi_dirs))


def write_host_root(
    model: NodeModel, root: Path, *, cdi_dirs: Sequence[Path], kubelet_dirs: Sequence[Path]
) -> None:
    """Write (or rewrite) the simulated host of ``model`` under ``root``: its containerd reads
    CDI specs from ``cdi_dirs`` (absolute host paths) too; ``kubelet_dirs`` are made. Raises
    ConfigError for ``/`` itself or when the tree cannot be written."""
    dirs = [str(Path(d).absolute()) for d in cdi_dirs]
    write_tree(root, "/", "host root", lambda r: _write_tree(model, r, dirs))
    for d in kubelet_dirs:
        with contextlib.suppress(OSError):  # a file in the way: the doctor's check says so
            d.mkdir(parents=True, exist_ok=True)
