"""The crash matrix: the agent killed (SIGKILL, ``--sim-crash-at``) at every crash point of
prepare and unprepare, in every mode a claim can be prepared in, for one claim alone and inside
a batch of claims, then restarted and called again as the kubelet would; the node must be
consistent after every step and empty at the end (tests/crashnode.py says what that means).

One *cell* is (mode, crash point, shape): a real `tessera run --simulate` with the point armed
gets one NodePrepareResources call with the shape's claims, then one NodeUnprepareResources call
with the same claims. The point fires in one of them or in neither:

- it fired (the daemon died with -9): the daemon is started again unarmed, the node checked, the
  same call made again (the kubelet's retry) and checked, and the rest of the cell goes on;
- it did not fire: the point must be one the mode never reaches (``Mode.unreachable``); a point
  listed there that fires fails the cell as much as a reachable one that does not.

A batch arms ``POINT:2`` (the second time the process reaches the point: a crash with one
claim of the call past the point and others not yet, or on the way). A point the batch reaches
only once (a step the claims of a call share, as a group commit makes) is armed again as
``POINT`` in a fresh node; the cell says so. Points a mode never reaches are checked with the
batch only (it takes every path the single claim takes), armed as ``POINT``.

The points come from ``dra_driver.kubeletplugin.crash_points.CRASH_POINTS`` (and a list
``sharing.effects`` may
export), so a new point is in the matrix without an edit here: it is expected to fire in every
mode until it is listed as unreachable for some.

``python -m tests.crashmatrix`` prints the matrix of the last run (docs/reliability.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dra_driver.kubeletplugin.effects as effects_module
from agent.errors import DecodeError
from agent.usage.counters import decode as decode_usage
from dra_driver.errors import KubeletApiError
from dra_driver.kubeletplugin.crash_points import CRASH_POINTS
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.crashnode import MigLayout, leftovers, load_checkpoint, mig_layout, node_violations
from tests.crashnode_vm import gpu_drivers
from tests.integration.daemon import Daemon, claim_manifest, write_claims
from tests.integration.test_sharing import sharing_config
from tests.reliability.report import results_dir
from tests.sim.tools_helpers import wait_for
from tests.simnode import node_model, reap_mps_daemons

POINTS: tuple[str, ...] = tuple(
    dict.fromkeys([*CRASH_POINTS, *getattr(effects_module, "CRASH_POINTS", ())])
)
"""Every crash point of prepare and unprepare, in the order the code names them."""

MIG_STEPS = frozenset({"after-gi-create", "after-ci-create"})
"""Reached only while a dynamic MIG device is created."""
TIMESLICE_STEPS = frozenset({"after-compute-policy"})
"""Reached only while a GPU's time-slice is set."""
MPS_STEPS = frozenset({"after-mps-start"})
"""Reached only when a claim's MPS daemon is started (MPS and memory shares)."""
POWER_STEPS = frozenset({"after-power-recorded", "after-power-limit"})
"""Reached only when a claim caps a GPU's power (``powerLimit``)."""
VFIO_STEPS = frozenset({"after-vfio-unbind", "after-vfio-bind", "after-unprepare-vfio-unbind"})
"""Reached only when a whole GPU is handed to a virtual machine (``--virtualization
passthrough``): each function of its IOMMU group unbound, then bound to vfio-pci; at unprepare
unbound from vfio-pci, then bound to the driver it had."""
VGPU_STEPS = frozenset({"after-vgpu-create"})
"""Reached only when a vGPU is made (``--virtualization vgpu``): a VF given its type, or an
mdev created."""
VM_STEPS = VFIO_STEPS | VGPU_STEPS
"""Reached only when a GPU is handed to a virtual machine (``--virtualization``)."""
CONTAINER_STEPS = POWER_STEPS | MIG_STEPS | TIMESLICE_STEPS | MPS_STEPS
"""What a VM device never reaches: it is made by the VM steps alone."""

BATCH_OCCURRENCE = 2
"""A batch crashes the second time its point is reached."""
SHAPES = ("single", "batch")


