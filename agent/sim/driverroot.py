"""Write a realistic NVIDIA driver root for a simulated node (what the CDI writer reads).

Layout under ``root`` (as the driver has it under ``/``)::

    proc/driver/nvidia/version                                 NVRM line with the driver version
    proc/driver/nvidia/capabilities/mig/{config,monitor}
    proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access            G in 0..14
    proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/ci<C>/access      C in 0..7
    usr/lib/x86_64-linux-gnu/lib{cuda,nvidia-ml,nvidia-ptxjitcompiler}.so.<version>  (empty)
    usr/lib/x86_64-linux-gnu/lib….so.1 -> lib….so.<version>
    usr/bin/{nvidia-smi,nvidia-cuda-mps-control}     stand-ins acting on the simulated node

The per-GPU capability files exist only for MIG-capable GPUs and, as with the real driver, for
every possible GPU and compute instance whether or not it exists. The GPU minor is the NVML index
(the simulator gives GPU ``i`` ``/dev/nvidia<i>``).

Capability files hold ``DeviceFileMinor``/``DeviceFileMode``/``DeviceFileModify``. The minors
follow the table ``nvidia-caps`` publishes in ``/proc/driver/nvidia-caps/mig-minors``:
``config`` 1, ``monitor`` 2, then per GPU 135 minors (15 GPU instances x (1 + 8 compute
instances))::

    gpu<g>/gi<G>/access       3 + 135*g + 9*G
    gpu<g>/gi<G>/ci<C>/access 4 + 135*g + 9*G + C

which is unique per node. Readers must never compute minors: on a real node they come from the
files (and from nvidia-caps), so anything that reads them must read them.

The two executables in ``usr/bin`` (:mod:`agent.sim.tools`) are installed when the simulator's
state directory is given: scripts run by this Python that set the simulated GPUs' compute mode
and time-slice and run simulated MPS control daemons, so the driver runs the real commands.

``caps_minor`` is pure; ``write_driver_root`` does the I/O, and is idempotent.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from agent.sim.model import NodeModel
from agent.sim.tools.install import BIN_DIR, MODE, tool_scripts
from agent.sim.tree import symlink, write_text, write_tree

GPU_INSTANCES = 15
COMPUTE_INSTANCES = 8
CAPS_DIR = "proc/driver/nvidia/capabilities"
LIB_DIR = "usr/lib/x86_64-linux-gnu"
LIBRARIES = ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so")
CONFIG_MINOR = 1
MONITOR_MINOR = 2
_PER_GPU = GPU_INSTANCES * (1 + COMPUTE_INSTANCES)
MODE_CONFIG = 256  # 0400: only root may reconfigure MIG
MODE_READ = 292  # 0444


def caps_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The simulated nvidia-caps minor of a GPU instance (``ci`` None) or compute instance. Pure."""
    base = 3 + _PER_GPU * gpu_minor + (1 + COMPUTE_INSTANCES) * gi
    return base if ci is None else base + 1 + ci


def _caps_text(minor: int, mode: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def _version_text(version: str) -> str:
    return (
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}"
        "  Tue Jan  2 00:00:00 UTC 2024\n"
        "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
    )


def _write_executable(path: Path, text: str) -> None:
    """Write ``text`` with mode 0755 atomically; leave the file alone when it already is so."""
    try:
        if path.read_text() == text and path.stat().st_mode & 0o777 == MODE:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, MODE)
    os.replace(tmp, path)


def _write_tools(root: Path, tools: dict[str, str]) -> None:
    """Install ``tools`` (relative path -> text) and remove the stand-ins it does not list."""
    for rel, text in tools.items():
        _write_executable(root / rel, text)
    for rel in tool_scripts("", "", ""):
        if rel not in tools and (root / rel).exists():
            (root / rel).unlink()
    bin_dir = root / BIN_DIR
    if bin_dir.is_dir() and not any(bin_dir.iterdir()):
        bin_dir.rmdir()


def _write_tree(model: NodeModel, root: Path, tools: dict[str, str]) -> None:
    nvidia = root / "proc" / "driver" / "nvidia"
    write_text(nvidia / "version", _version_text(model.driver_version))
    caps = root / CAPS_DIR
    write_text(caps / "mig" / "config", _caps_text(CONFIG_MINOR, MODE_CONFIG))
    write_text(caps / "mig" / "monitor", _caps_text(MONITOR_MINOR, MODE_READ))
    gpu_dirs = {"mig"}
    for gpu in model.gpus:
        if not gpu.spec.mig_capable:
            continue
        minor = gpu.index
        gpu_dirs.add(f"gpu{minor}")
        mig = caps / f"gpu{minor}" / "mig"
        for gi in range(GPU_INSTANCES):
            write_text(mig / f"gi{gi}" / "access", _caps_text(caps_minor(minor, gi), MODE_READ))
            for ci in range(COMPUTE_INSTANCES):
                text = _caps_text(caps_minor(minor, gi, ci), MODE_READ)
                write_text(mig / f"gi{gi}" / f"ci{ci}" / "access", text)
    # GPUs an earlier write (of another model) had and this one does not
    for entry in caps.iterdir():
        if entry.name not in gpu_dirs and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)

    libs = root / LIB_DIR
    libs.mkdir(parents=True, exist_ok=True)
    keep: set[str] = set()
    for lib in LIBRARIES:
        real = f"{lib}.{model.driver_version}"
        write_text(libs / real, "")
        symlink(libs / f"{lib}.1", real)
        keep.update((real, f"{lib}.1"))
    # libraries of another driver version left by an earlier write
    for entry in libs.iterdir():
        if entry.name.startswith(LIBRARIES) and entry.name not in keep:
            entry.unlink()
    _write_tools(root, tools)


def write_driver_root(
    model: NodeModel,
    root: Path,
    *,
    state_dir: Path | None = None,
    model_ref: str | None = None,
) -> None:
    """Write (or rewrite) the simulated driver root of ``model`` under ``root``.

    With ``state_dir`` (the simulator's state directory, where ``nvml-state.json`` is) the
    stand-in ``nvidia-smi`` and ``nvidia-cuda-mps-control`` are installed for that node;
    ``model_ref`` is how they load the model (default its name; a model file's path). Without
    it they are not (and an earlier write's are removed).

    Idempotent: unchanged files are left alone, changed ones replaced atomically, and the GPUs
    and library versions a previous model had are removed. Raises ConfigError for ``/`` itself
    or when the tree cannot be written.
    """
    tools: dict[str, str] = {}
    if state_dir is not None:
        ref = model_ref or model.name
        if ref.endswith((".yaml", ".yml")):
            ref = os.path.abspath(ref)
        tools = tool_scripts(sys.executable, os.path.abspath(state_dir), ref)
    write_tree(root, "/", "driver root", lambda r: _write_tree(model, r, tools))
