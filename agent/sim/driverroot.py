"""Write a realistic NVIDIA driver root for a simulated node (what the agent and the CDI writer
read), in one of three layouts that mimic real nodes.

Common to every layout, under ``root`` (as the driver has it under ``/``)::

    proc/driver/nvidia/version                                 NVRM line with the driver version
    proc/driver/nvidia/capabilities/mig/{config,monitor}
    proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access            G in 0..14
    proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/ci<C>/access      C in 0..7
    proc/devices                       character majors: nvidia-frontend, nvidia-caps, nvidia-uvm
    <lib dir>/lib<name>.so.<version>   the driver's compute and utility libraries (empty files)
    <lib dir>/<SONAME> -> lib<name>.so.<version>   (libcuda.so.1, libnvidia-nvvm.so.4, ...)
    <lib dir>/libcuda.so -> libcuda.so.1           the one development link the installer makes
    etc/ld.so.cache                    the loader's cache (agent.driverfiles.ldcache): the SONAMEs
    lib/firmware/nvidia/<version>/gsp_{ga10x,tu10x}.bin                     GSP firmware
    run/nvidia-persistenced/socket     (and run/nvidia-fabricmanager/socket on NVSwitch nodes)
    usr/bin/{nvidia-debugdump,nvidia-persistenced,nvidia-cuda-mps-server}   placeholders
    usr/bin/{nvidia-smi,nvidia-cuda-mps-control}     stand-ins acting on the simulated node
    dev/nvidia<minor>, dev/nvidiactl, dev/nvidia-uvm, dev/nvidia-uvm-tools,
    dev/nvidia-caps/nvidia-cap{1,2}    device node stand-ins (regular files)

The layouts (``--sim-driver-layout``):

- ``ubuntu``: a host driver from Ubuntu's packages: libraries in ``/usr/lib/x86_64-linux-gnu``,
  ``lib -> usr/lib`` (merged /usr), the cache naming ``/lib/x86_64-linux-gnu/<SONAME>`` (the
  first directory of Ubuntu's ``ld.so.conf.d/x86_64-linux-gnu.conf``). Seen from the host at
  ``/``.
- ``rhel``: a host driver from RHEL's packages: libraries in ``/usr/lib64``, ``lib64 ->
  usr/lib64`` and ``lib -> usr/lib``, the cache naming ``/lib64/<SONAME>`` (ldconfig's first
  default directory there), 32-bit compat copies of libcuda and libnvidia-ml in ``/usr/lib``
  (ELF class 1) that must not be chosen. Seen from the host at ``/``.
- ``container``: the GPU operator's containerized driver (an Ubuntu-based image), whose root the
  host sees at ``/run/nvidia/driver``: libraries in ``/usr/lib/x86_64-linux-gnu``, and its links
  absolute (``lib -> /usr/lib``, ``libcuda.so.1 -> /usr/lib/x86_64-linux-gnu/libcuda.so.<v>``),
  as links made inside a container root point at its own ``/``: followed on the host they would
  leave the driver's tree, so readers must resolve them inside the root.

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
files (and from nvidia-caps), so anything that reads them must read them. The MIG capability
device nodes themselves are not written: as on a real node, they are made when first needed
(the agent makes them at prepare, through :func:`make_device_node` here).

The two executables in ``usr/bin`` (:mod:`agent.sim.tools`) are installed when the simulator's
state directory is given: scripts run by this Python that set the simulated GPUs' compute mode
and time-slice and run simulated MPS control daemons, so the driver runs the real commands.

``caps_minor`` and ``driver_tree`` are pure; ``write_driver_root`` does the I/O, and is
idempotent: a rewrite (another model or layout) leaves exactly what a fresh write would, apart
from the MIG capability nodes made since.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from agent.driverfiles import ldcache
from agent.sim.model import NodeModel
from agent.sim.tools.install import MODE, tool_scripts
from agent.sim.tree import symlink, write_tree

GPU_INSTANCES = 15
COMPUTE_INSTANCES = 8
CAPS_DIR = "proc/driver/nvidia/capabilities"
CONFIG_MINOR = 1
MONITOR_MINOR = 2
_PER_GPU = GPU_INSTANCES * (1 + COMPUTE_INSTANCES)
MODE_CONFIG = 256  # 0400: only root may reconfigure MIG
MODE_READ = 292  # 0444
NVIDIA_MAJOR = 195
CAPS_MAJOR = 236
UVM_MAJOR = 510
PROC_DEVICES = (
    "Character devices:\n  1 mem\n  4 /dev/vc/0\n  5 /dev/tty\n 10 misc\n"
    f"{NVIDIA_MAJOR} nvidia-frontend\n{CAPS_MAJOR} nvidia-caps\n"
    f"{CAPS_MAJOR + 1} nvidia-caps-imex-channels\n{UVM_MAJOR} nvidia-uvm\n"
    "\nBlock devices:\n  7 loop\n  8 sd\n259 blkext\n"
)
"""A real node's ``/proc/devices`` has these lines (the majors of the dynamic ones vary)."""
LIBRARIES: tuple[tuple[str, str | None], ...] = (
    ("libnvidia-ml.so", "libnvidia-ml.so.1"),
    ("libnvidia-cfg.so", "libnvidia-cfg.so.1"),
    ("libcuda.so", "libcuda.so.1"),
    ("libcudadebugger.so", "libcudadebugger.so.1"),
    ("libnvidia-opencl.so", "libnvidia-opencl.so.1"),
    ("libnvidia-gpucomp.so", None),
    ("libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"),
    ("libnvidia-allocator.so", "libnvidia-allocator.so.1"),
    ("libnvidia-pkcs11-openssl3.so", None),
    ("libnvidia-nvvm.so", "libnvidia-nvvm.so.4"),
    ("libnvidia-glcore.so", None),
)
"""A 550-series driver's libraries and their SONAMEs (None: the versioned name is the SONAME, no
link): the compute and utility ones, and a graphics one (libnvidia-glcore) that is not theirs."""
DEV_LINKS = ("libcuda.so",)
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
PLACEHOLDER_BINARIES = ("nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-server")
_PLACEHOLDER = (
    '#!/bin/sh\necho "{name}: not simulated (a placeholder of the simulated driver)" >&2\nexit 1\n'
)
_ELF32 = b"\x7fELF\x01\x01\x01" + b"\x00" * 9
"""The start of a 32-bit little-endian ELF file: enough for readers that check the class."""
KEEP = ("dev/nvidia-caps/", "dev/vfio/", "proc/driver/nvidia/gpus/")
"""Paths a rewrite leaves alone: the MIG capability nodes made since (as on a real node), the
VFIO nodes and NVIDIA unbind locks, which follow the VM state (:mod:`agent.sim.sysfs_vm`)."""


