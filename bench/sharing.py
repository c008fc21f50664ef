"""Sharing and partitioning through the kubelet gRPC socket (a real daemon subprocess per node):

- dynamic MIG: prepare and unprepare of one claim per profile of GPU 0, every profile, on the
  simulated dgx-a100 and dgx-h100 (``--mig-mode dynamic``), next to the simulator's own cost of
  the same change measured in the same run (``MigControl`` create + destroy over the simulated
  NVML, no daemon), so the driver's part is the difference, and the ratio is checked against
  the goal (``MIG_GOAL``: within 2x); in between, the NVML calls the driver itself makes for the
  change (``DynamicMig.ensure`` + ``release``: the lookups that let a crash between steps be
  found again come on top of the bare create + destroy), still without the daemon; the three
  are measured in turn in every round, so load from elsewhere weighs on all of them alike;
- MPS: prepare-to-ready of a claim with an MPS config (NodePrepareResources returns once the
  claim's control daemon answers and has its settings);
- memory shares: 8 claims of 8 GiB on one GPU (``--sharing memory-shares``), prepared by 8
  concurrent calls, by 8 calls in a row and by one call for all 8; total time.

Every claim is unprepared before its daemon stops; MPS control daemons still running under a
state directory afterwards (there should be none) are killed and counted. The benchmark makes
itself the child subreaper of what the daemon starts and reaps exited MPS daemons at once (a node
whose init reaps them promptly); see docs/performance.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from agent.config import Config
from agent.daemon import open_node
from agent.nvml.mig import MigControl
from bench.common import ms, percentile, report, simulated_inventory
from dra_driver.devices import AdvertisedDevice, DevicePolicy, advertised_devices
from dra_driver.kubelet_calls import ClaimRef
from dra_driver.kubelet_client import KubeletClient
from dra_driver.quantity import parse_bytes
from dra_driver.sharing.mig import DynamicMig
from dra_driver.sharing.mps import MpsControl, MpsSettings
from dra_driver.sharing.timeslice import GpuSettings
from dra_driver.sharing.tools import Tools, find_tool, tool_env

DRIVER = "gpu.tessera.dev"
MIG_MODELS = ("dgx-a100", "dgx-h100")
MIG_RUNS = 30
"""Prepare + unprepare pairs per profile (placements taken in turn), after one warm-up pair."""
MIG_GOAL = 2.0
"""Issue 10's goal: prepare + unprepare (p50) within this factor of the simulator's create +
destroy (p50), measured in the same run."""
MPS_MODEL = "dgx-h100"
MPS_RUNS = 30
SHARE_MODEL = "dgx-h100"
SHARES = 8
SHARE_MEMORY = "8Gi"
SHARE_ROUNDS = 5
PR_SET_CHILD_SUBREAPER = 36
OWN: set[int] = set()
"""PIDs of the daemons we started (their Popen reaps them, not the reaper)."""
MPS_CONFIG: dict[str, Any] = {
    "apiVersion": f"{DRIVER}/v1alpha1",
    "kind": "GpuConfig",
    "sharing": {
        "strategy": "MPS",
        "mps": {"activeThreadPercentage": 50, "pinnedMemoryLimit": "8Gi"},
    },
}


# -- claims and the daemon -------------------------------------------------------------------
@dataclass(frozen=True)
class Claim:
    ref: ClaimRef
    device: str
    config: dict[str, Any] | None = None
    memory: str | None = None
    """A memory share: the allocation's consumedCapacity.memory (and a shareID)."""

    def manifest(self, pool: str) -> dict[str, Any]:
        result: dict[str, Any] = {
            "request": "gpu",
            "driver": DRIVER,
            "pool": pool,
            "device": self.device,
        }
        if self.memory is not None:
            result["shareID"] = str(uuid.uuid4())
            result["consumedCapacity"] = {"memory": self.memory}
        config = [] if self.config is None else [
            {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": self.config}}
        ]  # fmt: skip
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": self.ref.name, "namespace": "default", "uid": self.ref.uid},
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}
            },
            "status": {"allocation": {"devices": {"results": [result], "config": config}}},
        }


def claim(name: str, device: str, **kwargs: Any) -> Claim:
    return Claim(ClaimRef("default", name, f"uid-{name}"), device, **kwargs)


