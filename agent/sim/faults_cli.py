"""``tessera sim fault``: inject faults and load into a simulated node from another process.

::

    tessera sim fault --state-dir DIR xid --gpu N --xid X [--gi G [--ci C]]
    tessera sim fault --state-dir DIR gpu-lost --gpu N
    tessera sim fault --state-dir DIR recover --gpu N
    tessera sim fault --state-dir DIR driver-reload
    tessera sim fault --state-dir DIR load --gpu N --utilization U [--memory-mib M]
    tessera sim fault --state-dir DIR fail-call --call NAME [--gpu N] [--code C] [--times T]

``DIR`` is the agent's ``--state-dir`` (the simulator keeps its state in ``DIR/sim``) or the
simulator's directory itself. The node model is the one recorded there (``--simulate MODEL``
overrides it, e.g. for a model file). Every change goes through the simulator's state files
under their lock, so a running agent sees it at its next NVML call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import IO, Any

from agent.config import Config
from agent.errors import ConfigError
from agent.sim.specs import MIB
from agent.sim.state import STATE_FILE

ACTIONS = ("xid", "gpu-lost", "recover", "driver-reload", "load", "fail-call")


def add_fault_parser(simsub: Any) -> None:
    """Add ``fault`` to the ``tessera sim`` subcommands."""
    fault = simsub.add_parser(
        "fault", help="inject XIDs, lost GPUs, driver reloads, load or call failures"
    )
    fault.add_argument(
        "--state-dir",
        dest="state_dir",
        metavar="DIR",
        help="the agent's --state-dir (or the simulator's directory inside it)",
    )
    fault.add_argument(
        "--simulate", dest="simulate", metavar="MODEL", help="node model (default: recorded one)"
    )
    actions = fault.add_subparsers(dest="fault_action", required=True, metavar="ACTION")
    xid = actions.add_parser("xid", help="raise an XID on a GPU (or in one of its MIG devices)")
    _gpu(xid)
    xid.add_argument("--xid", type=int, required=True)
    xid.add_argument("--gi", type=int, help="GPU instance id (MIG)")
    xid.add_argument("--ci", type=int, help="compute instance id (MIG)")
    _gpu(actions.add_parser("gpu-lost", help="the GPU falls off the bus (XID 79)"))
    _gpu(actions.add_parser("recover", help="a lost GPU is back"))
    actions.add_parser("driver-reload", help="reload the driver: counters restart at 0")
    load = actions.add_parser("load", help="script a GPU's utilization (and memory use)")
    _gpu(load)
    load.add_argument("--utilization", type=float, required=True, help="0-1")
    load.add_argument("--memory-mib", type=int, help="memory in use, MiB (default: unchanged)")
    fail = actions.add_parser("fail-call", help="make telemetry/event calls fail")
    fail.add_argument("--call", required=True, help="NVML call name, e.g. nvmlDeviceGetPowerUsage")
    fail.add_argument("--gpu", type=int, help="only on this GPU (default: any)")
    fail.add_argument("--code", type=int, default=999, help="NVML error code (default 999)")
    fail.add_argument("--times", type=int, default=1, help="how many calls fail (0: every call)")


def _gpu(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", type=int, required=True, help="GPU index")


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


def cmd_sim_fault(config: Config, args: argparse.Namespace, out: IO[str]) -> int:
    """Apply one fault to the simulated node and say what was done."""
    from agent.sim.model import load_model
    from agent.sim.nvml import FakeNvml

    if config.state_dir is None:
        raise ConfigError("tessera sim fault needs --state-dir (or TESSERA_STATE_DIR)")
    sim_dir = simulator_dir(config.state_dir)
    fake = FakeNvml(load_model(config.simulate or _model_name(sim_dir)), sim_dir)
    action = args.fault_action
    if action == "xid":
        fake.inject_xid(args.gpu, args.xid, args.gi, args.ci)
        where = "" if args.gi is None else f" (GPU instance {args.gi}, compute instance {args.ci})"
        out.write(f"injected XID {args.xid} on GPU {args.gpu}{where}\n")
    elif action == "gpu-lost":
        fake.lose_gpu(args.gpu)
        out.write(f"GPU {args.gpu} fell off the bus (XID 79); its NVML calls now fail\n")
    elif action == "recover":
        fake.recover_gpu(args.gpu)
        out.write(f"GPU {args.gpu} recovered\n")
    elif action == "driver-reload":
        fake.reload_driver()
        out.write("driver reloaded: energy and error counters restart at 0, processes ended\n")
    elif action == "load":
        memory = None if args.memory_mib is None else args.memory_mib * MIB
        fake.set_load(args.gpu, args.utilization, memory)
        used = "" if memory is None else f", {args.memory_mib} MiB in use"
        out.write(f"GPU {args.gpu} load set to utilization {args.utilization:g}{used}\n")
    else:
        times = None if args.times == 0 else args.times
        fake.fail_call(args.call, gpu=args.gpu, code=args.code, times=times)
        on = "any GPU" if args.gpu is None else f"GPU {args.gpu}"
        count = "every call" if times is None else f"the next {times} call(s)"
        out.write(f"{args.call} on {on} fails with NVML error {args.code} for {count}\n")
    return 0
