"""``tessera doctor``: check that this node is ready for the agent, one verdict per check.

::

    tessera doctor                                 # on the host, as root
    kubectl -n tessera-system exec ds/tessera -- tessera doctor   # the pod sets --host-root
    tessera doctor --simulate dgx-h100 -o json     # the simulated node

It takes the agent's own flags (and ``TESSERA_*`` variables: in the agent's pod it sees the
agent's), so it checks the directories, driver root and API server ``tessera run`` would use.
Exit code 0 when no check failed (warnings do not count), 1 when one did; 2 when the doctor
itself cannot run (a bad flag, an unknown model).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agent.cli.framework import Command, Invocation, Uses
from agent.config import Config, setting


@dataclass(frozen=True, kw_only=True)
class DoctorOptions:
    output: str = setting(
        "table",
        "Output format: table (for people) or json (for scripts).",
        flags=("-o", "--output"),
        choices=("table", "json"),
    )
    host_root: Path | None = setting(
        None,
        "Where the host's / is visible: the doctor reads the host's /dev (device nodes),"
        " /etc/containerd and /etc/crio (CDI in the container runtime) and the NVIDIA Container"
        " Toolkit's hook through it. The DaemonSet mounts the host's / at /host-root and sets"
        " this there (the container-driver overlay mounts no host /: in a pod, the runtime check"
        " is then skipped). Unset: /, or the simulated node's host tree (under --state-dir) with"
        " --simulate.",
        metavar="DIR",
    )


def cmd_doctor(inv: Invocation) -> int:
    from agent.cli.node_access import host_root, open_node
    from agent.daemon import DEFAULT_STATE_DIR, agent_paths, cdi_hook
    from agent.doctor import Facts, diagnose
    from agent.doctor.host import check_state_dir
    from agent.doctor.verdict import exit_code, to_json, to_table
    from dra_driver.cluster.kube import KubeClient

    config = inv.get(Config)
    opts = inv.get(DoctorOptions)
    with tempfile.TemporaryDirectory(prefix="tessera-doctor-") as tmp:
        state_dir = config.node.state_dir or (
            Path(tmp) if config.simulator.simulate else DEFAULT_STATE_DIR
        )
        paths = agent_paths(config, state_dir)
        # the simulated node is written under the state directory; one that is not usable
        # (a file in the way, not writable) is the state-dir check's failure to report, as on
        # a real node: the simulated node then lives in the temporary directory instead
        node_dir = state_dir
        if config.simulator.simulate and check_state_dir(state_dir).status == "fail":
            node_dir = Path(tmp)
        source = open_node(config, node_dir)
        facts = Facts(
            source=source,
            host_root=host_root(config, node_dir, opts.host_root),
            state_dir=state_dir,
            registry_dir=paths.registry_dir,
            plugins_dir=paths.plugins_dir,
            cdi_root=paths.cdi_root,
            mig_mode=config.driver.mig_mode,
            virtualization=config.driver.virtualization,
            connect=None
            if config.cluster.no_kube
            else lambda: KubeClient.from_config(config.cluster.kubeconfig),
            stand_in_nodes=config.simulator.simulate is not None,
            cdi_hook=cdi_hook(config.cdi, source, os.environ),
            in_pod=bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
            and config.simulator.simulate is None,
        )
        verdicts = diagnose(facts)
    node = facts.source.hostname
    render = to_json if opts.output == "json" else to_table
    inv.out.write(render(node, verdicts))
    return exit_code(verdicts)


COMMAND = Command(
    "doctor",
    "check that this node is ready for the agent (driver, devices, CDI, kubelet, API server)",
    cmd_doctor,
    (Uses(Config, ("node", "driver", "daemon")), Uses(DoctorOptions)),
    description="Check that this node is ready for the agent, each check with a one-line"
    " verdict (ok, warn, fail, skip) and its fix: the NVIDIA driver and the NVML file loaded,"
    " driver and CUDA versions, each GPU's MIG mode against --mig-mode, the device nodes, the"
    " CDI directory and the container runtime reading it, the kubelet's plugin directories,"
    " the NVIDIA Container Toolkit's hook, the state directory and its lock, the API server"
    " and the RBAC the agent needs; with --virtualization passthrough or vgpu also the IOMMU,"
    " vfio-pci, each GPU's IOMMU group, SR-IOV virtual functions and the vGPU host driver's"
    " types. It takes the agent's flags, so it checks what `tessera run`"
    " with them would use. Exit code 0 when nothing failed (warnings do not count), 1 when"
    " something did. See docs/troubleshooting.md.",
)