@dataclass(frozen=True)
class Claim:
    name: str
    devices: tuple[str, ...]
    config: dict[str, Any] | None = None
    """The claim's opaque config (``sharing_config``)."""
    memory: str | None = None
    """A memory share: the memory each device result consumes."""

    @property
    def uid(self) -> str:
        return f"uid-{self.name}"

    def ref(self) -> ClaimRef:
        return ClaimRef("default", self.name, self.uid)

    def manifest(self, pool: str) -> dict[str, Any]:
        obj = claim_manifest(
            self.name,
            self.uid,
            [("gpu", d) for d in self.devices],
            pool,
            config=[self.config] if self.config else None,
        )
        if self.memory is not None:
            for result in obj["status"]["allocation"]["devices"]["results"]:
                result["consumedCapacity"] = {"memory": self.memory}
        return obj


@dataclass(frozen=True)
class Mode:
    name: str
    model: str
    flags: tuple[str, ...]
    single: tuple[Claim, ...]
    batch: tuple[Claim, ...]
    unreachable: frozenset[str]
    """The points this mode's prepare and unprepare never reach."""

    def claims(self, shape: str) -> tuple[Claim, ...]:
        return self.single if shape == "single" else self.batch


def _slice(interval: str) -> dict[str, Any]:
    return sharing_config("GpuConfig", "TimeSlicing", interval=interval)


def _mps(**fields: Any) -> dict[str, Any]:
    return sharing_config("GpuConfig", "MPS", **fields)


def _power(limit: str) -> dict[str, Any]:
    config = sharing_config("GpuConfig", "Exclusive")
    config["opaque"]["parameters"] = {
        "apiVersion": config["opaque"]["parameters"]["apiVersion"],
        "kind": "GpuConfig",
        "powerLimit": limit,
    }
    return config


