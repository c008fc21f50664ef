"""The checks for GPUs handed to virtual machines (``--virtualization passthrough|vgpu``): the
IOMMU, ``vfio-pci``, each GPU's IOMMU group, SR-IOV virtual functions and the vGPU host
driver's types. Run only when ``--virtualization`` is not ``none``.

They read sysfs directly (docs/gpu-facts.md, "GPUs for virtual machines"; the paths of
Documentation/ABI/testing/sysfs-bus-pci and sysfs-bus-vfio-mdev): a few attribute reads and
directory listings, kept here so that a node whose agent cannot start can still be diagnosed.
``agent.pcihost.read.read_gpu_functions`` reads the same driver link, IOMMU group and members
and vGPU interface for the agent; the doctor keeps its own few reads because it must describe a
half-configured host (no group, no VFs, a foreign member) that the agent's reader only has to
represent.

The fixes' facts:

- Kernel parameters (torvalds/linux ``Documentation/admin-guide/kernel-parameters.txt``,
  b7441453): ``intel_iommu=on`` "Enable intel iommu driver"; ``amd_iommu=`` takes ``off``,
  ``force_isolation``, ``fullflush``... but no ``on``: the AMD IOMMU driver initializes every
  IOMMU the firmware describes (IVRS), so on AMD the firmware setting (AMD-Vi/IOMMU) is what
  turns it on; ``iommu=pt`` puts the host's own DMA in passthrough (identity) mode, which keeps
  the host's devices at full speed while VFIO still isolates the devices given to VMs.
- ``/sys/kernel/iommu_groups`` is empty or absent without an IOMMU, and ``bus/pci/drivers/
  vfio-pci`` exists only while vfio-pci is loaded (NVIDIA/k8s-dra-driver-gpu
  ``NewVfioPciManager`` checks both the same way).
- ``/usr/lib/nvidia/sriov-manage -e <BDF>`` enables a GPU's virtual functions for the vGPU host
  driver (NVIDIA/vgpu-device-manager ``pkg/vgpu/vfio/vfio.go``; NVIDIA/kubevirt-gpu-device-plugin
  README); ``sriov_numvfs`` goes back to 0 at every boot.
"""

from __future__ import annotations

import os
from pathlib import Path

from agent.doctor.verdict import Verdict, fail, ok, skip, warn

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)
"""PCI class (base, sub) of a GPU: VGA controller or 3D controller."""
SRIOV_MANAGE = "/usr/lib/nvidia/sriov-manage"
MODES = ("passthrough", "vgpu")
VGPU_HOST_DRIVER_FIX = (
    "install NVIDIA's vGPU host driver for KVM (the vGPU / NVIDIA AI Enterprise host package, a"
    " licensed download, in place of the data-centre driver), reboot, and run"
    f" {SRIOV_MANAGE} -e ALL where the GPU makes vGPUs on its virtual functions (Ampere and newer);"
    " or leave this GPU out of --virtualization-gpus"
)
IOMMU_FIX = (
    "turn on the IOMMU: enable VT-d (Intel) or AMD-Vi/IOMMU (AMD) in the firmware; on Intel add"
    " intel_iommu=on to the kernel command line (AMD's IOMMU driver is on whenever the firmware"
    " enables the IOMMU: amd_iommu= has no 'on' value); add iommu=pt so the host's own devices"
    " skip translation; then reboot (see docs/virtualization.md)"
)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(path: Path, base: int = 10) -> int | None:
    text = _read(path)
    try:
        return int(text, base) if text is not None else None
    except ValueError:
        return None


