"""The simulator's own cost of what a prepare changes, measured bare (no daemon), to be added to a
floor: a MIG instance created and destroyed by ``MigControl`` over the simulated NVML, and an MPS
control daemon started and stopped by the simulator's tools; plus the reaper that MPS daemons
need (they double-fork)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from agent.cli.node_access import open_node
from agent.config import Config
from agent.nvml.mig import MigControl
from dra_driver.device_model import AdvertisedDevice
from dra_driver.quantity import parse_bytes
from dra_driver.sharing.dynamic_mig import DynamicMig
from dra_driver.sharing.mps import MpsControl, MpsSettings
from dra_driver.sharing.node_tools import Tools, find_tool, tool_env
from dra_driver.sharing.timeslice import GpuSettings

PR_SET_CHILD_SUBREAPER = 36
LOG = logging.getLogger("bench.floors")
LOG.addHandler(logging.NullHandler())
LOG.propagate = False


# -- MIG ------------------------------------------------------------------------------------------


@dataclass
class BareMig:
    """``MigControl`` (and the driver's ``DynamicMig`` over it) on a simulated node of our own,
    GPU 0 emptied and in MIG mode."""

    mig: MigControl
    dynamic: DynamicMig

    def create(self, d: AdvertisedDevice) -> tuple[float, int]:
        """Seconds to create the placement ``d`` (GPU instance, compute instance, MIG device),
        and the GPU instance's id."""
        assert d.mig_profile_id is not None and d.mig_placement_start is not None
        assert d.mig_placement_size is not None
        t0 = time.perf_counter()
        inst = self.mig.create(0, d.mig_profile_id, d.mig_placement_start, d.mig_placement_size)
        return time.perf_counter() - t0, inst.gpu_instance_id

    def destroy(self, gpu_instance_id: int) -> float:
        t0 = time.perf_counter()
        self.mig.destroy(0, gpu_instance_id)
        return time.perf_counter() - t0

    def driver_calls(self, d: AdvertisedDevice) -> float:
        """Seconds for the same change made as prepare and unprepare make it
        (``DynamicMig.ensure`` + ``release``: the look-ups that find a crash's leftovers come on
        top of the bare create + destroy)."""
        assert d.mig_profile_id is not None and d.mig_placement_start is not None
        t0 = time.perf_counter()
        self.dynamic.ensure(d)
        self.dynamic.release(d.name, 0, d.mig_profile_id, d.mig_placement_start)
        return time.perf_counter() - t0


@contextlib.contextmanager
def bare_mig(state: Path, model: str) -> Iterator[BareMig]:
    src = open_node(Config.of(simulate=model), state)
    src.nvml.init()
    try:
        mig = MigControl(src.nvml)
        mig.destroy_all(0)
        mode = mig.mode(0)
        if mode is not None and not mode.current and not mig.set_mode(0, True):
            raise RuntimeError(f"{model}: GPU 0 does not switch MIG mode on without a reset")
        yield BareMig(mig, DynamicMig(mig, LOG))
    finally:
        src.nvml.shutdown()


# -- MPS ------------------------------------------------------------------------------------------


@dataclass
class BareMps:
    """What a prepare of ``shares`` MPS claims on GPU 0 runs, without the daemon: per claim the
    GPU's compute mode (nvidia-smi) and a control daemon started with its settings
    (nvidia-cuda-mps-control, answered and configured); and what their unprepare runs."""

    gpus: GpuSettings
    mps: MpsControl
    gpu: str
    shares: int

    def start_stop(self) -> tuple[float, float]:
        """Seconds to start the shares' daemons, and to stop them again (compute mode back)."""
        mode = "DEFAULT" if self.shares > 1 else "EXCLUSIVE_PROCESS"
        settings = MpsSettings(
            devices=(self.gpu,),
            active_thread_percentage=50 if self.shares == 1 else 10,
            pinned_memory_limits={self.gpu: parse_bytes("8Gi")},
        )
        t0 = time.perf_counter()
        daemons = []
        for n in range(self.shares):
            self.gpus.compute_mode(self.gpu, mode)
            daemons.append(self.mps.start(f"uid-floor-{n}", settings))
        t1 = time.perf_counter()
        for d in daemons:
            self.mps.stop(d)
        self.gpus.compute_mode(self.gpu, "DEFAULT")
        return t1 - t0, time.perf_counter() - t1


@contextlib.contextmanager
def bare_mps(state: Path, model: str, shares: int = 1) -> Iterator[BareMps]:
    src = open_node(Config.of(simulate=model), state)
    src.nvml.init()
    try:
        tools = Tools(
            nvidia_smi=find_tool("nvidia-smi", src.driver_root, None),
            mps_control=find_tool("nvidia-cuda-mps-control", src.driver_root, None),
            env=tool_env(src.driver_root),
        )
        yield BareMps(
            GpuSettings(tools),
            MpsControl(tools, state / "mps", LOG),
            src.nvml.devices()[0].uuid,
            shares,
        )
    finally:
        src.nvml.shutdown()


def mps_daemons(state: Path) -> list[psutil.Process]:
    """The (simulated) MPS control daemons of the node in ``state`` still running: their
    executable lives in its driver root, so their command line names the state directory."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(p.info["cmdline"] or ())
        if (
            p.info["status"] != psutil.STATUS_ZOMBIE
            and "nvidia-cuda-mps-control" in cmdline
            and str(state) in cmdline
        ):
            found.append(p)
    return found


def kill_mps_daemons(state: Path) -> int:
    """Kill the MPS control daemons left under ``state``; how many there were."""
    killed = 0
    for p in mps_daemons(state):
        with contextlib.suppress(psutil.Error):
            p.kill()
            killed += 1
    return killed


@dataclass
class Reaper:
    """The child subreaper of what our daemons start: exited orphans (the double-forked MPS
    daemons) are reaped at once, as a node's init would; our own children (``own``) are left to
    their Popen."""

    own: set[int] = field(default_factory=set)

    def started(self, pid: int) -> None:
        self.own.add(pid)

    @contextlib.contextmanager
    def running(self) -> Iterator[Reaper]:
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
                    if found is None or found.si_pid in self.own:
                        break
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(found.si_pid, os.WNOHANG)

        thread = threading.Thread(target=reap, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