@dataclass(frozen=True)
class Layout:
    """Where one kind of node keeps the driver's files (see the module)."""

    name: str
    lib_dir: str
    cache_dir: str
    """The directory the ld cache names (a symlinked alias of ``lib_dir``, or itself)."""
    root_links: tuple[tuple[str, str], ...]
    absolute: bool
    """SONAME and development links are absolute (a container root's own ``/``)."""
    host_root: str
    """Where the host sees this driver root (the default ``--host-driver-root``)."""
    compat32_dir: str | None = None


LAYOUTS = {
    "ubuntu": Layout(
        "ubuntu",
        "usr/lib/x86_64-linux-gnu",
        "/lib/x86_64-linux-gnu",
        (("lib", "usr/lib"),),
        absolute=False,
        host_root="/",
    ),
    "rhel": Layout(
        "rhel",
        "usr/lib64",
        "/lib64",
        (("lib", "usr/lib"), ("lib64", "usr/lib64")),
        absolute=False,
        host_root="/",
        compat32_dir="usr/lib",
    ),
    "container": Layout(
        "container",
        "usr/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        (("lib", "/usr/lib"),),
        absolute=True,
        host_root="/run/nvidia/driver",
    ),
}
DEFAULT_LAYOUT = "ubuntu"


@dataclass
class Tree:
    """What a driver root holds, by root-relative path (no leading slash)."""

    files: dict[str, bytes] = field(default_factory=dict)
    executables: dict[str, str] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    sockets: set[str] = field(default_factory=set)