MODES = (
    Mode(
        "whole-gpu",
        "dgx-h100",
        (),
        single=(Claim("w0", ("gpu-0",)),),
        batch=(Claim("w1", ("gpu-1",)), Claim("w2", ("gpu-2", "gpu-3")), Claim("w4", ("gpu-4",))),
        unreachable=POWER_STEPS | MIG_STEPS | TIMESLICE_STEPS | MPS_STEPS | VM_STEPS,
    ),
    Mode(
        "static-mig",
        "dgx-a100",  # MIG on, the balanced layout: the node's MIG devices are never touched
        ("--mig-mode", "static"),
        single=(Claim("s0", ("gpu-0-mig-1g5gb-19-2",)),),
        batch=(
            Claim("s1", ("gpu-0-mig-1g5gb-19-3",)),
            Claim("s2", ("gpu-0-mig-2g10gb-14-0",)),
            Claim("s3", ("gpu-1-mig-3g20gb-9-4", "gpu-2-mig-3g20gb-9-4")),
        ),
        unreachable=POWER_STEPS | MIG_STEPS | TIMESLICE_STEPS | MPS_STEPS | VM_STEPS,
    ),
    Mode(
        "dynamic-mig",
        "dgx-h100",  # Hopper: MIG mode switches on at the first placement, no reset
        ("--mig-mode", "dynamic"),
        single=(Claim("d0", ("gpu-0-mig-1g10gb-19-0",)),),
        batch=(
            Claim("d1", ("gpu-0-mig-1g10gb-19-0",)),
            Claim("d2", ("gpu-0-mig-2g20gb-14-2",)),
            Claim("d3", ("gpu-1-mig-3g40gb-9-4",)),
            Claim("d4", ("gpu-2",)),  # a whole GPU in dynamic mode: freed of MIG, nothing made
        ),
        unreachable=POWER_STEPS | TIMESLICE_STEPS | MPS_STEPS | VM_STEPS,
    ),
    Mode(
        "time-slicing",
        "dgx-h100",
        ("--sharing", "time-slicing"),
        single=(Claim("t0", ("gpu-0",), _slice("Long")),),
        batch=(
            Claim("t1", ("gpu-2",), _slice("Long")),
            Claim("t2", ("gpu-2",), _slice("Long")),  # two claims take turns on one GPU
            Claim("t3", ("gpu-3",), _slice("Medium")),
        ),
        unreachable=POWER_STEPS | MIG_STEPS | MPS_STEPS | VM_STEPS,
    ),
    Mode(
        "mps",
        "dgx-h100",
        (),
        single=(Claim("m0", ("gpu-4",), _mps()),),
        batch=(
            Claim("m1", ("gpu-5",), _mps(activeThreadPercentage=50)),
            Claim("m2", ("gpu-6",), _mps(pinnedMemoryLimit="4Gi")),
            Claim("m3", ("gpu-7",), _mps()),
        ),
        unreachable=POWER_STEPS | MIG_STEPS | TIMESLICE_STEPS | VM_STEPS,
    ),
    Mode(
        "memory-share",
        "dgx-h100",
        ("--sharing", "memory-shares", "--memory-share-min", "10Gi"),
        single=(Claim("q0", ("gpu-6",), memory="20Gi"),),
        batch=tuple(Claim(f"q{i}", ("gpu-7",), memory="20Gi") for i in (1, 2, 3)),
        # each share has its own MPS daemon
        unreachable=POWER_STEPS | MIG_STEPS | TIMESLICE_STEPS | VM_STEPS,
    ),
    Mode(
        "power-limit",
        "dgx-h100",
        (),
        single=(Claim("p0", ("gpu-0",), _power("350W")),),
        batch=(
            Claim("p1", ("gpu-1",), _power("300W")),
            Claim("p2", ("gpu-2", "gpu-3"), _power("0.5kW")),  # two GPUs, one cap
            Claim("p4", ("gpu-4",)),  # no cap: its GPU keeps its own limit
        ),
        unreachable=MIG_STEPS | TIMESLICE_STEPS | MPS_STEPS | VM_STEPS,
    ),
    Mode(
        "passthrough",
        "dgx-h100",  # every GPU in its own IOMMU group, vfio-pci loaded
        ("--virtualization", "passthrough"),
        single=(Claim("v0", ("gpu-0-vfio",)),),
        batch=(
            Claim("v1", ("gpu-1-vfio",)),
            Claim("v2", ("gpu-2-vfio", "gpu-3-vfio")),  # one VM, two GPUs
            Claim("v4", ("gpu-4-vfio",)),
        ),
        unreachable=CONTAINER_STEPS | VGPU_STEPS,
    ),
    Mode(
        "vgpu-vf",
        "vgpu-h200",  # SR-IOV: a vGPU is a VF given its type (nvidia/current_vgpu_type)
        ("--virtualization", "vgpu"),
        single=(Claim("f0", ("gpu-0-vgpu-1431-0",)),),
        batch=(
            Claim("f1", ("gpu-0-vgpu-1431-0",)),
            Claim("f2", ("gpu-0-vgpu-1431-1", "gpu-1-vgpu-1430-0")),  # two GPUs, two types
            Claim("f3", ("gpu-1-vgpu-1430-1",)),
        ),
        unreachable=CONTAINER_STEPS | VFIO_STEPS,
    ),
    Mode(
        "vgpu-mdev",
        "vgpu-t4",  # mediated devices made on the GPU itself (mdev_supported_types)
        ("--virtualization", "vgpu"),
        single=(Claim("e0", ("gpu-0-vgpu-230-0",)),),
        batch=(
            Claim("e1", ("gpu-0-vgpu-230-0",)),
            Claim("e2", ("gpu-0-vgpu-230-1", "gpu-1-vgpu-231-0")),  # two GPUs, two types
            Claim("e3", ("gpu-1-vgpu-231-1",)),
        ),
        unreachable=CONTAINER_STEPS | VFIO_STEPS,
    ),
)
BY_NAME = {m.name: m for m in MODES}


def cells() -> list[tuple[str, str, str]]:
    """Every (mode, point, shape) the matrix runs: each point a mode reaches, alone and in a
    batch; each point it never reaches, in a batch (the single claim's paths are the batch's)."""
    return [
        (m.name, point, shape)
        for m in MODES
        for point in POINTS
        for shape in SHAPES
        if point not in m.unreachable or shape == "batch"
    ]