class Daemon:
    """``tessera run --simulate MODEL`` in standalone mode with ``claims``, as a subprocess."""

    def __init__(self, tmp: Path, model: str, pool: str, claims: list[Claim], *extra: str) -> None:
        self.state = tmp / f"{model}-{len(list(tmp.iterdir()))}"
        (self.state / "resourceclaims").mkdir(parents=True)
        (self.state / "resourceclaims" / "claims.yaml").write_text(
            yaml.safe_dump_all([c.manifest(pool) for c in claims])
        )
        self.claims = claims
        tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
        self.log = (self.state.parent / f"{self.state.name}.log").open("w")
        self.proc = subprocess.Popen(
            [tessera, "run", "--simulate", model, "--state-dir", str(self.state), "--no-kube",
             "--metrics-address", "127.0.0.1:0", "--log-level", "warning", *extra],
            stdout=subprocess.DEVNULL, stderr=self.log,
        )  # fmt: skip
        OWN.add(self.proc.pid)
        self.socket = self.state / "kubelet" / "plugins" / DRIVER / "dra.sock"
        deadline = time.monotonic() + 60
        while not self.socket.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"daemon did not start; its log: {self.log.name}")
            time.sleep(0.05)

    def stop(self) -> int:
        """Unprepare every claim, stop the daemon, kill MPS daemons left under its state
        directory; how many were left."""
        if self.proc.poll() is None and self.socket.exists():
            with contextlib.suppress(Exception), KubeletClient(self.socket) as k:
                k.unprepare([c.ref for c in self.claims])
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()
        return kill_mps_daemons(self.state)


def kill_mps_daemons(state: Path) -> int:
    """Kill the (simulated) MPS control daemons of the node in ``state``: their executable lives
    in its driver root, so their command line names the state directory."""
    killed = 0
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or ())
        if "nvidia-cuda-mps-control" in cmdline and str(state) in cmdline:
            with contextlib.suppress(psutil.Error):
                p.kill()
                killed += 1
    return killed


@contextlib.contextmanager
def reaping() -> Iterator[None]:
    """Be the child subreaper of what our daemons start, and reap exited orphans (the
    double-forked MPS daemons) at once; our own children are left to their Popen."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    stop = threading.Event()

    def reap() -> None:
        while not stop.wait(0.01):
            while True:  # one syscall when there is nothing to reap
                try:
                    found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    break
                if found is None or found.si_pid in OWN:
                    break
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(found.si_pid, os.WNOHANG)

    thread = threading.Thread(target=reap, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def stat(xs: list[float]) -> dict[str, float]:
    return {"p50_s": percentile(xs, 50), "p99_s": percentile(xs, 99), "runs": len(xs)}


def check(response: dict[str, Any], refs: list[ClaimRef]) -> None:
    errors = {r.uid: response["claims"][r.uid]["error"] for r in refs}
    if any(errors.values()):
        raise RuntimeError(f"a claim failed: {errors}")


# -- dynamic MIG ---------------------------------------------------------------------------------
def mig_placements(model: str) -> tuple[str, dict[str, list[AdvertisedDevice]]]:
    """The node name and GPU 0's placement devices by profile, in advertised order."""
    with simulated_inventory(model) as inv:
        devices = advertised_devices(inv, DevicePolicy(mig_mode="dynamic")).devices
        pool = inv.hostname
    by_profile: dict[str, list[AdvertisedDevice]] = {}
    for d in devices:
        if d.kind == "mig" and d.gpu_minor == 0:
            profile = str(dict(d.attributes)["profile"]["string"])
            by_profile.setdefault(profile, []).append(d)
    return pool, by_profile


