"""``tessera sim``: the simulator's controls.

::

    tessera sim models
    tessera sim apiserver --port 8080 --kubeconfig-out FILE [--deny VERB:RESOURCE[.GROUP]]
    tessera sim fault --state-dir DIR xid --gpu N --xid X [--gi G [--ci C]]
    tessera sim fault --state-dir DIR gpu-lost --gpu N
    tessera sim fault --state-dir DIR recover --gpu N
    tessera sim fault --state-dir DIR driver-reload
    tessera sim fault --state-dir DIR load --gpu N --utilization U [--memory-mib M]
    tessera sim fault --state-dir DIR fail-call --call NAME [--gpu N] [--code C] [--times T]
    tessera sim fault --state-dir DIR remove-gpu --gpu N
    tessera sim fault --state-dir DIR add-gpu --gpu N
    tessera sim fault --state-dir DIR rebind --gpu N
    tessera sim fault --state-dir DIR mig-layout --gpu N --layout all-1g
    tessera sim fault --state-dir DIR iommu-off|iommu-on|vfio-unloaded|vfio-loaded
    tessera sim fault --state-dir DIR foreign-in-group|hold-gpu --gpu N   (agent/cli/sim_vm.py)
    tessera sim process --state-dir DIR start --gpu N [--pid P] [--pod-uid UID]
                        [--sm-utilization U] [--memory-mib M] [--gi G [--ci C]]
    tessera sim process --state-dir DIR stop --gpu N --pid P

``fault`` and ``process``: ``DIR`` is the agent's ``--state-dir`` (the simulator keeps its state
in ``DIR/sim``) or the simulator's directory itself. The node model is the one recorded there
(``--simulate MODEL`` overrides it, e.g. for a model file). Every change goes through the
simulator's state files under their lock, so a running agent sees it at its next NVML call.
``remove-gpu``/``add-gpu`` hot-remove a GPU and add it back (NVML, the sysfs tree under
``DIR/sim/sys`` and the udev events the agent's monitor reads change as on a real node);
``rebind`` is an operator's driver unbind + bind of one GPU (udev sees both: a GPU with a
sticky fatal XID is probed again); ``mig-layout`` is an administrator's ``nvidia-smi mig`` on
one GPU (no udev event: the agent's periodic re-read sees it). ``process start`` runs a compute
process on a GPU (NVML lists it, with its memory and SM utilization); with ``--pod-uid`` it runs
in that pod: the simulated ``/proc`` (``DIR/sim/proc``) gets its cgroup, which the agent reads to
attribute the process to the claims of that pod.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.cli.framework import Command, Invocation, Uses
from agent.cli.sim_vm import vm_faults
from agent.config import (
    REQUIRED,
    fraction,
    integer,
    non_negative_int,
    port,
    positive_int,
    setting,
    text,
)
from agent.errors import ConfigError
from agent.sim.apiserver_access import Rule
from agent.sim.specs import MIB
from agent.sim.state import STATE_FILE

# -- options ----------------------------------------------------------------------------------


def access_rule(raw: str) -> Rule:
    """``VERB:RESOURCE[.GROUP]`` -> a Rule of the emulator's access table."""
    verb, sep, what = raw.partition(":")
    resource, _, group = what.partition(".")
    if not sep or not verb or not resource:
        raise ValueError(
            "is not VERB:RESOURCE[.GROUP] (e.g. delete:resourceslices.resource.k8s.io, get:nodes)"
        )
    return Rule(verb, resource, group)


@dataclass(frozen=True, kw_only=True)
class ApiServerOptions:
    port: int = setting(
        0, "TCP port on 127.0.0.1 (0: any free one).", metavar="PORT", parse=port, listen=True
    )
    kubeconfig_out: Path = setting(
        REQUIRED, "Write a kubeconfig for the emulator to this file.", metavar="FILE"
    )
    deny: tuple[Rule, ...] = setting(
        (),
        "Refuse this request with 403 Forbidden, as RBAC would (SelfSubjectAccessReviews say"
        " so too): VERB:RESOURCE for the core group, VERB:RESOURCE.GROUP otherwise, * for any,"
        " e.g. delete:resourceslices.resource.k8s.io. Repeat for several. Unset: everything"
        " is allowed.",
        metavar="VERB:RESOURCE[.GROUP]",
        parse=access_rule,
    )
    run_pods_for: str | None = setting(
        None,
        "Play this node's kubelet for the Pods bound to it (the agent's MPS Pods in kube mode):"
        " run each one's container command as a local process, write its status, stop it when"
        " the Pod is deleted (agent/sim/podrunner.py; logs next to --kubeconfig-out). Unset:"
        " such Pods stay Pending, and MPS claims fail to prepare.",
        metavar="NODE",
    )


