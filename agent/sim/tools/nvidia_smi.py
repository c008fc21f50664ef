"""The simulated ``nvidia-smi``: the subset a GPU-sharing driver runs.

::

    nvidia-smi [-i ID[,ID...]] -c MODE                       MODE: 0|DEFAULT, 2|PROHIBITED,
                                                                   3|EXCLUSIVE_PROCESS
    nvidia-smi [-i ID[,ID...]] --query-gpu=FIELD[,...] --format=csv[,noheader][,nounits]
    nvidia-smi compute-policy [-i ID[,ID...]] --set-timeslice N     N: 0 DEFAULT, 1 SHORT,
                                                                       2 MEDIUM, 3 LONG
    nvidia-smi compute-policy [-i ID[,ID...]] -l|--list

``ID`` is what the real tool accepts: the index, the GPU UUID, the PCI bus id or the board
serial. Long options take their value as ``--opt=V`` or ``--opt V``. Without ``-i`` every GPU is
targeted. Exit statuses are the real tool's (its man page, "RETURN VALUE"): 0 success, 2 a bad
argument, 3 not available on the target device (a MIG device), 6 no such device, 9 the driver
(here: the simulated node) is gone, 15 the GPU fell off the bus, 255 anything else. Results go
to standard output, one-line errors to standard error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import pynvml

from agent.sim.nvml import FakeNvml
from agent.sim.sharing import TIMESLICES, compute_mode_name
from agent.sim.tools.common import ToolError
from agent.sim.tools.simulator import open_simulator
from agent.sim.tools.targets import Target, find_target, gpu_target

TOOL = "nvidia-smi"
EXIT_BAD_ARGUMENT = 2
EXIT_NOT_AVAILABLE = 3
EXIT_NOT_FOUND = 6
EXIT_NO_DRIVER = 9
EXIT_OTHER = 255
_NVML_EXITS = {2, 3, 4, 6, 8, 9, 10, 12, 13, 14, 15}
"""NVML error codes nvidia-smi passes through as its exit status (the man page's list)."""

COMPUTE_MODE_ARGS = {
    "0": 0,
    "DEFAULT": 0,
    "2": 2,
    "PROHIBITED": 2,
    "3": 3,
    "EXCLUSIVE_PROCESS": 3,
}
COMPUTE_MODE_WORDS = {0: "DEFAULT", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}
ALLOWED_MODES = "0|DEFAULT, 2|PROHIBITED, 3|EXCLUSIVE_PROCESS"
ALLOWED_TIMESLICES = "0=DEFAULT, 1=SHORT, 2=MEDIUM, 3=LONG"
HINT = "Please run 'nvidia-smi -h' for help."

USAGE = """\
NVIDIA System Management Interface (simulated by Tessera) -- the GPU-sharing subset.

    nvidia-smi [-i ID] -c MODE           Set the compute mode: 0|DEFAULT, 2|PROHIBITED,
                                         3|EXCLUSIVE_PROCESS.
    nvidia-smi [-i ID] --query-gpu=FIELDS --format=csv[,noheader][,nounits]
                                         FIELDS: index, uuid, name, serial, pci.bus_id,
                                         compute_mode, mig.mode.current, power.draw,
                                         power.limit, enforced.power.limit,
                                         power.default_limit, power.min_limit,
                                         power.max_limit.
    nvidia-smi compute-policy -h         Time-slice settings.

    [-i | --id]: GPU index, UUID, PCI bus id or serial; comma separated for several.
"""

POLICY_USAGE = """\
nvidia-smi compute-policy (simulated by Tessera): time-slice settings.

    nvidia-smi compute-policy [-i ID[,ID...]] --set-timeslice N
        N: 0=DEFAULT, 1=SHORT, 2=MEDIUM, 3=LONG (also --set-timeslice=N)
    nvidia-smi compute-policy [-i ID[,ID...]] -l | --list
    nvidia-smi compute-policy -h | --help

    -i | --id: GPU index, UUID, PCI bus id or serial; comma separated for several.
"""

QUERY_FIELDS: dict[str, Callable[[FakeNvml, Target], str]] = {
    "index": lambda fake, t: str(t.index),
    "uuid": lambda fake, t: t.uuid,
    "name": lambda fake, t: fake.model.gpus[t.index].spec.name,
    "serial": lambda fake, t: fake.model.gpus[t.index].serial,
    "pci.bus_id": lambda fake, t: t.bus_id,
    "compute_mode": lambda fake, t: compute_mode_name(
        fake.nvmlDeviceGetComputeMode(fake.nvmlDeviceGetHandleByIndex(t.index))
    ),
    "mig.mode.current": lambda fake, t: _mig_mode(fake, t),
    "power.draw": lambda fake, t: _watts(fake, t, "nvmlDeviceGetPowerUsage"),
    "power.limit": lambda fake, t: _watts(fake, t, "nvmlDeviceGetPowerManagementLimit"),
    "enforced.power.limit": lambda fake, t: _watts(fake, t, "nvmlDeviceGetEnforcedPowerLimit"),
    "power.default_limit": lambda fake, t: _watts(
        fake, t, "nvmlDeviceGetPowerManagementDefaultLimit"
    ),
    "power.min_limit": lambda fake, t: _limit_watts(fake, t, 0),
    "power.max_limit": lambda fake, t: _limit_watts(fake, t, 1),
}
UNITS = {
    name: "W"
    for name in (
        "power.draw",
        "power.limit",
        "enforced.power.limit",
        "power.default_limit",
        "power.min_limit",
        "power.max_limit",
    )
}
"""Fields with a unit: nvidia-smi's CSV says ``power.draw [W]`` and ``250.00 W`` unless
``nounits``."""


def _w(milliwatts: int) -> str:
    return f"{milliwatts / 1000:.2f}"


def _watts(fake: FakeNvml, t: Target, call: str) -> str:
    """Watts, as nvidia-smi prints them, from an NVML call that answers milliwatts."""
    return _w(int(getattr(fake, call)(fake.nvmlDeviceGetHandleByIndex(t.index))))


def _limit_watts(fake: FakeNvml, t: Target, which: int) -> str:
    h = fake.nvmlDeviceGetHandleByIndex(t.index)
    return _w(fake.nvmlDeviceGetPowerManagementLimitConstraints(h)[which])


def _mig_mode(fake: FakeNvml, t: Target) -> str:
    if not fake.model.gpus[t.index].spec.mig_capable:
        return "[N/A]"
    return "Enabled" if fake.state.gpus[t.index].mig_current else "Disabled"


@dataclass
class Options:
    """The parsed command line: each option's value, as given."""

    values: dict[str, str] = field(default_factory=dict)
    flags: set[str] = field(default_factory=set)


def _bad(message: str) -> ToolError:
    return ToolError(f"Invalid combination of input arguments: {message}. {HINT}", 2)


def parse(argv: Sequence[str], valued: dict[str, str], flags: dict[str, str], what: str) -> Options:
    """Parse ``argv`` against option spellings mapped to their canonical names: ``valued``
    options take a value (``-x V``, ``--long V``, ``--long=V``), ``flags`` take none."""
    opts = Options()
    args = list(argv)
    while args:
        arg = args.pop(0)
        name, eq, inline = arg.partition("=")
        if eq and name.startswith("--") and name in valued:
            value = inline
        elif arg in valued:
            if not args:
                raise _bad(f"{arg} needs a value")
            value = args.pop(0)
        elif arg in flags:
            opts.flags.add(flags[arg])
            continue
        else:
            known = ", ".join(sorted({*valued, *flags}))
            raise _bad(f"unknown option {arg!r} for {what} (this simulation knows {known})")
        canonical = valued[name if eq else arg]
        if canonical in opts.values:
            raise _bad(f"{name if eq else arg} given twice")
        opts.values[canonical] = value
    return opts


def _targets(fake: FakeNvml, ids: str | None) -> list[Target]:
    """The devices ``-i`` names (every GPU without ``-i``); exit 6 for an unknown one."""
    if ids is None:
        return [gpu_target(fake, g.index) for g in fake.model.gpus]
    targets = []
    for ident in ids.split(","):
        target = find_target(fake, ident)
        if target is None:
            raise ToolError(
                f"No devices were found: -i {ident.strip()!r} names no GPU (this node has GPUs"
                f" 0..{len(fake.model.gpus) - 1}; give an index, a GPU UUID, a PCI bus id or"
                " a serial number)",
                EXIT_NOT_FOUND,
            )
        targets.append(target)
    return targets


def _whole_gpu(target: Target, what: str) -> None:
    if target.mig:
        raise ToolError(
            f"Unable to {what} for {target.uuid}: not supported on a MIG device, only on its"
            f" GPU {target.bus_id}",
            EXIT_NOT_AVAILABLE,
        )


def _nvml_failure(exc: pynvml.NVMLError, what: str, target: Target) -> ToolError:
    code = int(exc.value)
    return ToolError(
        f"Unable to {what} for GPU {target.bus_id}: {exc}",
        code if code in _NVML_EXITS else EXIT_OTHER,
    )


# -- commands -------------------------------------------------------------------------------


def set_compute_mode(fake: FakeNvml, opts: Options, out: TextIO) -> int:
    text = opts.values["compute-mode"]
    mode = COMPUTE_MODE_ARGS.get(text)
    if mode is None:
        removed = text in ("1", "EXCLUSIVE_THREAD")
        why = "was removed from the driver (CUDA 4.0)" if removed else "is not a compute mode"
        raise ToolError(
            f"Invalid compute mode {text!r}: it {why}; allowed: {ALLOWED_MODES}",
            EXIT_BAD_ARGUMENT,
        )
    word = COMPUTE_MODE_WORDS[mode]
    for target in _targets(fake, opts.values.get("id")):
        _whole_gpu(target, "set the compute mode")
        try:
            handle = fake.nvmlDeviceGetHandleByIndex(target.index)
            if fake.nvmlDeviceGetComputeMode(handle) == mode:
                out.write(f"Compute mode is already set to {word} for GPU {target.bus_id}.\n")
                continue
            fake.nvmlDeviceSetComputeMode(handle, mode)
        except pynvml.NVMLError as exc:
            raise _nvml_failure(exc, "set the compute mode", target) from exc
        out.write(f"Set compute mode to {word} for GPU {target.bus_id}.\n")
    out.write("All done.\n")
    return 0


def _value(fake: FakeNvml, target: Target, name: str, formats: set[str]) -> str:
    value = QUERY_FIELDS[name](fake, target)
    return value if name not in UNITS or "nounits" in formats else f"{value} {UNITS[name]}"


def _header(name: str, formats: set[str]) -> str:
    return name if name not in UNITS or "nounits" in formats else f"{name} [{UNITS[name]}]"


def query_gpu(fake: FakeNvml, opts: Options, out: TextIO) -> int:
    fields = [f.strip() for f in opts.values["query-gpu"].split(",") if f.strip()]
    for name in fields:
        if name not in QUERY_FIELDS:
            raise ToolError(
                f'Field "{name}" is not a valid field to query (this simulation knows:'
                f" {', '.join(QUERY_FIELDS)}).",
                EXIT_BAD_ARGUMENT,
            )
    fmt = opts.values.get("format")
    formats = {f.strip() for f in (fmt or "").split(",")}
    if "csv" not in formats or not formats <= {"csv", "noheader", "nounits"}:
        raise _bad(f"--query-gpu needs --format=csv[,noheader][,nounits], got {fmt!r}")
    rows = []
    for target in _targets(fake, opts.values.get("id")):
        _whole_gpu(target, "query the fields")
        try:
            rows.append(", ".join(_value(fake, target, name, formats) for name in fields))
        except pynvml.NVMLError as exc:
            raise _nvml_failure(exc, "query the fields", target) from exc
    if "noheader" not in formats:
        out.write(", ".join(_header(name, formats) for name in fields) + "\n")
    out.writelines(row + "\n" for row in rows)
    return 0


def compute_policy(fake: FakeNvml, argv: Sequence[str], out: TextIO) -> int:
    opts = parse(
        argv,
        {"-i": "id", "--id": "id", "--set-timeslice": "set-timeslice"},
        {"-l": "list", "--list": "list", "-h": "help", "--help": "help"},
        "compute-policy",
    )
    if "help" in opts.flags or not (opts.flags or "set-timeslice" in opts.values):
        out.write(POLICY_USAGE)
        return 0
    if "list" in opts.flags and "set-timeslice" in opts.values:
        raise _bad("-l and --set-timeslice cannot be combined")
    targets = _targets(fake, opts.values.get("id"))
    if "list" in opts.flags:
        for target in targets:
            _whole_gpu(target, "list the compute policies")
            try:
                value = fake.get_timeslice(fake.nvmlDeviceGetHandleByIndex(target.index))
            except pynvml.NVMLError as exc:
                raise _nvml_failure(exc, "list the compute policies", target) from exc
            out.write(f"GPU {target.bus_id}\n    Timeslice{' ' * 26}: {TIMESLICES[value]}\n")
        return 0
    text = opts.values["set-timeslice"]
    if text not in ("0", "1", "2", "3"):
        raise ToolError(
            f"Invalid timeslice value {text!r}; allowed: {ALLOWED_TIMESLICES}", EXIT_BAD_ARGUMENT
        )
    value = int(text)
    for target in targets:
        _whole_gpu(target, "set the timeslice")
        try:
            fake.set_timeslice(fake.nvmlDeviceGetHandleByIndex(target.index), value)
        except pynvml.NVMLError as exc:
            raise _nvml_failure(exc, "set the timeslice", target) from exc
        out.write(f"Set timeslice to {TIMESLICES[value]} for GPU {target.bus_id}.\n")
    out.write("All done.\n")
    return 0


def run(fake: FakeNvml, argv: Sequence[str], out: TextIO) -> int:
    if argv and argv[0] == "compute-policy":
        return compute_policy(fake, argv[1:], out)
    opts = parse(
        argv,
        {
            "-i": "id",
            "--id": "id",
            "-c": "compute-mode",
            "--compute-mode": "compute-mode",
            "--query-gpu": "query-gpu",
            "--format": "format",
        },
        {"-h": "help", "--help": "help"},
        "nvidia-smi",
    )
    if "help" in opts.flags:
        out.write(USAGE)
        return 0
    if "compute-mode" in opts.values and "query-gpu" in opts.values:
        raise _bad("-c and --query-gpu cannot be combined")
    if "compute-mode" in opts.values:
        return set_compute_mode(fake, opts, out)
    if "query-gpu" in opts.values:
        return query_gpu(fake, opts, out)
    raise _bad(
        "this simulation of nvidia-smi only sets (-c) and queries (--query-gpu) the compute"
        " mode and runs compute-policy"
    )


def main(
    argv: Sequence[str],
    *,
    state_dir: str,
    model: str,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """Run ``nvidia-smi argv`` against the simulated node in ``state_dir``; the exit status."""
    try:
        fake = open_simulator(Path(state_dir), model, TOOL, EXIT_NO_DRIVER)
        return run(fake, argv, out)
    except ToolError as exc:
        out.flush()
        err.write(exc.message + "\n")
        return exc.code