@dataclass
class Outcome:
    """What one cell did."""

    mode: str
    point: str
    shape: str
    armed: list[str] = field(default_factory=list)
    """Each ``--sim-crash-at`` value a daemon was started with."""
    fired_in: str | None = None
    """``prepare`` or ``unprepare``: the call the daemon died under; None: not reached."""
    once_per_call: bool = False
    """The batch reached the point only once (armed again as ``POINT``)."""
    crashes: int = 0
    drivers_at_crash: dict[str, str | None] = field(default_factory=dict)
    """The driver each GPU was bound to as the daemon died (None: unbound), read from the
    simulated sysfs before the restart repaired anything."""
    lost: list[str] = field(default_factory=list)
    """Broken invariants: anything leaked, held twice, or a checkpoint that does not decode."""
    failures: list[str] = field(default_factory=list)
    """Everything else that went wrong: a retry refused, an exit code, reachability."""

    @property
    def verdict(self) -> str:
        if self.fired_in is None:
            return "not reachable"
        return f"fired in {self.fired_in}" + (" (once per call)" if self.once_per_call else "")

    @property
    def problems(self) -> list[str]:
        return [*self.failures, *self.lost]


def run_cell(tmp: Path, mode: Mode, point: str, shape: str) -> Outcome:
    """Run one cell of the matrix in directory ``tmp`` (see the module docstring)."""
    out = Outcome(mode.name, point, shape)
    unreachable = point in mode.unreachable
    occurrence = BATCH_OCCURRENCE if shape == "batch" and not unreachable else 1
    passes = _run(tmp / "node", mode, mode.claims(shape), point, occurrence, out)
    if out.fired_in is None and not unreachable and 0 < passes < occurrence:
        out.once_per_call = True  # a step the claims of a call share: crash at its one pass
        _run(tmp / "node-once", mode, mode.claims(shape), point, 1, out)
    if out.fired_in is None and not unreachable:
        out.failures.append(
            f"{point} never fired in {mode.name} ({shape}; passed {passes} times): a point the"
            " mode reaches, or list it in the mode's unreachable points"
        )
    if out.fired_in is not None and unreachable:
        out.failures.append(
            f"{point} fired in {out.fired_in} in {mode.name} but is listed as unreachable there"
        )
    return out


def _call(d: Daemon, op: str, refs: list[ClaimRef]) -> dict[str, Any] | None:
    """One kubelet call; None when the daemon died under it."""
    try:
        with KubeletClient(d.dra_socket, timeout=60) as k:
            answer: dict[str, Any] = (k.prepare if op == "prepare" else k.unprepare)(refs)
            return answer["claims"]  # type: ignore[no-any-return]
    except KubeletApiError:
        assert d.proc is not None
        try:
            d.proc.wait(timeout=30)  # the socket closes as the process dies: let it finish
        except subprocess.TimeoutExpired:
            raise AssertionError("the call failed and the daemon still runs") from None
        return None


def _passes(d: Daemon, point: str) -> int:
    return sum(
        1
        for r in list(d.logs)
        if r.get("msg") == "passed a crash point" and r.get("point") == point
    )


