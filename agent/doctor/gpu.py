"""The checks that ask NVML: the driver and the NVML file loaded, the driver's versions and
files, each GPU's MIG mode against ``--mig-mode``, and the device nodes containers get.

Device numbers: ``/dev/nvidia<minor>`` is character device 195:<minor> and ``/dev/nvidiactl``
195:255 (``NV_DEVICE_MAJOR``, ``NV_CTL_DEVICE_MINOR`` in NVIDIA/libnvidia-container
``src/nvc_internal.h``); ``nvidia-uvm`` and ``nvidia-caps`` get their majors at load time
(``/proc/devices``), so only their presence is checked. The MIG capability nodes
``/dev/nvidia-caps/nvidia-cap<N>`` take ``N`` from the driver's
``proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access`` files;
``nvidia-modprobe -f <that file>`` creates the node (NVIDIA's MIG user guide, "Device Nodes",
does it for ``mig/config`` and ``mig/monitor``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from agent.doctor.hostfs import node_problem, on_host
from agent.doctor.verdict import Verdict, fail, ok, skip, warn
from agent.errors import TesseraError
from agent.node import NodeSource
from agent.nvml.errors import DriverNotFoundError
from agent.nvml.mig import mode_switch_needs_reset
from agent.nvml.types import GpuDevice, SystemInfo
from dra_driver.errors import CdiError
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.cdi_spec import CAPS_DIR, CONTROL_NODES, read_caps_minor

NV_MAJOR = 195
NV_CTL_MINOR = 255
NVML_FILE = "libnvidia-ml.so"
DRIVER_ROOT_FIX = (
    "set --driver-root to where the driver's files are visible to the agent: / for a driver"
    " installed on the host (the DaemonSet mounts it at /driver-root), /run/nvidia/driver for"
    " the GPU operator's containerized driver"
)
GPU_CHECKS = ("nvml-library", "driver-version", "mig-mode", "device-nodes")
"""The checks that need NVML: skipped when the driver check fails."""


def check_driver(source: NodeSource) -> Verdict:
    """NVML initializes (call :meth:`Nvml.shutdown` afterwards when it did)."""
    try:
        source.nvml.init()
    except DriverNotFoundError:
        return fail(
            "driver",
            "no NVIDIA driver: libnvidia-ml.so.1 could not be loaded",
            "install the NVIDIA driver on the host (or the GPU operator's driver container) and "
            + DRIVER_ROOT_FIX
            + "; to try Tessera without a GPU add --simulate MODEL",
        )
    except TesseraError as exc:
        return fail(
            "driver",
            f"NVML does not initialize: {exc}",
            "a driver/library version mismatch (NVML code 18) needs the node rebooted or the"
            " kernel module reloaded; otherwise see the driver's own logs (dmesg, nvidia-smi)",
        )
    what = f"simulated node {source.model}" if source.model else "NVIDIA driver"
    return ok("driver", f"NVML initialized ({what})")


def mapped_file(maps: str, name: str) -> str | None:
    """The first mapped file whose base name starts with ``name`` in the text of
    ``/proc/<pid>/maps`` (pure)."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith(name):
            return fields[5].strip()
    return None


def loaded_nvml(source: NodeSource, maps_file: Path = Path("/proc/self/maps")) -> str | None:
    """The NVML library file this process loaded: what the node source says it loaded, else
    the ``libnvidia-ml`` the dynamic loader mapped (``/proc/self/maps``, after NVML's init)."""
    told = source.nvml_library  # set by a source that loads a chosen file
    if told is not None and told.path:
        return told.path
    try:
        return mapped_file(maps_file.read_text(), NVML_FILE)
    except OSError:
        return None


def check_nvml_library(source: NodeSource, library: str | None) -> Verdict:
    """Which NVML file was loaded, and whether it is the driver root's."""
    if library is None:
        if source.model:
            return ok("nvml-library", f"simulated NVML ({source.model}): no library is loaded")
        return warn(
            "nvml-library",
            "NVML answers but which libnvidia-ml file was loaded cannot be told",
            "look for libnvidia-ml in /proc/<agent pid>/maps",
        )
    root = source.driver_root.resolve()
    real = Path(library).resolve()
    if root != Path("/") and root not in real.parents:
        return warn(
            "nvml-library",
            f"{library} is not under --driver-root {source.driver_root}: the system loader"
            " found another NVML than the driver's",
            DRIVER_ROOT_FIX + "; an NVML of another version than the kernel module fails",
        )
    return ok("nvml-library", f"loaded {library}")


def driver_libraries(driver_root: Path, version: str) -> list[str]:
    """The driver libraries a claim's CDI spec mounts from ``driver_root`` (their file names)."""
    writer = CdiWriter(Path("/nonexistent"), "doctor.tessera.dev", driver_root, version)
    return [lib.filename for lib in writer.files.libraries]


def check_versions(source: NodeSource, system: SystemInfo) -> Verdict:
    """The driver and CUDA versions, and the driver's libraries under the driver root."""
    found = driver_libraries(source.driver_root, system.driver_version)
    versions = f"driver {system.driver_version}, CUDA {system.cuda_driver_version}"
    missing = [
        f"{lib}.{system.driver_version}"
        for lib in ("libcuda.so", "libnvidia-ml.so")
        if f"{lib}.{system.driver_version}" not in found
    ]
    if missing:
        return fail(
            "driver-version",
            f"{versions}; {', '.join(missing)} not under --driver-root {source.driver_root}:"
            " claims' containers would get no CUDA driver",
            DRIVER_ROOT_FIX,
        )
    return ok("driver-version", f"{versions}; {len(found)} driver libraries under the driver root")