def mig_through_daemon(
    tmp: Path, model: str, pool: str, by_profile: dict[str, list[AdvertisedDevice]]
) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, dict[str, dict[str, float]]], int]:
    """Per profile: prepare and unprepare through the daemon, and the simulator's cost of the
    same change without it (``simulator``: ``pair`` the bare create + destroy, ``driver_calls``
    the change made as prepare and unprepare make it). The three are measured in turn within
    each round, so load from elsewhere on the machine weighs on all of them alike."""
    claims = {
        d.name: claim(f"m-{d.name}", d.name) for devices in by_profile.values() for d in devices
    }
    daemon = Daemon(tmp, model, pool, list(claims.values()), "--mig-mode", "dynamic")
    out: dict[str, dict[str, dict[str, float]]] = {}
    raw: dict[str, dict[str, dict[str, float]]] = {}
    try:
        with KubeletClient(daemon.socket) as k, simulator_mig(tmp, model) as (mig, dynamic):
            for profile, devices in by_profile.items():
                t: dict[str, list[float]] = {
                    n: [] for n in ("prepare", "unprepare", "create", "destroy", "calls")
                }
                for i in range(MIG_RUNS + 1):
                    d = devices[i % len(devices)]
                    ref = claims[d.name].ref
                    assert d.mig_profile_id is not None and d.mig_placement_start is not None
                    assert d.mig_placement_size is not None
                    t0 = time.perf_counter()
                    check(k.prepare([ref]), [ref])
                    t1 = time.perf_counter()
                    check(k.unprepare([ref]), [ref])
                    t2 = time.perf_counter()
                    inst = mig.create(
                        0, d.mig_profile_id, d.mig_placement_start, d.mig_placement_size
                    )
                    t3 = time.perf_counter()
                    mig.destroy(0, inst.gpu_instance_id)
                    t4 = time.perf_counter()
                    dynamic.ensure(d)
                    dynamic.release(d.name, 0, d.mig_profile_id, d.mig_placement_start)
                    t5 = time.perf_counter()
                    if i:  # the first round warms up
                        t["prepare"].append(t1 - t0)
                        t["unprepare"].append(t2 - t1)
                        t["create"].append(t3 - t2)
                        t["destroy"].append(t4 - t3)
                        t["calls"].append(t5 - t4)
                pairs = [a + b for a, b in zip(t["prepare"], t["unprepare"], strict=True)]
                out[profile] = {
                    "prepare": stat(t["prepare"]),
                    "unprepare": stat(t["unprepare"]),
                    "pair": stat(pairs),
                }
                bare = [a + b for a, b in zip(t["create"], t["destroy"], strict=True)]
                raw[profile] = {
                    "create": stat(t["create"]),
                    "destroy": stat(t["destroy"]),
                    "pair": stat(bare),
                    "driver_calls": stat(t["calls"]),
                }
    finally:
        left = daemon.stop()
    return out, raw, left


@contextlib.contextmanager
def simulator_mig(tmp: Path, model: str) -> Iterator[tuple[MigControl, DynamicMig]]:
    """MigControl (and the driver's DynamicMig over it) on the simulated NVML of a node of our
    own, no daemon: GPU 0 emptied and in MIG mode first."""
    src = open_node(Config(simulate=model), tmp / f"raw-{model}")
    src.nvml.init()
    try:
        mig = MigControl(src.nvml)
        mig.destroy_all(0)
        mode = mig.mode(0)
        if mode is not None and not mode.current and not mig.set_mode(0, True):
            raise RuntimeError(f"{model}: GPU 0 does not switch MIG mode on without a reset")
        yield mig, DynamicMig(mig, logging.getLogger(__name__))
    finally:
        src.nvml.shutdown()


# -- MPS -------------------------------------------------------------------------------------
def mps_ready(tmp: Path) -> tuple[dict[str, dict[str, float]], int]:
    """Prepare-to-ready and unprepare of one MPS claim through the daemon, each round followed
    by the same tool runs without it (``tools``), so both see the same load."""
    with simulated_inventory(MPS_MODEL) as inv:
        pool = inv.hostname
    c = claim("mps", "gpu-0", config=MPS_CONFIG)
    daemon = Daemon(tmp, MPS_MODEL, pool, [c])
    prep: list[float] = []
    unprep: list[float] = []
    tools: list[float] = []
    try:
        with KubeletClient(daemon.socket) as k, mps_floor(tmp) as floor:
            for i in range(MPS_RUNS + 1):
                t0 = time.perf_counter()
                check(k.prepare([c.ref]), [c.ref])
                t1 = time.perf_counter()
                check(k.unprepare([c.ref]), [c.ref])
                t2 = time.perf_counter()
                tool = floor()
                if i:
                    prep.append(t1 - t0)
                    unprep.append(t2 - t1)
                    tools.append(tool)
    finally:
        left = daemon.stop()
    return {"prepare_to_ready": stat(prep), "unprepare": stat(unprep), "tools": stat(tools)}, left