def caps_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The simulated nvidia-caps minor of a GPU instance (``ci`` None) or compute instance. Pure."""
    base = 3 + _PER_GPU * gpu_minor + (1 + COMPUTE_INSTANCES) * gi
    return base if ci is None else base + 1 + ci


def _caps_text(minor: int, mode: int) -> bytes:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n".encode()


def _version_text(version: str) -> bytes:
    return (
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}"
        "  Tue Jan  2 00:00:00 UTC 2024\n"
        "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
    ).encode()


def layout_of(name: str | None) -> Layout:
    """The layout called ``name`` (None: the default). Raises KeyError for another name."""
    return LAYOUTS[name or DEFAULT_LAYOUT]


def driver_tree(model: NodeModel, layout: Layout, tools: dict[str, str]) -> Tree:
    """Everything the driver root of ``model`` in ``layout`` holds. Pure."""
    t = Tree()
    version = model.driver_version
    t.files["proc/driver/nvidia/version"] = _version_text(version)
    t.files["proc/devices"] = PROC_DEVICES.encode()
    t.files[f"{CAPS_DIR}/mig/config"] = _caps_text(CONFIG_MINOR, MODE_CONFIG)
    t.files[f"{CAPS_DIR}/mig/monitor"] = _caps_text(MONITOR_MINOR, MODE_READ)
    for gpu in model.gpus:
        if not gpu.spec.mig_capable:
            continue
        mig = f"{CAPS_DIR}/gpu{gpu.index}/mig"
        for gi in range(GPU_INSTANCES):
            t.files[f"{mig}/gi{gi}/access"] = _caps_text(caps_minor(gpu.index, gi), MODE_READ)
            for ci in range(COMPUTE_INSTANCES):
                text = _caps_text(caps_minor(gpu.index, gi, ci), MODE_READ)
                t.files[f"{mig}/gi{gi}/ci{ci}/access"] = text

    for link, target in layout.root_links:
        t.links[link] = target
    lib = layout.lib_dir
    cache: list[ldcache.CacheEntry] = []
    for name, soname in LIBRARIES:
        real = f"{name}.{version}"
        t.files[f"{lib}/{real}"] = b""
        links = {soname: real} if soname else {}
        if name in DEV_LINKS:
            links[name] = soname or real
        for link_name, target in links.items():
            t.links[f"{lib}/{link_name}"] = f"/{lib}/{target}" if layout.absolute else target
        cache.append(ldcache.CacheEntry(soname or real, f"{layout.cache_dir}/{soname or real}"))
    if layout.compat32_dir is not None:
        for name in ("libcuda.so", "libnvidia-ml.so"):
            t.files[f"{layout.compat32_dir}/{name}.{version}"] = _ELF32
            t.links[f"{layout.compat32_dir}/{name}.1"] = f"{name}.{version}"
            cache.append(
                ldcache.CacheEntry(f"{name}.1", f"/usr/lib/{name}.1", flags=ldcache.FLAG_ELF_LIBC6)
            )  # i386: the loader of a 64-bit process skips it
    cache.append(ldcache.CacheEntry("libc.so.6", f"{layout.cache_dir}/libc.so.6"))
    t.files["etc/ld.so.cache"] = ldcache.build(sorted(cache, key=lambda e: e.soname))

    for fw in FIRMWARE:
        t.files[f"usr/lib/firmware/nvidia/{version}/{fw}"] = b"simulated GSP firmware\n"
    t.sockets.add("run/nvidia-persistenced/socket")
    if model.nvlink_kind == "nvswitch":
        t.sockets.add("run/nvidia-fabricmanager/socket")
    for name in PLACEHOLDER_BINARIES:
        t.executables[f"usr/bin/{name}"] = _PLACEHOLDER.format(name=name)
    t.executables.update(tools)

    for node in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        t.files[f"dev/{node}"] = b""
    for gpu in model.gpus:
        t.files[f"dev/nvidia{gpu.index}"] = b""
    for minor in (CONFIG_MINOR, MONITOR_MINOR):
        t.files[f"dev/nvidia-caps/nvidia-cap{minor}"] = b""
    return t


def _write_bytes(path: Path, data: bytes) -> None:
    try:
        if path.is_file() and not path.is_symlink() and path.read_bytes() == data:
            return
    except OSError:
        pass
    if path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


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


def _write_socket(path: Path) -> None:
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            return
        path.unlink()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFSOCK | 0o666)  # no one listens: only its presence is read


def _wanted_dirs(paths: list[str]) -> set[str]:
    dirs: set[str] = set()
    for p in paths:
        parts = p.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    return dirs


def _create(root: Path, t: Tree) -> None:
    """The first write, into an empty root: what ``_apply`` leaves, each entry made once, without
    its comparisons, temporary names and pruning walk (the tree has thousands of entries)."""
    made: set[Path] = set()

    def parent(path: Path) -> Path:
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        return path

    for rel, target in t.links.items():
        os.symlink(target, parent(root / rel))
    for rel, data in t.files.items():
        fd = os.open(parent(root / rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    for rel, text in t.executables.items():
        path = parent(root / rel)
        path.write_text(text)
        os.chmod(path, MODE)
    for rel in t.sockets:
        os.mknod(parent(root / rel), stat.S_IFSOCK | 0o666)


def _apply(root: Path, t: Tree) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if not any(root.iterdir()):
        _create(root, t)
        return
    # a link of the layout may stand where another layout had a directory (or the reverse)
    for rel in t.links:
        p = root / rel
        if p.is_dir() and not p.is_symlink():
            _remove_tree(p)
    # A restart finds the tree as it left it: each entry is checked with the fewest system
    # calls, on plain strings (pathlib's objects cost more than the checks on 1,100 entries),
    # and only what differs is written.
    base = f"{root}/"
    for rel, target in t.links.items():
        if _readlink(base + rel) != target:
            symlink(root / rel, target)
    for rel, data in t.files.items():
        if not _holds(base + rel, data):
            _write_bytes(root / rel, data)
    for rel, text in t.executables.items():
        if not _holds(base + rel, text.encode(), MODE):
            _write_executable(root / rel, text)
    for rel in t.sockets:
        _write_socket(root / rel)
    wanted = set(t.files) | set(t.executables) | set(t.links) | t.sockets
    dirs = _wanted_dirs(sorted(wanted))
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        rel_dir = dirpath[len(base) :] if dirpath != str(root) else ""
        for name in filenames + [d for d in dirnames if os.path.islink(f"{dirpath}/{d}")]:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if rel not in wanted and not rel.startswith(KEEP):
                os.unlink(f"{dirpath}/{name}")
        if rel_dir and rel_dir not in dirs and not (rel_dir + "/").startswith(KEEP):
            with contextlib.suppress(OSError):  # not empty: something kept is inside
                os.rmdir(dirpath)


def _readlink(path: str) -> str | None:
    """Where the symbolic link ``path`` points; None when it is none (or missing)."""
    try:
        return os.readlink(path)
    except OSError:
        return None


def _holds(path: str, data: bytes, mode: int | None = None) -> bool:
    """Whether ``path`` is a regular file (not a link) holding exactly ``data`` (and, with
    ``mode``, with those permission bits): one ``lstat``, and a read only when the size fits."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != len(data):
            return False
        if mode is not None and st.st_mode & 0o777 != mode:
            return False
        with open(path, "rb") as f:
            return f.read() == data
    except OSError:
        return False