def check_mig(gpu: GpuDevice, mig_mode: str) -> Verdict:
    """One GPU's MIG mode, and what ``--mig-mode`` makes of it."""
    subject = f"GPU {gpu.index}"
    mode = gpu.mig_mode
    if mode is None:
        return ok("mig-mode", f"{gpu.name}: no MIG; advertised whole", subject=subject)
    state = "on" if mode.current else "off"
    if mode.pending != mode.current:
        return warn(
            "mig-mode",
            f"MIG {state}, but {'on' if mode.pending else 'off'} is pending: the change takes"
            " effect at the next GPU reset",
            f"reset the GPU when it is idle (nvidia-smi -r -i {gpu.index}) or reboot, or set it"
            f" back (nvidia-smi -i {gpu.index} -mig {int(mode.current)})",
            subject=subject,
        )
    if mig_mode == "static":
        if not mode.current:
            return ok("mig-mode", "MIG off; advertised whole (--mig-mode static)", subject=subject)
        if not gpu.mig_instances:
            return warn(
                "mig-mode",
                "MIG on with no MIG devices: with --mig-mode static this GPU advertises nothing",
                f"create MIG devices (nvidia-smi mig -i {gpu.index} -cgi <profiles> -C), or run"
                " the agent with --mig-mode dynamic to make them per claim",
                subject=subject,
            )
        return ok(
            "mig-mode",
            f"MIG on; {len(gpu.mig_instances)} MIG devices advertised (--mig-mode static)",
            subject=subject,
        )
    if not mode.current and mode_switch_needs_reset(gpu.architecture):
        return warn(
            "mig-mode",
            f"MIG off on an {gpu.architecture} GPU, which needs a reset to switch: with"
            " --mig-mode dynamic it offers only the whole GPU, no MIG placements",
            f"turn MIG on (nvidia-smi -i {gpu.index} -mig 1, then a GPU reset) to offer MIG"
            " devices made per claim",
            subject=subject,
        )
    return ok(
        "mig-mode",
        f"MIG {state}; the whole GPU and every MIG placement advertised (--mig-mode dynamic)",
        subject=subject,
    )


def _caps_nodes(driver_root: Path, gpu: GpuDevice) -> tuple[list[str], list[str]]:
    """The capability nodes the GPU's existing MIG devices need, and what cannot be read."""
    nodes, problems = [], []
    for inst in gpu.mig_instances:
        gi_dir = driver_root / CAPS_DIR / f"gpu{gpu.minor}" / "mig" / f"gi{inst.gpu_instance_id}"
        for access in (gi_dir / "access", gi_dir / f"ci{inst.compute_instance_id}" / "access"):
            try:
                nodes.append(f"/dev/nvidia-caps/nvidia-cap{read_caps_minor(access)}")
            except CdiError as exc:
                problems.append(str(exc))
    return sorted(set(nodes)), problems


def check_device_nodes(
    host_root: Path, driver_root: Path, gpus: Sequence[GpuDevice], *, stand_in: bool
) -> Verdict:
    """The device nodes on the host that the CDI specs name: control nodes, one per GPU, the
    MIG capability nodes of the existing MIG devices."""
    wanted: list[tuple[str, int | None, int | None]] = [
        (path, NV_MAJOR, NV_CTL_MINOR) if path == "/dev/nvidiactl" else (path, None, None)
        for path in CONTROL_NODES
    ]
    wanted += [(f"/dev/nvidia{g.minor}", NV_MAJOR, g.minor) for g in gpus]
    problems: list[str] = []
    for g in gpus:
        if not g.mig_enabled:
            continue
        if not on_host(host_root, "/dev/nvidia-caps").is_dir():
            problems.append(f"/dev/nvidia-caps is missing (GPU {g.index} has MIG on)")
            continue
        nodes, unreadable = _caps_nodes(driver_root, g)
        problems += unreadable
        wanted += [(n, None, None) for n in nodes]
    for path, major, minor in wanted:
        here = on_host(host_root, path)
        problem = node_problem(here, major=major, minor=minor, stand_in=stand_in)
        if problem is not None:
            problems.append(f"{path} {problem}")
    if problems:
        return fail(
            "device-nodes",
            "; ".join(problems),
            "create the nodes as root on the host: nvidia-modprobe -c <GPU minor> -u (GPU,"
            " control and UVM nodes; running nvidia-smi once also does), nvidia-modprobe -f"
            " /proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access (MIG"
            " capability nodes); if they exist on the host, check --host-root",
        )
    return ok("device-nodes", f"{len(wanted)} device nodes present under {host_root / 'dev'}")


def gpu_checks(
    source: NodeSource,
    host_root: Path,
    mig_mode: str,
    *,
    stand_in_nodes: bool,
    library: Callable[[NodeSource], str | None] = loaded_nvml,
) -> list[Verdict]:
    """Every check that needs NVML, once NVML is initialized."""
    out = [check_nvml_library(source, library(source))]
    try:
        system = source.nvml.system()
        gpus = source.nvml.devices()
    except TesseraError as exc:
        return [
            *out,
            fail(
                "driver-version",
                f"NVML fails to describe the node: {exc}",
                "see nvidia-smi and the kernel log (dmesg) for the GPU's state",
            ),
        ]
    out.append(check_versions(source, system))
    out += [check_mig(g, mig_mode) for g in gpus]
    out.append(check_device_nodes(host_root, source.driver_root, gpus, stand_in=stand_in_nodes))
    return out


def skipped_gpu_checks() -> list[Verdict]:
    return [skip(name, "not checked: NVML did not initialize (see driver)") for name in GPU_CHECKS]
