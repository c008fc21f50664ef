"""``tessera doctor``: is this node ready for the agent? Each check looks at one thing and
answers with a :class:`~agent.doctor.verdict.Verdict` (ok, warn, fail or skip, one line, the
fix); :func:`diagnose` runs them all over a :class:`Facts` and returns the verdicts in order.

==================  =================================================  ==============
check               looks at                                           module
==================  =================================================  ==============
``driver``          NVML initializes                                   :mod:`.gpu`
``nvml-library``    which libnvidia-ml file was loaded                 :mod:`.gpu`
``driver-version``  driver and CUDA versions, the driver's libraries   :mod:`.gpu`
``mig-mode``        per GPU: current/pending, against ``--mig-mode``   :mod:`.gpu`
``device-nodes``    /dev nodes the CDI specs name, on the host         :mod:`.gpu`
``iommu``           IOMMU groups exist (``--virtualization`` only)     :mod:`.vm_checks`
``vfio-pci``        vfio-pci is loaded (passthrough)                   :mod:`.vm_checks`
``iommu-group``     per GPU: its group holds only its own functions    :mod:`.vm_checks`
                    (passthrough)
``sriov``           per GPU: virtual functions enabled where the vGPU  :mod:`.vm_checks`
                    host driver makes vGPUs on them (vgpu)
``vgpu-types``      per GPU: the vGPU host driver offers types (vgpu)  :mod:`.vm_checks`
``cdi-dir``         ``--cdi-root`` writable                            :mod:`.host`
``cdi-runtime``     containerd / CRI-O has CDI on and reads it         :mod:`.host`
``kubelet-dirs``    the kubelet's registry and plugins directories     :mod:`.host`
``cdi-hook``        the NVIDIA Container Toolkit's hook (warn only)    :mod:`.host`
``state-dir``       ``--state-dir`` writable                           :mod:`.host`
``state-lock``      who holds the state directory's lock               :mod:`.host`
``api-server``      reachable, 1.34+, ``resource.k8s.io/v1``           :mod:`.api`
``rbac``            a SelfSubjectAccessReview per request the agent    :mod:`.api`
                    makes
==================  =================================================  ==============

Checks are independent, except that the GPU checks need NVML (skipped when the driver check
fails) and RBAC needs the API server. Nothing here decides paths or defaults: the composition
root (``agent.daemon``) resolves them from the flags exactly as ``tessera run`` would and hands
them over in :class:`Facts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.doctor.cluster_api import api_checks
from agent.doctor.gpu import check_driver, gpu_checks, loaded_nvml, skipped_gpu_checks
from agent.doctor.host import (
    check_cdi_dir,
    check_cdi_hook,
    check_kubelet_dirs,
    check_runtimes,
    check_state_dir,
    check_state_lock,
)
from agent.doctor.verdict import Verdict
from agent.doctor.vm_checks import virtualization_checks
from agent.node import NodeSource
from dra_driver.cluster.kube import KubeClient


@dataclass(frozen=True)
class Facts:
    """What the doctor is told about the node and the agent's configuration."""

    source: NodeSource
    """The node (NVML not initialized yet)."""
    host_root: Path
    """Where the host's / is visible (``--host-root``)."""
    state_dir: Path
    registry_dir: Path
    plugins_dir: Path
    cdi_root: Path
    mig_mode: str
    connect: Callable[[], KubeClient] | None
    """Opens the API server the agent would use; None in standalone mode (``--no-kube``)."""
    stand_in_nodes: bool = False
    """Regular files stand in for device nodes (the simulator's /dev)."""
    cdi_hook: str | None = None
    """The hook binary the agent's CDI specs run (host path); None: the hook-free layout."""
    nvml_library: Callable[[NodeSource], str | None] = loaded_nvml
    """Which NVML file the source loaded (after its init)."""
    in_pod: bool = False
    """Runs in a Kubernetes pod (``KUBERNETES_SERVICE_HOST`` set, as the kubelet does in every
    container): with the host root ``/`` the host's runtime configuration is not visible."""
    virtualization: str = "none"
    """``--virtualization``: passthrough or vgpu add the checks of :mod:`.vm_checks`."""


def diagnose(facts: Facts) -> list[Verdict]:
    """Every check's verdict, in the order of the table above."""
    source = facts.source
    driver = check_driver(source)
    out = [driver]
    if driver.status == "ok":
        try:
            out += gpu_checks(
                source,
                facts.host_root,
                facts.mig_mode,
                stand_in_nodes=facts.stand_in_nodes,
                library=facts.nvml_library,
            )
        finally:
            source.nvml.shutdown()
    else:
        out += skipped_gpu_checks()
    out += virtualization_checks(source.sysfs_root, facts.virtualization)
    out.append(check_cdi_dir(facts.cdi_root))
    out += check_runtimes(facts.host_root, facts.cdi_root, in_pod=facts.in_pod)
    out += check_kubelet_dirs(facts.registry_dir, facts.plugins_dir)
    out.append(check_cdi_hook(facts.cdi_hook))
    out.append(check_state_dir(facts.state_dir))
    out.append(check_state_lock(facts.state_dir))
    out += api_checks(facts.connect)
    return out