def _names(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _function_dir(sys_root: Path, bdf: str) -> Path:
    return sys_root / "bus" / "pci" / "devices" / bdf


def _driver(function: Path) -> str | None:
    link = function / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def nvidia_gpus(sys_root: Path) -> list[str]:
    """The BDFs of the NVIDIA GPUs' physical functions (virtual functions, which have
    ``physfn``, and the boards' audio and USB functions are left out), sorted."""
    gpus = []
    for bdf in _names(sys_root / "bus" / "pci" / "devices"):
        function = _function_dir(sys_root, bdf)
        pci_class = _int(function / "class", 16)
        if (
            _int(function / "vendor", 16) == NVIDIA_VENDOR
            and pci_class is not None
            and pci_class >> 8 in GPU_CLASSES
            and not (function / "physfn").exists()
        ):
            gpus.append(bdf)
    return gpus


def check_iommu(sys_root: Path) -> Verdict:
    """The IOMMU is on: ``kernel/iommu_groups`` has groups."""
    groups = sys_root / "kernel" / "iommu_groups"
    found = _names(groups)
    if not found:
        state = "is empty" if groups.is_dir() else "does not exist"
        return fail(
            "iommu",
            f"{groups} {state}: the IOMMU is off or absent, so no GPU can be handed to a VM"
            " through VFIO",
            IOMMU_FIX,
        )
    return ok("iommu", f"on: {len(found)} IOMMU groups in {groups}")


def check_vfio_pci(sys_root: Path, mode: str) -> Verdict:
    """``vfio-pci`` is loaded: passthrough binds each GPU (and its group) to it."""
    if mode != "passthrough":
        return skip(
            "vfio-pci",
            f"not needed with --virtualization {mode}: only passthrough binds GPUs to vfio-pci",
        )
    driver = sys_root / "bus" / "pci" / "drivers" / "vfio-pci"
    module = sys_root / "module" / "vfio_pci"
    for found in (driver, module):
        if found.is_dir():
            return ok("vfio-pci", f"loaded ({found})")
    return fail(
        "vfio-pci",
        f"the vfio-pci driver is not loaded ({driver} and {module} do not exist): prepare cannot"
        " bind a GPU to it",
        "modprobe vfio-pci, and list vfio-pci in /etc/modules-load.d/vfio-pci.conf so it loads at"
        " boot",
    )


def _same_device(bdf: str, other: str) -> bool:
    """``other`` is a function of the same PCI device (``0000:1b:00.1`` of ``0000:1b:00.0``)."""
    return bdf.rsplit(".", 1)[0] == other.rsplit(".", 1)[0]


def _describe(sys_root: Path, bdf: str) -> str:
    function = _function_dir(sys_root, bdf)
    vendor = _read(function / "vendor") or "?"
    device = _read(function / "device") or "?"
    pci_class = _read(function / "class") or "?"
    driver = _driver(function) or "no driver"
    return f"{bdf} ({vendor}:{device}, class {pci_class}, {driver})"


def check_iommu_group(sys_root: Path, bdf: str) -> Verdict:
    """The GPU has an IOMMU group holding nothing but its own functions (the ``.1`` audio
    function and the like): prepare binds the whole group to vfio-pci and refuses a group that
    holds another device."""
    subject = f"GPU {bdf}"
    link = _function_dir(sys_root, bdf) / "iommu_group"
    if not link.is_symlink():
        return fail(
            "iommu-group",
            f"{link} does not exist: the GPU is in no IOMMU group, so it gets no vfio device",
            IOMMU_FIX,
            subject=subject,
        )
    group = os.path.basename(os.readlink(link))
    members = _names(sys_root / "kernel" / "iommu_groups" / group / "devices")
    foreign = [m for m in members if not _same_device(bdf, m)]
    if foreign:
        return fail(
            "iommu-group",
            f"IOMMU group {group} also holds "
            + ", ".join(_describe(sys_root, m) for m in foreign)
            + ", not a function of this GPU: prepare refuses to hand the GPU to a VM, since the"
            " whole group goes to the VM",
            "put the GPU in a slot with its own IOMMU group (a root port or PCIe switch with ACS;"
            " turn on ACS in the firmware where it is an option), or leave this GPU out of"
            " --virtualization-gpus",
            subject=subject,
        )
    return ok(
        "iommu-group",
        f"IOMMU group {group}: {', '.join(members)} (only this GPU's functions)",
        subject=subject,
    )


def _virtual_functions(function: Path) -> list[Path]:
    links = [n for n in _names(function) if n.startswith("virtfn")]
    links.sort(key=lambda n: int(n[len("virtfn") :]) if n[len("virtfn") :].isdigit() else -1)
    return [function / n for n in links]


def check_sriov(sys_root: Path, bdf: str) -> Verdict:
    """Where the vGPU host driver makes vGPUs on the GPU's SR-IOV virtual functions, they are
    enabled (``sriov_numvfs`` > 0)."""
    subject = f"GPU {bdf}"
    function = _function_dir(sys_root, bdf)
    if _names(function / "mdev_supported_types"):
        return ok(
            "sriov",
            "not needed: the vGPU host driver makes mediated devices on the GPU itself",
            subject=subject,
        )
    total = _int(function / "sriov_totalvfs")
    if not total:
        return skip(
            "sriov",
            f"the GPU has no SR-IOV virtual functions ({function / 'sriov_totalvfs'}"
            f" {'is 0' if total == 0 else 'does not exist'})",
            subject=subject,
        )
    enabled = _int(function / "sriov_numvfs") or 0
    if enabled == 0:
        return fail(
            "sriov",
            f"SR-IOV virtual functions are off (sriov_numvfs 0 of {total}): this GPU's vGPUs are"
            " made on its virtual functions",
            f"{SRIOV_MANAGE} -e {bdf} (as root, after every boot: the virtual functions do not"
            " survive a reboot)",
            subject=subject,
        )
    return ok("sriov", f"{enabled} of {total} virtual functions enabled", subject=subject)


def _vf_types(vf: Path) -> tuple[list[str], int]:
    """The type lines a virtual function offers now (``<id> : <name>``, or an mdev type
    directory's name) and its current type id (0: none)."""
    lines = (_read(vf / "nvidia" / "creatable_vgpu_types") or "").splitlines()
    offered = [line.strip() for line in lines if line.strip()]
    offered += _names(vf / "mdev_supported_types")
    return offered, _int(vf / "nvidia" / "current_vgpu_type") or 0


def check_vgpu_types(sys_root: Path, bdf: str) -> Verdict:
    """The GPU offers vGPU types: mediated-device types on the GPU itself (before Ampere) or on
    its virtual functions (Ampere), or per-VF ``nvidia/creatable_vgpu_types`` (Ada, Hopper and
    newer with vGPU 17+). A virtual function holding a vGPU already counts."""
    subject = f"GPU {bdf}"
    function = _function_dir(sys_root, bdf)
    driver = _driver(function)
    if driver != "nvidia":
        return fail(
            "vgpu-types",
            f"the GPU is bound to {driver or 'no driver'}, not to NVIDIA's vGPU host driver"
            " (nvidia): it offers no vGPU types",
            VGPU_HOST_DRIVER_FIX,
            subject=subject,
        )
    on_gpu = _names(function / "mdev_supported_types")
    if on_gpu:
        return ok(
            "vgpu-types",
            f"mediated devices on the GPU: {len(on_gpu)} types ({', '.join(on_gpu[:4])}"
            f"{', ...' if len(on_gpu) > 4 else ''})",
            subject=subject,
        )
    vfs = _virtual_functions(function)
    offering = 0
    in_use = 0
    names: set[str] = set()
    for vf in vfs:
        offered, current = _vf_types(vf)
        offering += bool(offered)
        in_use += current != 0
        names.update(offered)
    if offering or in_use:
        shown = sorted(names)[:3]
        return ok(
            "vgpu-types",
            f"{len(vfs)} virtual functions: {offering} offer vGPU types, {in_use} hold a vGPU"
            + (f" ({'; '.join(shown)}{'; ...' if len(names) > 3 else ''})" if shown else ""),
            subject=subject,
        )
    if not vfs and _int(function / "sriov_totalvfs"):
        return fail(
            "vgpu-types",
            "no vGPU types: the GPU's virtual functions are not enabled, and its vGPUs are made"
            " on them",
            f"{SRIOV_MANAGE} -e {bdf} (as root, after every boot)",
            subject=subject,
        )
    where = f"its {len(vfs)} virtual functions" if vfs else "the GPU"
    return fail(
        "vgpu-types",
        f"no vGPU types on {where} (no mdev_supported_types, no nvidia/creatable_vgpu_types):"
        " the driver bound is not NVIDIA's vGPU host driver",
        VGPU_HOST_DRIVER_FIX,
        subject=subject,
    )


def virtualization_checks(sys_root: Path, mode: str) -> list[Verdict]:
    """Every virtualization check for ``--virtualization mode``; none for ``none``."""
    if mode not in MODES:
        return []
    out = [check_iommu(sys_root), check_vfio_pci(sys_root, mode)]
    gpus = nvidia_gpus(sys_root)
    per_gpu = "iommu-group" if mode == "passthrough" else "vgpu-types"
    if not gpus:
        out.append(
            warn(
                per_gpu,
                f"no NVIDIA GPU under {sys_root / 'bus' / 'pci' / 'devices'}: nothing to hand to"
                " a VM",
                "set --sysfs-root to the host's /sys (the DaemonSet mounts it)",
            )
        )
        return out
    for bdf in gpus:
        if mode == "passthrough":
            out.append(check_iommu_group(sys_root, bdf))
        else:
            out += [check_sriov(sys_root, bdf), check_vgpu_types(sys_root, bdf)]
    return out