def _run(
    state: Path, mode: Mode, claims: tuple[Claim, ...], point: str, occurrence: int, out: Outcome
) -> int:
    """One node: start armed, prepare, unprepare, restarting and retrying after a crash; adds
    to ``out``; returns how many times the armed daemon passed the point without firing."""
    arm = point if occurrence == 1 else f"{point}:{occurrence}"
    out.armed.append(arm)
    d = Daemon(state, mode.model, *mode.flags)
    write_claims(d.state, *(c.manifest(mode.model) for c in claims))
    refs = [c.ref() for c in claims]
    passes = 0
    started = time.time()
    try:
        d.start("--sim-crash-at", arm)
        baseline = mig_layout(d)
        _check(out, d, baseline, "at the first start")
        for op in ("prepare", "unprepare"):
            answer = _call(d, op, refs)
            if answer is None:
                passes += _passes(d, point)
                code = d.wait_exit()
                if code != -9:
                    out.failures.append(f"the daemon died under {op} with {code}, not -9")
                out.fired_in, out.crashes = op, out.crashes + 1
                out.drivers_at_crash = gpu_drivers(d)
                out.failures += _lost_bystanders(d, claims)
                d.start()  # unarmed: the kubelet's plugin is back
                _check(out, d, baseline, f"after the crash in {op} and the restart")
                answer = _call(d, op, refs)  # the kubelet retries the same claims
                if answer is None:
                    raise AssertionError(f"the unarmed daemon died under the retry of {op}")
                what = f"after the retried {op}"
            else:
                what = f"after {op}"
            errors = {uid: r["error"] for uid, r in answer.items() if r.get("error")}
            if errors or set(answer) != {r.uid for r in refs}:
                out.failures.append(f"{what}: answers {answer}")
            if op == "prepare":
                out.failures += _answers_match_checkpoint(d, answer)
                _counted(d, [r.uid for r in refs])  # held across a tick: the ledger counts them
            if op == "unprepare":
                _counted(d, [r.uid for r in refs], released=True)
            _check(out, d, baseline, what)
        passes += _passes(d, point)
        out.lost += [f"at the end: {p}" for p in leftovers(d, baseline)]
        code = d.stop()
        out.failures += _lost_bystanders(d, claims)
        if code != 0:
            out.failures.append(f"the daemon stopped with {code}, not 0")
        out.lost += usage_violations(d, started)
    finally:
        d.kill()
        reap_mps_daemons(d.state / "sim", d.model)
    return passes


def _lost_bystanders(d: Daemon, claims: tuple[Claim, ...]) -> list[str]:
    """A GPU no claim of the cell hands to a VM that the daemon (its logs since its start)
    reported lost: a GPU that left NVML (a VM's) shifts the NVML indexes of the others, and a
    reader that kept the old ones reads the wrong GPU, or none."""
    vm_minors = {
        int(name.split("-")[1]) for c in claims for name in c.devices if name.endswith("-vfio")
    }
    bystanders = {g.uuid: g.index for g in node_model(d.model).gpus if g.index not in vm_minors}
    lost = sorted(
        {
            bystanders[r["uuid"]]
            for r in list(d.logs)
            if r.get("msg") == "GPU health changed"
            and r.get("healthy") is False
            and r.get("uuid") in bystanders
        }
    )
    return [f"GPU {i} (no VM's) reported unhealthy: {_health_log(d, i)}" for i in lost]


def _health_log(d: Daemon, minor: int) -> str:
    uuid = node_model(d.model).gpus[minor].uuid
    found = [r for r in list(d.logs) if r.get("uuid") == uuid and r.get("level") == "warning"]
    return "; ".join(f"{r.get('msg')}: {r.get('error') or r.get('cause')}" for r in found[:2])


def _counted(d: Daemon, uids: list[str], *, released: bool = False) -> None:
    """Wait until the usage ledger lists every claim as held (``released``: as released). The
    ledger is written when a holding comes or goes, at the next sampler tick; waiting for it
    makes the unprepare, and a crash in it, meet counted claims, and the stop a ledger that saw
    them go."""
    path = d.state / "usage.json"

    def seen() -> bool:
        try:
            holdings = json.loads(path.read_text())["holdings"]
        except (FileNotFoundError, ValueError):
            return False
        state = {h["uid"]: h["releasedAt"] is not None for h in holdings}
        return all(state.get(uid) == released for uid in uids)

    what = "released" if released else "held"
    try:
        wait_for(seen, f"the claims {what} in the usage ledger", timeout=30.0)
    except AssertionError as exc:  # what the ledger and the daemon said, to find out why
        try:
            ledger = path.read_text()[:2000]
        except OSError as read:
            ledger = f"unreadable: {read}"
        said = [r for r in list(d.logs) if r.get("level") in ("warning", "error")][-10:]
        raise AssertionError(f"{exc}; the ledger: {ledger}; the daemon's warnings: {said}") from exc


