"""The settings groups every command that looks at a node reads: the node itself, the simulator
that can stand in for it, and what the driver advertises on it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.config.converters import CrashAt, crash_at, dns_subdomain, memory_quantity
from agent.config.declare import setting
from agent.errors import ConfigError
from dra_driver.device_model import (
    SHARING_MODES,
    VIRTUALIZATION_MODES,
    DevicePolicy,
    mig_profile_name,
)
from dra_driver.kubeletplugin.crash_points import CRASH_POINTS
from dra_driver.kubeletplugin.plan import SharingPolicy
from dra_driver.quantity import parse_bytes
from dra_driver.vm_devices import gpu_selector


@dataclass(frozen=True)
class NodeSettings:
    """The node the agent looks at: its name, where its state, sysfs, driver files and proc
    tree are."""

    state_dir: Path | None = setting(
        None,
        "Directory for the agent's state (checkpoint, simulator state, standalone objects)."
        " Unset: /var/lib/tessera for `run`; a temporary directory for one-shot commands"
        " with --simulate.",
        metavar="DIR",
    )
    node_name: str | None = setting(
        None,
        "Kubernetes node name of this node. Unset: NODE_NAME, else the host name (the model's"
        " host name with --simulate).",
        extra_env=("NODE_NAME",),
        metavar="NAME",
    )
    sysfs_root: Path | None = setting(
        None,
        "Root of the sysfs tree to read PCI, NUMA and NIC topology from. Unset: /sys, or the"
        " simulator's tree under --state-dir with --simulate.",
        metavar="DIR",
    )
    driver_root: Path | None = setting(
        None,
        "Where the NVIDIA driver's files are visible to the agent: the driver's libraries"
        " (libnvidia-ml.so.1 is loaded from here), binaries, firmware and /proc/driver/nvidia,"
        " found as under / of that root. In the DaemonSet the host's / (or the GPU operator's"
        " containerized driver root, /run/nvidia/driver) mounted at a fixed path. Unset: /, or"
        " the simulator's driver root under --state-dir with --simulate.",
        metavar="DIR",
    )
    host_driver_root: Path | None = setting(
        None,
        "Where the same driver files are on the host: every path a CDI spec names is under it,"
        " since the container runtime reads them on the host (/ for a driver installed on the"
        " host, /run/nvidia/driver for the GPU operator's containerized driver). Unset: the"
        " same as --driver-root; with --simulate, the simulated layout's (/ or"
        " /run/nvidia/driver).",
        metavar="DIR",
    )
    proc_root: Path | None = setting(
        None,
        "The proc tree to find which pod runs each GPU process in (<dir>/<pid>/cgroup), to split"
        " a shared GPU between its claims. NVML reports the host's PIDs: outside the host's PID"
        " namespace (a pod without hostPID) mount the host's /proc and point this at it."
        " Unset: /proc, or the simulator's tree under --state-dir with --simulate.",
        groups=("daemon",),
        metavar="DIR",
    )


@dataclass(frozen=True)
class SimulatorSettings:
    """A simulated node instead of NVML (``--simulate``), and its fault injection."""

    simulate: str | None = setting(
        None,
        "Run on a simulated node instead of NVML: a bundled model name (see `tessera sim models`)"
        " or a model YAML file.",
        metavar="MODEL",
    )
    sim_mig_layout: str | None = setting(
        None,
        "With --simulate: apply this MIG layout to every MIG-capable GPU at start"
        " (none, balanced, all-1g, all-7g). Unset: keep the simulated GPUs' state, or the"
        " model's default layout on a fresh state directory.",
        metavar="LAYOUT",
    )
    sim_driver_layout: str | None = setting(
        None,
        "With --simulate: the layout of the simulated driver root: ubuntu (a host driver in"
        " /usr/lib/x86_64-linux-gnu), rhel (a host driver in /usr/lib64) or container (the GPU"
        " operator's containerized driver, seen by the host at /run/nvidia/driver). Unset:"
        " ubuntu.",
        choices=("ubuntu", "rhel", "container"),
    )
    sim_crash_at: CrashAt | None = setting(
        None,
        "Fault injection, --simulate only: the daemon kills itself (SIGKILL) when a prepare or"
        " unprepare reaches POINT, one of " + ", ".join(CRASH_POINTS) + "; with POINT:N, the"
        " N-th time this process reaches it (N >= 1; a crash inside a batch of claims, e.g."
        " after-cdi:3 after the third claim's CDI spec). For crash-safety tests.",
        groups=("daemon",),
        metavar="POINT[:N]",
        parse=crash_at,
    )


@dataclass(frozen=True)
class DriverSettings:
    """What the driver advertises: its name, MIG and sharing modes, the ResourceSlice layout,
    the devices GPUs offer virtual machines."""

    driver_name: str = setting(
        "gpu.tessera.dev",
        "DRA driver name: ResourceSlice spec.driver, the kubelet plugin name, the CDI vendor.",
        groups=("driver",),
        metavar="NAME",
        parse=dns_subdomain,
    )
    mig_mode: str = setting(
        "static",
        "How MIG is advertised: static (existing MIG devices only) or dynamic (the whole GPU and"
        " every profile x placement as partitionable devices; needs the DRAPartitionableDevices"
        " feature gate).",
        groups=("driver",),
        choices=("static", "dynamic"),
    )
    mig_profiles: tuple[str, ...] = setting(
        (),
        "With --mig-mode dynamic: advertise the placements of these MIG profiles only (1g.10gb,"
        " 3g.40gb; repeat the flag for several, in the variable separated by commas), to keep"
        " the node's ResourceSlices small. A claim for another profile waits (no device matches"
        " it); whole GPUs are still advertised and the counters still keep every allocation"
        " apart. A profile no GPU of the node has is refused by one-shot commands and logged by"
        " the daemon. Unset: every profile.",
        groups=("driver",),
        metavar="PROFILE",
        parse=mig_profile_name,
    )
    sharing: str = setting(
        "none",
        "How whole GPUs are shared between claims: none (one claim per GPU; a claim can still"
        " time-slice or run MPS on its own GPU through its opaque config), time-slicing (claims"
        " whose configs time-slice at the same interval share a GPU) or memory-shares (claims"
        " share a GPU by memory: each gets the memory it requested, enforced by its own MPS"
        " daemon). Sharing needs the DRAConsumableCapacity feature gate.",
        groups=("driver",),
        choices=SHARING_MODES,
    )
    memory_share_min: str = setting(
        "1Gi",
        "With --sharing memory-shares: the smallest memory share, and a claim's share when it"
        " asks for none (a Kubernetes quantity).",
        groups=("driver",),
        metavar="QUANTITY",
        parse=memory_quantity,
    )
    memory_share_step: str = setting(
        "1Gi",
        "With --sharing memory-shares: shares are the minimum plus a multiple of this (the"
        " scheduler rounds requests up).",
        groups=("driver",),
        metavar="QUANTITY",
        parse=memory_quantity,
    )
    kube_layout: str = setting(
        "1.35",
        "ResourceSlice layout: 1.35 (counters in their own slice) or 1.34 (counters and the"
        " devices consuming them in one slice).",
        groups=("driver",),
        choices=("1.35", "1.34"),
    )
    virtualization: str = setting(
        "none",
        "What GPUs also offer virtual machines (KubeVirt): none, passthrough (each GPU in an"
        " IOMMU group is also a vfio device, the whole GPU for one VM, bound to vfio-pci at"
        " prepare; the scheduler never allocates it beside the GPU's container devices) or vgpu"
        " (on NVIDIA's vGPU host driver: a vgpu device per vGPU type and instance; such GPUs are"
        " not advertised for containers). Only with --sharing none; vgpu not with --mig-mode"
        " dynamic.",
        groups=("node", "driver"),
        choices=VIRTUALIZATION_MODES,
    )
    virtualization_gpus: tuple[str, ...] = setting(
        (),
        "With --virtualization: the GPUs that get VM devices, by minor (3), UUID (GPU-…) or PCI"
        " address (0000:1b:00.0); repeat the flag for several (in the variable: separated by"
        " commas). Unset: every GPU.",
        groups=("node", "driver"),
        metavar="GPU",
        parse=gpu_selector,
    )

    def __post_init__(self) -> None:
        if self.virtualization != "none" and self.sharing != "none":
            raise ConfigError(
                f"--virtualization {self.virtualization} and --sharing {self.sharing} go against"
                " each other: a GPU's VM device and its container devices are kept apart by one"
                " counter set per GPU, which a GPU shared between claims does not consume; use"
                " --sharing none with --virtualization, or --virtualization none"
            )
        if self.virtualization == "vgpu" and self.mig_mode == "dynamic":
            raise ConfigError(
                "--virtualization vgpu and --mig-mode dynamic go against each other: a GPU under"
                " NVIDIA's vGPU host driver is not advertised for containers, so it has no MIG"
                " placements to offer; use --mig-mode static (MIG-backed vGPU types are offered"
                " as vGPU types)"
            )
        if self.mig_profiles and self.mig_mode != "dynamic":
            raise ConfigError(
                f"--mig-profiles {','.join(self.mig_profiles)}: needs --mig-mode dynamic (with"
                f" {self.mig_mode}, the MIG devices advertised are the instances an admin made,"
                " whatever their profile)"
            )
        if self.virtualization_gpus and self.virtualization == "none":
            raise ConfigError(
                f"--virtualization-gpus {','.join(self.virtualization_gpus)}: needs"
                " --virtualization passthrough or vgpu (with none, no GPU gets VM devices)"
            )

    def device_policy(self) -> DevicePolicy:
        """What the node advertises, from the driver settings."""
        return DevicePolicy(
            driver_name=self.driver_name,
            mig_mode=self.mig_mode,
            sharing=self.sharing,
            memory_share_min=parse_bytes(self.memory_share_min),
            memory_share_step=parse_bytes(self.memory_share_step),
            virtualization=self.virtualization,
            virtualization_gpus=self.virtualization_gpus,
            mig_profiles=self.mig_profiles,
        )

    def sharing_policy(self) -> SharingPolicy:
        """How prepare lets claims share devices, from the driver settings."""
        return SharingPolicy(
            mode=self.sharing,
            dynamic_mig=self.mig_mode == "dynamic",
            memory_share_min=parse_bytes(self.memory_share_min),
        )