@dataclass(frozen=True, kw_only=True)
class FaultOptions:
    state_dir: Path = setting(
        REQUIRED,
        "The agent's --state-dir (or the simulator's directory inside it).",
        metavar="DIR",
    )
    simulate: str | None = setting(
        None, "Node model. Unset: the one recorded in the state directory.", metavar="MODEL"
    )


_GPU_HELP = "GPU index (as `tessera discover` numbers them)."


@dataclass(frozen=True, kw_only=True)
class GpuOptions:
    gpu: int = setting(REQUIRED, _GPU_HELP, metavar="N", parse=non_negative_int)


@dataclass(frozen=True, kw_only=True)
class XidOptions:
    gpu: int = setting(REQUIRED, _GPU_HELP, metavar="N", parse=non_negative_int)
    xid: int = setting(
        REQUIRED, "The XID error number, e.g. 79 (fallen off the bus) or 48 (DBE).",
        metavar="XID", parse=positive_int,
    )  # fmt: skip
    gi: int | None = setting(
        None, "GPU instance id, for an XID in a MIG device.", metavar="ID", parse=non_negative_int
    )
    ci: int | None = setting(
        None, "Compute instance id (with --gi).", metavar="ID", parse=non_negative_int
    )


@dataclass(frozen=True, kw_only=True)
class MigLayoutOptions:
    gpu: int = setting(REQUIRED, _GPU_HELP, metavar="N", parse=non_negative_int)
    layout: str = setting(
        REQUIRED,
        "The MIG layout to create on the GPU (its instances are destroyed first): balanced"
        " (3g+2g+2x1g), all-1g or all-7g.",
        metavar="LAYOUT",
    )


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    gpu: int = setting(REQUIRED, _GPU_HELP, metavar="N", parse=non_negative_int)
    utilization: float = setting(
        REQUIRED, "GPU utilization from 0 to 1.", metavar="U", parse=fraction
    )
    memory_mib: int | None = setting(
        None, "Memory in use, MiB. Unset: unchanged.", metavar="MIB", parse=non_negative_int
    )


@dataclass(frozen=True, kw_only=True)
class FailCallOptions:
    call: str = setting(
        REQUIRED, "NVML call name, e.g. nvmlDeviceGetPowerUsage.", metavar="NAME", parse=text
    )
    gpu: int | None = setting(
        None, "Only on this GPU. Unset: on any GPU.", metavar="N", parse=non_negative_int
    )
    code: int = setting(999, "NVML error code the call fails with.", metavar="CODE", parse=integer)
    times: int = setting(
        1, "How many calls fail (0: every call).", metavar="N", parse=non_negative_int
    )