def usage_violations(d: Daemon, started: float) -> list[str]:
    """The usage ledger after a cell (every claim unprepared, the daemon stopped): it decodes,
    every holding in it is released, and none was counted for longer than the cell ran (a
    second counted twice across the crash would show as more), allowing one sampling interval
    for the interval a device is first counted in."""
    path = d.state / "usage.json"
    if not path.exists():
        return []  # no tick saw a claim held, nor any tick at all: nothing to count
    try:
        _, through, _, counters = decode_usage(path.read_bytes())
    except (DecodeError, ValueError) as exc:
        return [f"the usage ledger does not decode: {exc}"]
    out = []
    ran = (through or started) - started + 1.0
    for key, c in sorted(counters.items()):
        if c.released_at is None:
            out.append(f"usage ledger: {key} still held after everything was unprepared")
        if c.allocated_gpu_seconds > c.weight * ran + 1e-6:
            out.append(
                f"usage ledger: {key} counted {c.allocated_gpu_seconds:.3f} GPU-seconds at weight"
                f" {c.weight:.3f} in a cell of {ran:.3f} s: counted twice"
            )
    return out


def _check(out: Outcome, d: Daemon, baseline: MigLayout, when: str) -> None:
    out.lost += [f"{when}: {p}" for p in node_violations(d, baseline)]


def _answers_match_checkpoint(d: Daemon, answer: dict[str, Any]) -> list[str]:
    """Each prepared claim got the devices its record holds (the same ones however often the
    kubelet asked)."""
    claims = load_checkpoint(d).claims
    out = []
    for uid, result in sorted(answer.items()):
        entry = claims.get(uid)
        if entry is None:
            out.append(f"{uid} was answered as prepared but is not in the checkpoint")
            continue
        got = [(x["deviceName"], tuple(x["cdiDeviceIds"])) for x in result.get("devices", [])]
        held = [(x.device, x.cdi_device_ids) for x in entry.devices]
        if got != held:
            out.append(f"{uid} was answered {got}, its record holds {held}")
    return out


# -- the last run's matrix ---------------------------------------------------------------------


def cells_dir() -> Path:
    return results_dir() / "crash-matrix-cells"


def save_cell(out: Outcome) -> None:
    """Keep the cell's verdict for ``python -m tests.crashmatrix``."""
    cells_dir().mkdir(parents=True, exist_ok=True)
    path = cells_dir() / f"{out.mode}.{out.point}.{out.shape}.json"
    record = {
        "mode": out.mode,
        "point": out.point,
        "shape": out.shape,
        "verdict": out.verdict,
        "armed": out.armed,
        "problems": out.problems,
    }
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def matrix(records: list[dict[str, Any]]) -> list[str]:
    """The matrix as a Markdown table: a row per point, a column per mode; each cell says how
    the single claim and the batch fared."""
    by_cell = {(r["mode"], r["point"], r["shape"]): r for r in records}
    short = {"fired in prepare": "P", "fired in unprepare": "U", "not reachable": "-"}
    lines = [
        "| point | " + " | ".join(m.name for m in MODES) + " |",
        "|---|" + "---|" * len(MODES),
    ]
    for point in POINTS:
        row = []
        for m in MODES:
            shown = []
            for shape in SHAPES:
                r = by_cell.get((m.name, point, shape))
                if r is None:
                    continue
                verdict = str(r["verdict"])
                mark = short.get(verdict.removesuffix(" (once per call)"), "?")
                mark += "1" if verdict.endswith("(once per call)") else ""
                mark += "!" if r["problems"] else ""
                shown.append(f"{shape} {mark}")
            row.append(", ".join(shown) or "(not run)")
        lines.append(f"| `{point}` | " + " | ".join(row) + " |")
    return lines


def main() -> int:
    records = [json.loads(p.read_text()) for p in sorted(cells_dir().glob("*.json"))]
    if not records:
        print(f"no crash-matrix cells in {cells_dir()}: run tests/reliability/test_crash_matrix.py")
        return 1
    print("\n".join(matrix(records)))
    print(
        "\nP: fired in prepare, U: fired in unprepare (restarted, retried, checked), -: not"
        " reachable in the mode (verified: armed, never fired); 1: the batch reaches it once"
        " per call; !: a problem (see the cell's record)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