@contextlib.contextmanager
def mps_floor(tmp: Path, shares: int = 1) -> Iterator[Callable[[], float]]:
    """A function that times what the simulator's tools take for what a prepare of ``shares``
    MPS claims runs, without the daemon: per claim the GPU's compute mode (nvidia-smi) and a
    control daemon started with its settings (nvidia-cuda-mps-control, answered and
    configured); then it stops them all (not timed)."""
    src = open_node(Config(simulate=MPS_MODEL), tmp / f"raw-mps-{shares}")
    src.nvml.init()
    try:
        gpu = src.nvml.devices()[0].uuid
        tools = Tools(
            nvidia_smi=find_tool("nvidia-smi", src.driver_root, None),
            mps_control=find_tool("nvidia-cuda-mps-control", src.driver_root, None),
            env=tool_env(src.driver_root),
        )
        gpus = GpuSettings(tools)
        mps = MpsControl(tools, tmp / f"raw-mps-{shares}" / "mps", logging.getLogger(__name__))
        mode = "DEFAULT" if shares > 1 else "EXCLUSIVE_PROCESS"
        settings = MpsSettings(
            devices=(gpu,),
            active_thread_percentage=50 if shares == 1 else 10,
            pinned_memory_limits={gpu: parse_bytes("8Gi")},
        )

        def once() -> float:
            t0 = time.perf_counter()
            daemons = []
            for n in range(shares):
                gpus.compute_mode(gpu, mode)
                daemons.append(mps.start(f"uid-floor-{n}", settings))
            elapsed = time.perf_counter() - t0
            for d in daemons:
                mps.stop(d)
            gpus.compute_mode(gpu, "DEFAULT")
            return elapsed

        yield once
    finally:
        src.nvml.shutdown()


# -- memory shares ---------------------------------------------------------------------------
def memory_shares(tmp: Path) -> tuple[dict[str, dict[str, float]], int]:
    with simulated_inventory(SHARE_MODEL) as inv:
        pool = inv.hostname
    claims = [claim(f"share-{i}", "gpu-0", memory=SHARE_MEMORY) for i in range(SHARES)]
    refs = [c.ref for c in claims]
    daemon = Daemon(tmp, SHARE_MODEL, pool, claims, "--sharing", "memory-shares")
    totals: dict[str, list[float]] = {
        "concurrent": [],
        "sequential": [],
        "one_call": [],
        "undo": [],
    }
    tools: list[float] = []
    try:
        with (
            KubeletClient(daemon.socket) as k,
            ThreadPoolExecutor(SHARES) as pool_,
            mps_floor(tmp, SHARES) as floor,
        ):
            check(k.prepare(refs[:1]), refs[:1])  # warm up
            check(k.unprepare(refs[:1]), refs[:1])
            floor()
            for _ in range(SHARE_ROUNDS):
                tools.append(floor())  # the same tool runs without the daemon, in each round
                for how in ("concurrent", "sequential", "one_call"):
                    t0 = time.perf_counter()
                    if how == "concurrent":
                        for r in pool_.map(lambda ref: (ref, k.prepare([ref])), refs):
                            check(r[1], [r[0]])
                    elif how == "sequential":
                        for ref in refs:
                            check(k.prepare([ref]), [ref])
                    else:
                        check(k.prepare(refs), refs)
                    totals[how].append(time.perf_counter() - t0)
                    running = mps_daemons(daemon.state)
                    if running != SHARES:
                        raise RuntimeError(f"{running} MPS daemons run for {SHARES} shares")
                    t0 = time.perf_counter()
                    check(k.unprepare(refs), refs)
                    totals["undo"].append(time.perf_counter() - t0)
    finally:
        left = daemon.stop()
    out = {how: stat(xs) for how, xs in totals.items()}
    out["tools"] = stat(tools)
    return out, left


def mps_daemons(state: Path) -> int:
    return sum(
        1
        for p in psutil.process_iter(["cmdline", "status"])
        if p.info["status"] != psutil.STATUS_ZOMBIE
        and "nvidia-cuda-mps-control" in " ".join(p.info["cmdline"] or ())
        and str(state) in " ".join(p.info["cmdline"] or ())
    )


