"""Cold start: from exec of ``tessera run --simulate dgx-h100 --no-kube`` to its registration
socket answering ``GetInfo`` (what the kubelet waits for), next to the import floor measured in
the same run, in turn with every start: a fresh interpreter importing exactly the modules the
agent had imported when it answered, and nothing else.

The module set is found in the same run, from the agent itself: one start under
``python -X importtime`` (every import is logged to stderr as it completes), stopped with SIGSTOP
the moment ``GetInfo`` answers, so the log holds what was imported up to then and nothing after.
The floor then runs ``python -c`` importing those modules in the logged order and writes one byte
to a pipe; it is timed from exec to that byte (not to its exit), as the agent is timed from exec
to the answer. Both run with bytecode written once before (as pip compiles an installed package),
whatever ``PYTHONDONTWRITEBYTECODE`` says.

Two kinds of start: a restart (the state directory and the simulated node's files exist, as after
a pod restart, and as on a real node, whose ``/sys`` and driver exist before the agent): the goal
is issue 25's, at most the floor + 0.2 s (issue 15 had 0.3 s); and a first start on an empty
state directory, where the simulator first writes its node (sysfs tree, driver root): reported
without a goal."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import DRIVER, report, scratch, terminate, tessera
from bench.table import Figure, floor_plus, measured
from dra_driver.errors import KubeletApiError
from dra_driver.testkubelet.client import KubeletClient

NAME = "coldstart"
MODEL = "dgx-h100"
MARGIN_S = 0.2
POLL_S = 0.002
IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|( *)(\S+)\s*$")
FLOOR_HOW = (
    "python -c importing the modules the agent had imported when GetInfo answered"
    " (-X importtime, same run), exec to a byte on a pipe, in turn with the starts"
)


@dataclass(frozen=True)
class Plan:
    restarts: int
    first_starts: int


FULL = Plan(restarts=9, first_starts=3)
QUICK = Plan(restarts=3, first_starts=1)


def environment() -> dict[str, str]:
    """The benchmark's environment, bytecode allowed (an installed package has it)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def argv(state: Path) -> list[str]:
    return [
        tessera(), "run", "--simulate", MODEL, "--no-kube", "--state-dir", str(state),
        "--metrics-address", "127.0.0.1:0", "--log-level", "warning",
    ]  # fmt: skip


def registration_socket(state: Path) -> Path:
    return state / "kubelet" / "plugins_registry" / f"{DRIVER}-reg.sock"


def wait_answer(proc: subprocess.Popen[bytes], sock: Path, timeout: float = 60.0) -> None:
    """Return once ``GetInfo`` on ``sock`` answers (the socket appears, then a call succeeds)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited with {proc.returncode} before answering")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer on {sock} within {timeout:.0f} s")
        if os.path.exists(sock):
            with contextlib.suppress(KubeletApiError), KubeletClient(sock, timeout=5) as k:
                k.get_info()
                return
        time.sleep(POLL_S)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        terminate(proc)


def start(state: Path, env: dict[str, str]) -> float:
    """Seconds from exec to the registration socket answering; the agent is stopped after."""
    sock = registration_socket(state)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv(state), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_answer(proc, sock)
        return time.perf_counter() - t0
    finally:
        stop(proc)


def imported_modules(state: Path, env: dict[str, str]) -> list[str]:
    """The modules the agent has imported when its registration socket first answers, in the
    order their imports completed (``-X importtime``)."""
    log = state.parent / "importtime.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", *argv(state)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            wait_answer(proc, registration_socket(state))
            proc.send_signal(signal.SIGSTOP)  # nothing imported after the answer gets logged
            proc.kill()
            proc.wait(30)
        finally:
            stop(proc)
    names = []
    for line in log.read_text(errors="replace").splitlines():
        m = IMPORT_LINE.match(line)
        if m and m.group(2) != "__main__":
            names.append(m.group(2))
    return list(dict.fromkeys(names))


def floor_program(modules: Sequence[str]) -> str:
    """Import ``modules`` in order (one that cannot be imported by name alone is skipped: it was
    loaded by its parent under another name), then write one byte to stdout."""
    return (
        "import importlib, os\n"
        f"for name in {list(modules)!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        pass\n"
        "os.write(1, b'.')\n"
    )


def floor(program: str, env: dict[str, str]) -> float:
    """Seconds from exec of ``python -c program`` to its byte."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", program], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdout is not None
    got = proc.stdout.read(1)
    elapsed = time.perf_counter() - t0
    proc.wait(30)
    proc.stdout.close()
    if got != b".":
        raise RuntimeError(f"the import floor failed (exit {proc.returncode})")
    return elapsed


def files_under(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def run(quick: bool) -> list[Figure]:
    plan = QUICK if quick else FULL
    env = environment()
    with scratch("tcs-") as tmp:
        state = tmp / "restart"
        start(state, env)  # writes the bytecode and the simulated node; first start, untimed
        modules = imported_modules(state, env)
        start(state, env)  # the timed restarts follow a clean stop, not the kill above
        program = floor_program(modules)
        floor(program, env)  # warm
        restarts: list[float] = []
        restart_floors: list[float] = []
        for _ in range(plan.restarts):
            restart_floors.append(floor(program, env))
            restarts.append(start(state, env))
        firsts: list[float] = []
        first_floors: list[float] = []
        for n in range(plan.first_starts):
            first_floors.append(floor(program, env))
            firsts.append(start(tmp / f"first-{n}", env))
        sim_files = files_under(state / "sim")
    ours = [m for m in modules if m.split(".")[0] in ("agent", "dra_driver")]
    figures = [
        measured(
            NAME,
            f"exec to GetInfo answered, restart ({MODEL}, --no-kube)",
            "s",
            restarts,
            restart_floors,
            floor_how=FLOOR_HOW,
            goal=floor_plus(MARGIN_S, "s"),
        ),
        measured(
            NAME,
            "exec to GetInfo answered, first start (simulator writes its node)",
            "s",
            firsts,
            first_floors,
            floor_how=FLOOR_HOW,
        ),
    ]
    rows = [
        ("modules imported when GetInfo answered",
         f"{len(modules)} ({len(ours)} of agent and dra_driver)"),
        ("restart: exec to GetInfo, each start (s)", " ".join(f"{x:.3f}" for x in restarts)),
        ("import floor, each (s)", " ".join(f"{x:.3f}" for x in restart_floors)),
        ("first start: exec to GetInfo, each (s)", " ".join(f"{x:.3f}" for x in firsts)),
        ("files the simulator wrote under <state>/sim", str(sim_files)),
    ]  # fmt: skip
    report(
        NAME,
        f"Cold start: exec to the registration socket answering ({MODEL}, bench/coldstart.py)",
        rows,
        {
            "modules": modules,
            "restart_s": restarts,
            "restart_floor_s": restart_floors,
            "first_start_s": firsts,
            "first_start_floor_s": first_floors,
            "simulator_files": sim_files,
        },
        figures,
    )
    return figures
