"""``make gpu-check``: the real GPUs against the simulator's model of the same products.

::

    python -m bench.gpu_check [--simulate MODEL] [--reference-specs FILE] [-o text|json]
                              [--save DIR] [--tessera PATH] [--step-timeout SECONDS]

On a GPU node it reads NVML (:mod:`bench.gpu_check.probe`), runs ``tessera discover``,
``tessera slices`` and ``tessera doctor`` (:mod:`bench.gpu_check.steps`), builds the simulated
twin of the node (:mod:`bench.gpu_check.reference`), probes it the same way, and compares: the
NVML facts, and the devices the driver advertises (``agent.node.discover`` and
``dra_driver.device_model.advertised_devices``, static and dynamic MIG, on both sides). It prints
one line per difference: path, real value, simulated value.

Exit codes: 0 no difference; 1 differences (or ``tessera discover``/``slices`` failed on the
node); 2 it cannot run (no NVIDIA driver, ...), or the GPUs' state changed while it ran.

It only reads the real GPUs. Their MIG mode, GPU and compute instances and compute mode are
read before and after; if they differ, the check says so loudly and exits 2.

``--simulate MODEL`` tries it without a GPU: the "real" node is the simulator of ``MODEL`` (its
state shared with the ``tessera`` commands through a temporary state directory), and the
reference is built from ``--reference-specs`` (a copy of ``agent/sim/gpus.yaml``; default the
bundled file), so a changed copy shows what a wrong model looks like.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from agent.cli.node_access import open_node
from agent.config import Config
from agent.discovery.export import inventory_to_dict
from agent.discovery.inventory import NodeInventory
from agent.errors import TesseraError
from agent.node import NodeSource, discover
from agent.nvml.errors import DriverNotFoundError
from agent.sim.specs import GpuSpec, gpu_specs, load_gpu_specs
from bench.gpu_check import steps as step_runner
from bench.gpu_check.compare import Difference, advertised_facts, differences, group_gpus
from bench.gpu_check.probe import Fact, Facts, GpuState, probe, read_state
from bench.gpu_check.reference import (
    Match,
    match_products,
    mirror_state,
    reference_model,
    reference_node,
    sim_indices,
)
from bench.gpu_check.steps import Step
from dra_driver.device_model import DevicePolicy, advertised_devices

EXIT_SAME, EXIT_DIFFERENT, EXIT_CANNOT_RUN = 0, 1, 2
BUDGET_S = 300.0
"""The whole check must finish within this (the steps get what is left, at most their own
timeout each)."""
MIG_MODES = ("static", "dynamic")


class CannotRun(Exception):
    """The check cannot run here; the message says why and what to do."""


def no_driver_message(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return (
        f"no NVIDIA driver: pynvml.nvmlInit failed: {type(cause).__name__}: {cause}; "
        "run on a GPU node (or try it without one: make gpu-check ARGS='--simulate dgx-h100')"
    )


@dataclass
class Report:
    mode: str
    matches: tuple[Match, ...] = ()
    steps: tuple[Step, ...] = ()
    differences: list[Difference] = field(default_factory=list)
    unsimulated: list[Difference] = field(default_factory=list)
    state_changes: list[Difference] = field(default_factory=list)
    gpus_guarded: int = 0
    seconds: float = 0.0
    error: str | None = None
    real: dict[str, Any] = field(default_factory=dict)
    simulated: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, str] = field(default_factory=dict)
    """Outputs to keep with --save: file name -> text."""

    @property
    def exit_code(self) -> int:
        if self.state_changes or self.error is not None:
            return EXIT_CANNOT_RUN
        failed = any(s.failed for s in self.steps)
        return EXIT_DIFFERENT if self.differences or failed else EXIT_SAME

    def json(self) -> dict[str, Any]:
        result = {EXIT_SAME: "same", EXIT_DIFFERENT: "different", EXIT_CANNOT_RUN: "error"}
        return {
            "result": result[self.exit_code],
            "exitCode": self.exit_code,
            "mode": self.mode,
            "error": self.error,
            "gpus": [m.json() for m in self.matches],
            "steps": [s.json() for s in self.steps],
            "gpuStateUnchanged": not self.state_changes,
            "gpuStateChanges": [
                {"path": d.path, "before": d.real, "after": d.simulated} for d in self.state_changes
            ],
            "differences": [d.json() for d in self.differences],
            "notSimulated": [d.json() for d in self.unsimulated],
            "seconds": round(self.seconds, 2),
        }


# -- the two sides --------------------------------------------------------------------------------


def _advertised(inv: NodeInventory, minors: dict[int, int] | None = None) -> Facts:
    facts: Facts = {}
    for mode in MIG_MODES:
        model = advertised_devices(inv, DevicePolicy(mig_mode=mode))
        facts |= advertised_facts(model, f"advertised[{mode}]", minors)
    return facts


def _open_real(simulate: str | None, state_dir: Path) -> NodeSource:
    try:
        source = open_node(Config.of(simulate=simulate), state_dir)
        source.nvml.init()
    except DriverNotFoundError as exc:
        raise CannotRun(no_driver_message(exc)) from exc
    except TesseraError as exc:
        raise CannotRun(str(exc)) from exc
    return source


def _specs(path: Path | None) -> tuple[Mapping[str, GpuSpec], str]:
    if path is None:
        return gpu_specs(), "agent/sim/gpus.yaml"
    try:
        return load_gpu_specs(path), str(path)
    except TesseraError as exc:
        raise CannotRun(str(exc)) from exc


def _simulated_side(
    report: Report,
    real: NodeSource,
    inv: NodeInventory,
    before: tuple[GpuState, ...],
    specs: Mapping[str, GpuSpec],
    source: str,
    cuda: int,
    state_dir: Path,
) -> Facts:
    report.matches = match_products(inv, specs)
    sim_facts: Facts = {}
    try:
        model = reference_model(inv, report.matches, specs, cuda, source)
    except TesseraError as exc:
        raise CannotRun(f"the simulator does not load the real node's twin: {exc}") from exc
    if model is None:
        return sim_facts
    ref = reference_node(model, state_dir, real)
    ref.nvml.init()
    try:
        index_of = sim_indices(model)
        real_index = {m.bus: m.index for m in report.matches}
        labels = {j: f"gpu[{real_index[bus]}]" for bus, j in index_of.items()}
        problems = mirror_state(ref.sim, before, index_of)
        sim_facts = probe(ref.nvml, labels, simulated=True)
        for index, why in problems.items():
            sim_facts[f"gpu[{index}].simulatorState"] = Fact(why)
        ref_inv = discover(ref)
        real_minor = {g.device.pci_bus_id: g.device.minor for g in inv.gpus}
        minors = {g.device.minor: real_minor[g.device.pci_bus_id] for g in ref_inv.gpus}
        sim_facts |= _advertised(ref_inv, minors)
        report.raw["discover-simulated.json"] = json.dumps(inventory_to_dict(ref_inv), indent=2)
    finally:
        ref.nvml.shutdown()
    return sim_facts


def _without_unmatched(real: Facts, matches: Sequence[Match], inv: NodeInventory) -> Facts:
    """The real facts of GPUs the simulator has a product for (the others get one line each)."""
    gone = {m.index for m in matches if m.product is None}
    if not gone:
        return real
    minors = {g.device.minor for g in inv.gpus if g.device.index in gone}
    gpu_prefixes = tuple(f"gpu[{i}]." for i in gone)
    device_marks = tuple(f"[gpu-{m}" for m in minors)
    return {
        p: f
        for p, f in real.items()
        if not p.startswith(gpu_prefixes)
        and not any(f"{mark}-" in p or f"{mark}]" in p for mark in device_marks)
    }


def _guard(before: tuple[GpuState, ...], after: tuple[GpuState, ...]) -> list[Difference]:
    """What changed on the real GPUs while the check ran (path, before, after)."""
    old: Facts = {}
    new: Facts = {}
    for s in before:
        old |= s.facts(f"gpu[{s.index}]")
    for s in after:
        new |= s.facts(f"gpu[{s.index}]")
    found, _ = differences(old, new)
    return found


def run_check(
    *,
    simulate: str | None,
    reference_specs: Path | None,
    tessera: str | None,
    step_timeout: float,
) -> Report:
    started = time.monotonic()
    report = Report(mode=f"simulate {simulate}" if simulate else "real GPUs")
    specs, source = _specs(reference_specs)
    with tempfile.TemporaryDirectory(prefix="tessera-gpu-check-") as tmp:
        real_dir, ref_dir = Path(tmp) / "node", Path(tmp) / "reference"
        real = _open_real(simulate, real_dir)
        before = read_state(real.nvml)
        report.gpus_guarded = len(before)
        failure: BaseException | None = None
        try:
            real_facts = probe(real.nvml, simulated=bool(simulate))
            inv = discover(real)
            real_facts |= _advertised(inv)
            report.raw["discover-real.json"] = json.dumps(inventory_to_dict(inv), indent=2)
            extra = ["--simulate", simulate, "--state-dir", str(real_dir)] if simulate else []
            budget = BUDGET_S - (time.monotonic() - started)
            timeout = max(1.0, min(step_timeout, budget / 4))
            report.steps = step_runner.run_steps(
                step_runner.tessera_command(tessera), extra, timeout
            )
            cuda = real_facts["system.cudaDriverVersion"].value
            sim_facts = _simulated_side(
                report,
                real,
                inv,
                before,
                specs,
                source,
                cuda if isinstance(cuda, int) else 0,
                ref_dir,
            )
            real_facts = _without_unmatched(real_facts, report.matches, inv)
            found, unsimulated = differences(real_facts, sim_facts)
            unmatched = [
                Difference(
                    f"gpu[{m.index}].product",
                    f"{m.name} (PCI device id 0x{m.pci_device_id:08X})",
                    f"<none in {source}>",
                )
                for m in report.matches
                if m.product is None
            ]
            report.differences, report.unsimulated = group_gpus(unmatched) + found, unsimulated
            report.real = {p: f.value for p, f in real_facts.items()}
            report.simulated = {p: f.value for p, f in sim_facts.items()}
        except BaseException as exc:
            failure = exc
        finally:
            try:
                report.state_changes = _guard(before, read_state(real.nvml))
            finally:
                real.nvml.shutdown()
        report.seconds = time.monotonic() - started
        if report.state_changes:
            if failure is not None:
                report.error = f"the check failed too: {type(failure).__name__}: {failure}"
            return report
        if failure is not None:
            raise failure
    for step in report.steps:
        if step.stdout:
            report.raw[f"{step.argv[1] if len(step.argv) > 1 else 'tessera'}.out"] = step.stdout
    return report


# -- output ---------------------------------------------------------------------------------------


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def render_text(report: Report, out: IO[str]) -> None:
    w = out.write
    w(
        f"gpu-check ({report.mode}): the GPUs' NVML facts and advertised devices against the"
        " simulator's model of the same products\n"
    )
    for m in report.matches:
        product = m.product or "NO SIMULATOR PRODUCT"
        models = f"; node models with it: {', '.join(m.models)}" if m.models else ""
        w(f"  gpu[{m.index}] {m.name} (0x{m.pci_device_id:08X}) at {m.bus} -> {product}{models}\n")
    w("steps:\n")
    for s in report.steps:
        note = f": {s.detail}" if s.detail else ""
        w(f"  {s.status:<9} {s.name} ({s.seconds:.1f} s){note}\n")
    if report.state_changes:
        w(
            "\n!!! THE GPU STATE CHANGED WHILE gpu-check RAN (it only reads; something else changed"
            " it, or a tessera command did) !!!\n"
        )
        for d in report.state_changes:
            w(f"  {d.path}: before {_show(d.real)}, after {_show(d.simulated)}\n")
        w(
            "Put the GPUs back as they were (nvidia-smi -mig / mig -dci -dgi / -c) and find out"
            " what changed them before trusting any result.\n"
        )
    else:
        w(
            f"GPU state (MIG mode, GPU/compute instances, compute mode of {report.gpus_guarded}"
            " GPUs): the same before and after\n"
        )
    if report.error:
        w(f"error: {report.error}\n")
    if report.differences:
        w(f"differences ({len(report.differences)}): path  real=...  simulated=...\n")
        for d in report.differences:
            w(f"  {d.path}  real={_show(d.real)}  simulated={_show(d.simulated)}\n")
    if report.unsimulated:
        w(
            f"not simulated ({len(report.unsimulated)}; the simulator lacks the call,"
            " not counted):\n"
        )
        for d in report.unsimulated:
            w(f"  {d.path}  real={_show(d.real)}\n")
    verdict = {
        EXIT_SAME: "no difference",
        EXIT_DIFFERENT: f"{len(report.differences)} difference(s)"
        + (", a tessera step failed" if any(s.failed for s in report.steps) else ""),
        EXIT_CANNOT_RUN: "GPU STATE CHANGED" if report.state_changes else "error",
    }[report.exit_code]
    w(f"result: {verdict} (exit {report.exit_code}, {report.seconds:.1f} s)\n")


def save(report: Report, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps(report.json(), indent=2) + "\n")
    (directory / "facts-real.json").write_text(json.dumps(report.real, indent=2) + "\n")
    (directory / "facts-simulated.json").write_text(json.dumps(report.simulated, indent=2) + "\n")
    for name, text in report.raw.items():
        (directory / name).write_text(text if text.endswith("\n") else text + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="make gpu-check",
        description="Compare this node's NVIDIA GPUs with the simulator's model of them.",
    )
    parser.add_argument(
        "--simulate",
        metavar="MODEL",
        help="no GPU: the 'real' node is the simulator of MODEL (tessera sim models)",
    )
    parser.add_argument(
        "--reference-specs",
        type=Path,
        metavar="FILE",
        help="the GPU product file the simulated twin loads (default: agent/sim/gpus.yaml)",
    )
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text")
    parser.add_argument(
        "--save", type=Path, metavar="DIR", help="also write the report, facts and outputs here"
    )
    parser.add_argument("--tessera", metavar="PATH", help="the tessera command to run")
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="limit per tessera command (default 60; the whole check stays under 5 minutes)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    args = parse_args(argv)
    try:
        report = run_check(
            simulate=args.simulate,
            reference_specs=args.reference_specs,
            tessera=args.tessera,
            step_timeout=args.step_timeout,
        )
    except CannotRun as exc:
        if args.output == "json":
            body = {"result": "error", "exitCode": EXIT_CANNOT_RUN, "error": str(exc)}
            out.write(json.dumps(body, indent=2) + "\n")
        sys.stderr.write(f"gpu-check: cannot run: {exc}\n")
        return EXIT_CANNOT_RUN
    except Exception as exc:
        # a crash is no verdict: Python's own exit code for it (1) would read as "different"
        traceback.print_exc()
        sys.stderr.write(
            f"gpu-check: cannot run: it failed: {type(exc).__name__}: {exc} (a bug in gpu-check:"
            " report it with the traceback above)\n"
        )
        return EXIT_CANNOT_RUN
    if args.save is not None:
        save(report, args.save)
    if args.output == "json":
        out.write(json.dumps(report.json(), indent=2) + "\n")
    else:
        render_text(report, out)
    if report.state_changes:
        sys.stderr.write("gpu-check: THE GPU STATE CHANGED WHILE IT RAN; see the report\n")
    return report.exit_code