# -- the run ---------------------------------------------------------------------------------
def run() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="tbs-", dir="/tmp"))
    try:
        with reaping():
            _run(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(tmp: Path) -> None:
    data: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_average_before": os.getloadavg()},
        "dynamic_mig": {},
    }
    rows: list[tuple[str, str]] = []
    ratios: list[float] = []
    leftovers = 0
    for model in MIG_MODELS:
        pool, by_profile = mig_placements(model)
        daemon, raw, left = mig_through_daemon(tmp, model, pool, by_profile)
        leftovers += left
        data["dynamic_mig"][model] = {"daemon": daemon, "simulator": raw}
        for profile in by_profile:
            d, r = daemon[profile], raw[profile]
            overhead = d["pair"]["p50_s"] - r["pair"]["p50_s"]
            ratio = d["pair"]["p50_s"] / r["pair"]["p50_s"]
            data["dynamic_mig"][model].setdefault("ratio_p50", {})[profile] = ratio
            ratios.append(ratio)
            rows.append(
                (
                    f"{model} {profile}: prepare / unprepare / simulator create+destroy /"
                    " the driver's NVML calls, p50 (p99)",
                    f"{ms(d['prepare']['p50_s'])} ({ms(d['prepare']['p99_s'])}) / "
                    f"{ms(d['unprepare']['p50_s'])} ({ms(d['unprepare']['p99_s'])}) / "
                    f"{ms(r['pair']['p50_s'])} ({ms(r['pair']['p99_s'])}) / "
                    f"{ms(r['driver_calls']['p50_s'])} ({ms(r['driver_calls']['p99_s'])});"
                    f" driver {ms(overhead)}, {ratio:.1f}x",
                )
            )
    met = sum(r <= MIG_GOAL for r in ratios)
    data["dynamic_mig"]["goal"] = {"factor": MIG_GOAL, "met": met, "profiles": len(ratios)}
    rows.append(
        (
            f"dynamic MIG prepare+unprepare within {MIG_GOAL:g}x of the simulator (p50)",
            f"{met} of {len(ratios)} profiles; ratio {min(ratios):.1f}x to {max(ratios):.1f}x",
        )
    )
    mps, left = mps_ready(tmp)
    leftovers += left
    data["mps"] = mps
    rows.append(
        (
            f"{MPS_MODEL} MPS claim: prepare to ready / unprepare, p50 (p99)",
            f"{ms(mps['prepare_to_ready']['p50_s'])} ({ms(mps['prepare_to_ready']['p99_s'])}) / "
            f"{ms(mps['unprepare']['p50_s'])} ({ms(mps['unprepare']['p99_s'])})",
        )
    )
    rows.append(
        (
            "  the same tool runs without the daemon, p50 (p99)",
            f"{ms(mps['tools']['p50_s'])} ({ms(mps['tools']['p99_s'])})",
        )
    )
    shares, left = memory_shares(tmp)
    leftovers += left
    data["memory_shares"] = {"claims": SHARES, "memory": SHARE_MEMORY, **shares}
    for how, label in (
        ("concurrent", f"{SHARES} concurrent calls"),
        ("sequential", f"{SHARES} calls in a row"),
        ("one_call", f"one call for all {SHARES}"),
        ("undo", f"unprepare all {SHARES} (one call)"),
        ("tools", f"the same tool runs for {SHARES} without the daemon"),
    ):
        s = shares[how]
        rows.append(
            (
                f"{SHARES} x {SHARE_MEMORY} shares of one GPU, {label}: total p50 (max)",
                f"{ms(s['p50_s'])} ({ms(s['p99_s'])}) over {s['runs']} rounds",
            )
        )
    data["leftover_mps_daemons_killed"] = leftovers
    data["machine"]["load_average_after"] = os.getloadavg()
    load = f"{data['machine']['load_average_before'][0]:.1f} / {os.getloadavg()[0]:.1f}"
    rows.append(
        ("machine: CPUs; 1-minute load average before / after", f"{os.cpu_count()}; {load}")
    )
    rows.append(("MPS daemons left running after unprepare, killed", str(leftovers)))
    report("sharing", "Sharing and partitioning through the kubelet socket (bench/sharing.py)",
           rows, data)  # fmt: skip