def _remove_tree(p: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(p, topdown=False):
        for name in filenames:
            (Path(dirpath) / name).unlink()
        for name in dirnames:
            d = Path(dirpath) / name
            d.unlink() if d.is_symlink() else d.rmdir()
    p.rmdir()


def write_driver_root(
    model: NodeModel,
    root: Path,
    *,
    state_dir: Path | None = None,
    model_ref: str | None = None,
    layout: str | None = None,
) -> None:
    """Write (or rewrite) the simulated driver root of ``model`` under ``root`` in ``layout``
    (``ubuntu``, ``rhel``, ``container``; None: ``ubuntu``).

    With ``state_dir`` (the simulator's state directory, where ``nvml-state.json`` is) the
    stand-in ``nvidia-smi`` and ``nvidia-cuda-mps-control`` are installed for that node;
    ``model_ref`` is how they load the model (default its name; a model file's path). Without
    it they are not (and an earlier write's are removed).

    Idempotent: unchanged files are left alone, changed ones replaced atomically, and what a
    previous model or layout had and this one lacks is removed. Raises ConfigError for ``/``
    itself or when the tree cannot be written.
    """
    tools: dict[str, str] = {}
    if state_dir is not None:
        ref = model_ref or model.name
        if ref.endswith((".yaml", ".yml")):
            ref = os.path.abspath(ref)
        tools = tool_scripts(sys.executable, os.path.abspath(state_dir), ref)
    tree = driver_tree(model, layout_of(layout), tools)
    write_tree(root, "/", "driver root", lambda r: _apply(r, tree))


def make_device_node(path: Path, major: int, minor: int, mode: int) -> None:
    """The simulator's ``mknod``: a regular file standing in for character device
    ``major:minor`` (a real node would need CAP_MKNOD and could open a real device), with the
    node's permissions. Same signature as ``agent.driverfiles.discover.make_char_device``."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"simulated character device {major}:{minor}\n")
    os.chmod(path, mode & 0o777)
