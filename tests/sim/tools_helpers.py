"""Running the stand-in executables of a simulated driver root as real subprocesses."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.sim.driverroot import write_driver_root
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml

TIMEOUT = 60
"""Hang guard for one tool run."""


@dataclass
class SimNode:
    """A simulated node in a temporary directory, with its stand-ins installed."""

    fake: FakeNvml
    state_dir: Path
    driver_root: Path

    @property
    def smi(self) -> Path:
        return self.driver_root / "usr/bin/nvidia-smi"

    @property
    def mps_control(self) -> Path:
        return self.driver_root / "usr/bin/nvidia-cuda-mps-control"


class NodeFactory:
    """Simulated nodes with their stand-ins, one driver root per model (writing one takes most
    of a second: a MIG GPU has 135 capability files) and a fresh state for every node made."""

    def __init__(self, base: Path) -> None:
        self._base = base
        self._roots: dict[str, Path] = {}

    def __call__(self, model: str) -> SimNode:
        base = self._base / model
        state_dir = base / "sim"
        shutil.rmtree(state_dir, ignore_errors=True)
        fake = FakeNvml(load_model(model), state_dir)
        fake.nvmlInit()
        if model not in self._roots:
            self._roots[model] = base / "driver-root"
            write_driver_root(fake.model, self._roots[model], state_dir=state_dir)
        return SimNode(fake, state_dir, self._roots[model])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without CUDA_* variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
    env.update(extra)
    return env


def run(
    tool: Path, *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tool), *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env if env is not None else clean_env(),
        timeout=TIMEOUT,
        check=False,
    )


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``condition`` until it holds (a hang guard, not a timing assumption)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def process_state(pid: int) -> str | None:
    """The process's state letter (``S``, ``R``, ``Z``, ...); None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()[0]


def exited(pid: int) -> bool:
    """The process has ended: gone, or a zombie its parent (not us: the daemon was reparented
    away from the caller) has yet to reap."""
    return process_state(pid) in (None, "Z", "X")


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found