@dataclass(frozen=True, kw_only=True)
class ProcessStartOptions:
    gpu: int = setting(REQUIRED, _GPU_HELP, metavar="N", parse=non_negative_int)
    pid: int | None = setting(
        None, "Its PID. Unset: one no simulated process has.", metavar="PID", parse=positive_int
    )
    pod_uid: str | None = setting(
        None,
        "UID of the pod it runs in (metadata.uid; a claim reserved for that pod owns it)."
        " Unset: not in a pod.",
        metavar="UID",
        parse=text,
    )
    sm_utilization: float | None = setting(
        None,
        "Its share of the GPU's SMs, 0 to 1, as NVML reports it. Unset: NVML has no sample.",
        metavar="U",
        parse=fraction,
    )
    memory_mib: int = setting(512, "Memory it uses, MiB.", metavar="MIB", parse=non_negative_int)
    gi: int | None = setting(
        None, "GPU instance id: on a MIG GPU it runs in that MIG device.", metavar="ID",
        parse=non_negative_int,
    )  # fmt: skip
    ci: int | None = setting(
        None, "Compute instance id (with --gi; unset: the first).", metavar="ID",
        parse=non_negative_int,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ProcessStopOptions:
    gpu: int = setting(REQUIRED, _GPU_HELP, metavar="N", parse=non_negative_int)
    pid: int = setting(REQUIRED, "Its PID.", metavar="PID", parse=positive_int)


# -- handlers ---------------------------------------------------------------------------------


def cmd_models(inv: Invocation) -> int:
    from agent.sim.model import all_model_names, load_model

    for name in all_model_names():
        inv.out.write(f"{name:<12} {load_model(name).description}\n")
    return 0


def cmd_apiserver(inv: Invocation) -> int:
    """Serve the API-server emulator until SIGINT/SIGTERM."""
    from agent.sim.apiserver import ApiServer

    opts = inv.get(ApiServerOptions)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = ApiServer(port=opts.port)
    for rule in opts.deny:
        server.access.deny(rule.verb, rule.resource, rule.group)
    with server:
        written = server.kubeconfig(opts.kubeconfig_out)
        runner = None
        if opts.run_pods_for is not None:
            from agent.sim.podrunner import PodRunner

            logs = written.parent / "pod-logs"
            runner = PodRunner(server.url, opts.run_pods_for, logs, dict(os.environ)).start()
        inv.out.write(f"API server emulator on {server.url}; kubeconfig: {written}\n")
        inv.out.flush()
        try:
            stop.wait()
        finally:
            if runner is not None:
                runner.stop()
    return 0


def simulator_dir(state_dir: Path) -> Path:
    """The directory holding the simulator's state: ``DIR/sim`` or ``DIR`` itself."""
    for candidate in (state_dir / "sim", state_dir):
        if (candidate / STATE_FILE).is_file():
            return candidate
    raise ConfigError(
        f"no simulated node in {state_dir} (no {STATE_FILE} there or in its sim/); start one with"
        f" `tessera run --simulate MODEL --state-dir {state_dir}` or `tessera discover`"
    )


def _model_name(sim_dir: Path) -> str:
    try:
        raw = json.loads((sim_dir / STATE_FILE).read_text())
        return str(raw["model"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"cannot read the simulated model from {sim_dir / STATE_FILE}: {exc}"
        ) from exc


def open_simulator(inv: Invocation) -> Any:
    from agent.sim.model import load_model
    from agent.sim.nvml import FakeNvml

    opts = inv.get(FaultOptions)
    sim_dir = simulator_dir(opts.state_dir)
    return FakeNvml(load_model(opts.simulate or _model_name(sim_dir)), sim_dir)


def fault_xid(inv: Invocation) -> int:
    opts = inv.get(XidOptions)
    open_simulator(inv).inject_xid(opts.gpu, opts.xid, opts.gi, opts.ci)
    where = "" if opts.gi is None else f" (GPU instance {opts.gi}, compute instance {opts.ci})"
    inv.out.write(f"injected XID {opts.xid} on GPU {opts.gpu}{where}\n")
    if opts.xid == 79:
        inv.out.write(f"GPU {opts.gpu} fell off the bus; its NVML calls now fail until `recover`\n")
    return 0


def fault_gpu_lost(inv: Invocation) -> int:
    gpu = inv.get(GpuOptions).gpu
    open_simulator(inv).lose_gpu(gpu)
    inv.out.write(f"GPU {gpu} fell off the bus (XID 79); its NVML calls now fail\n")
    return 0


def fault_recover(inv: Invocation) -> int:
    gpu = inv.get(GpuOptions).gpu
    open_simulator(inv).recover_gpu(gpu)
    inv.out.write(f"GPU {gpu} recovered\n")
    return 0


def fault_driver_reload(inv: Invocation) -> int:
    open_simulator(inv).reload_driver()
    inv.out.write("driver reloaded: energy and error counters restart at 0, processes ended\n")
    return 0


def fault_load(inv: Invocation) -> int:
    opts = inv.get(LoadOptions)
    memory = None if opts.memory_mib is None else opts.memory_mib * MIB
    open_simulator(inv).set_load(opts.gpu, opts.utilization, memory)
    used = "" if memory is None else f", {opts.memory_mib} MiB in use"
    inv.out.write(f"GPU {opts.gpu} load set to utilization {opts.utilization:g}{used}\n")
    return 0


def fault_fail_call(inv: Invocation) -> int:
    opts = inv.get(FailCallOptions)
    times = None if opts.times == 0 else opts.times
    open_simulator(inv).fail_call(opts.call, gpu=opts.gpu, code=opts.code, times=times)
    on = "any GPU" if opts.gpu is None else f"GPU {opts.gpu}"
    count = "every call" if times is None else f"the next {times} call(s)"
    inv.out.write(f"{opts.call} on {on} fails with NVML error {opts.code} for {count}\n")
    return 0


def fault_remove_gpu(inv: Invocation) -> int:
    from agent.sim.udev import remove_gpu

    gpu = inv.get(GpuOptions).gpu
    done = remove_gpu(open_simulator(inv), gpu)
    inv.out.write(
        f"GPU {gpu} removed from the PCI bus\n" if done else f"GPU {gpu} was already removed\n"
    )
    return 0


def fault_rebind(inv: Invocation) -> int:
    from agent.sim.udev import rebind_gpu

    gpu = inv.get(GpuOptions).gpu
    if not rebind_gpu(open_simulator(inv), gpu):
        raise ConfigError(f"GPU {gpu} is not on the PCI bus (add it back with add-gpu first)")
    inv.out.write(f"GPU {gpu} unbound from the driver and bound again (udev: unbind, bind)\n")
    return 0


def fault_add_gpu(inv: Invocation) -> int:
    from agent.sim.udev import add_gpu

    gpu = inv.get(GpuOptions).gpu
    done = add_gpu(open_simulator(inv), gpu)
    inv.out.write(
        f"GPU {gpu} added to the PCI bus\n" if done else f"GPU {gpu} is on the bus already\n"
    )
    return 0


def fault_mig_layout(inv: Invocation) -> int:
    from agent.sim.udev import set_mig_layout

    opts = inv.get(MigLayoutOptions)
    set_mig_layout(open_simulator(inv), opts.gpu, opts.layout)
    inv.out.write(f"GPU {opts.gpu}: MIG layout {opts.layout} created\n")
    return 0


def process_start(inv: Invocation) -> int:
    opts = inv.get(ProcessStartOptions)
    fake = open_simulator(inv)
    pid = opts.pid if opts.pid is not None else fake.free_pid()
    fake.add_process(
        opts.gpu, pid, opts.memory_mib * MIB, opts.gi, opts.ci, opts.sm_utilization, opts.pod_uid
    )
    pod = "" if opts.pod_uid is None else f" in pod {opts.pod_uid}"
    sm = "none" if opts.sm_utilization is None else f"{opts.sm_utilization:g}"
    inv.out.write(
        f"process {pid} started on GPU {opts.gpu}{pod}: {opts.memory_mib} MiB, SM utilization"
        f" {sm}\n"
    )
    return 0


def process_stop(inv: Invocation) -> int:
    opts = inv.get(ProcessStopOptions)
    open_simulator(inv).remove_process(opts.gpu, opts.pid)
    inv.out.write(f"process {opts.pid} on GPU {opts.gpu} ended\n")
    return 0


# -- the tree ---------------------------------------------------------------------------------

FAULT = Command(
    "fault",
    "inject XIDs, lost GPUs, driver reloads, load, call failures, hot-plug, MIG or VFIO changes",
    uses=(Uses(FaultOptions),),
    description="Inject faults and load into a running simulated node from another process:"
    " the agent sees them at its next NVML call.",
    metavar="ACTION",
    subcommands=(
        Command(
            "xid",
            "raise an XID on a GPU (or in one of its MIG devices)",
            fault_xid,
            (Uses(XidOptions),),
        ),
        Command(
            "gpu-lost", "the GPU falls off the bus (XID 79)", fault_gpu_lost, (Uses(GpuOptions),)
        ),
        Command("recover", "a lost GPU is back", fault_recover, (Uses(GpuOptions),)),
        Command("driver-reload", "reload the driver: counters restart at 0", fault_driver_reload),
        Command(
            "load",
            "script a GPU's utilization (and memory use)",
            fault_load,
            (Uses(LoadOptions),),
        ),
        Command(
            "fail-call",
            "make telemetry/event calls fail",
            fault_fail_call,
            (Uses(FailCallOptions),),
        ),
        Command(
            "remove-gpu",
            "hot-remove a GPU from the PCI bus (udev: unbind, remove)",
            fault_remove_gpu,
            (Uses(GpuOptions),),
        ),
        Command(
            "add-gpu",
            "hot-add a removed GPU back (udev: add, bind)",
            fault_add_gpu,
            (Uses(GpuOptions),),
        ),
        Command(
            "rebind",
            "unbind a GPU from the driver and bind it again (udev: unbind, bind)",
            fault_rebind,
            (Uses(GpuOptions),),
        ),
        Command(
            "mig-layout",
            "an administrator's MIG change on one GPU, as nvidia-smi mig makes it",
            fault_mig_layout,
            (Uses(MigLayoutOptions),),
        ),
        *vm_faults(open_simulator),
    ),
)

PROCESS = Command(
    "process",
    "start and stop compute processes on GPUs (optionally in a pod)",
    uses=(Uses(FaultOptions),),
    description="Run simulated compute processes on a running simulated node from another"
    " process: NVML lists them at the agent's next call. A process started with --pod-uid runs"
    " in that pod: the simulated /proc gets its cgroup, so the agent attributes its GPU use to"
    " the claims reserved for the pod.",
    metavar="ACTION",
    subcommands=(
        Command(
            "start",
            "run a process on a GPU (its PID is printed)",
            process_start,
            (Uses(ProcessStartOptions),),
        ),
        Command("stop", "end a process", process_stop, (Uses(ProcessStopOptions),)),
    ),
)

COMMAND = Command(
    "sim",
    "simulator controls",
    metavar="SIM_COMMAND",
    subcommands=(
        Command("models", "list the simulated node models", cmd_models),
        Command(
            "apiserver",
            "serve an in-memory Kubernetes API server (for kube mode without a cluster)",
            cmd_apiserver,
            (Uses(ApiServerOptions),),
        ),
        FAULT,
        PROCESS,
    ),
)
