"""The ``tessera`` commands ``make gpu-check`` runs on the node, as an administrator would.

``tessera discover -o json`` and ``tessera slices -o json`` must work on a real GPU (a failure is
a problem the check reports); ``tessera doctor`` reports on the node itself (Kubernetes, CDI,
runtime), which a bare GPU machine may lack, so its exit code is shown and does not count. A
``tessera`` without a ``doctor`` command skips that step and says so, and so does one from the
offline bundle, which leaves out the modules only ``doctor`` needs (:mod:`bench.gpu_check.bundle`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.gpu_check.bundle_launch import NOT_BUNDLED

OK, FAILED, SKIPPED, TIMEOUT, PROBLEMS = "ok", "failed", "skipped", "timed out", "problems"


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    status: str
    rc: int | None
    seconds: float
    detail: str
    stdout: str
    stderr: str
    counts: bool
    """Whether a failure of this step makes the check fail."""

    @property
    def failed(self) -> bool:
        return self.counts and self.status in (FAILED, TIMEOUT)

    def json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "argv": list(self.argv),
            "status": self.status,
            "exitCode": self.rc,
            "seconds": round(self.seconds, 2),
            "detail": self.detail,
        }


def tessera_command(explicit: str | None) -> tuple[str, ...] | None:
    """The ``tessera`` to run: ``explicit``, else the one installed next to this Python (the
    project's ``.venv``), else one on PATH."""
    if explicit:
        return (explicit,)
    near = Path(sys.executable).parent / "tessera"
    if near.exists():
        return (str(near),)
    found = shutil.which("tessera")
    return (found,) if found else None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _run(
    name: str, argv: Sequence[str], timeout: float, counts: bool
) -> tuple[Step, subprocess.CompletedProcess[str] | None]:
    started = time.monotonic()
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        took = time.monotonic() - started
        step = Step(
            name, tuple(argv), TIMEOUT, None, took, f"no answer in {timeout:.0f} s", "", "", counts
        )
        return step, None
    except OSError as exc:
        took = time.monotonic() - started
        why = f"cannot run {argv[0]}: {exc.strerror or exc}"
        return Step(name, tuple(argv), FAILED, None, took, why, "", "", counts), None
    took = time.monotonic() - started
    status = OK if done.returncode == 0 else FAILED
    detail = "" if status == OK else f"exit {done.returncode}: {_last_line(done.stderr)}"
    step = Step(
        name, tuple(argv), status, done.returncode, took, detail, done.stdout, done.stderr, counts
    )
    return step, done


def discover(tessera: Sequence[str], extra: Sequence[str], timeout: float) -> Step:
    step, done = _run(
        "tessera discover -o json", [*tessera, "discover", "-o", "json", *extra], timeout, True
    )
    if done is None or step.status != OK:
        return step
    try:
        gpus = json.loads(done.stdout).get("gpus", [])
    except (ValueError, AttributeError) as exc:
        return replace(step, status=FAILED, detail=f"its output is not the inventory JSON: {exc}")
    return replace(step, detail=f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}")


def slices(tessera: Sequence[str], extra: Sequence[str], timeout: float) -> Step:
    step, done = _run(
        "tessera slices -o json", [*tessera, "slices", "-o", "json", *extra], timeout, True
    )
    if done is None or step.status != OK:
        return step
    try:
        objs = json.loads(done.stdout)
        devices = sum(len(o["spec"].get("devices", [])) for o in objs)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return replace(step, status=FAILED, detail=f"its output is not ResourceSlice JSON: {exc}")
    return replace(step, detail=f"{len(objs)} ResourceSlice(s), {devices} devices")


def doctor(tessera: Sequence[str], extra: Sequence[str], timeout: float) -> Step:
    step, done = _run("tessera doctor", [*tessera, "doctor", *extra], timeout, False)
    if done is None:
        return step
    if done.returncode == 2 and "invalid choice: 'doctor'" in done.stderr:
        return replace(step, status=SKIPPED, detail="this tessera has no doctor command")
    if done.returncode != 0 and NOT_BUNDLED in done.stderr:
        # the offline bundle (make gpu-bundle) leaves out what only doctor imports
        return replace(step, status=SKIPPED, detail=_last_line(done.stderr))
    if done.returncode == 0:
        return replace(step, detail="every check passed (exit 0)")
    why = _last_line(done.stdout) or _last_line(done.stderr)
    return replace(step, status=PROBLEMS, detail=f"exit {done.returncode}: {why}")


def run_steps(
    tessera: tuple[str, ...] | None, extra: Sequence[str], timeout: float
) -> tuple[Step, ...]:
    """discover, slices, doctor; ``extra`` is appended to each (``--simulate M --state-dir D``)."""
    if tessera is None:
        missing = Step(
            "tessera",
            (),
            FAILED,
            None,
            0.0,
            "no tessera command next to this Python or on PATH (make .venv/.installed)",
            "",
            "",
            True,
        )
        return (missing,)
    # a simulated node has no API server: the doctor checks it standalone (on a real node the
    # admin's own flags or TESSERA_* variables say where the API server is)
    standalone = ["--no-kube"] if "--simulate" in extra else []
    return (
        discover(tessera, extra, timeout),
        slices(tessera, extra, timeout),
        doctor(tessera, [*extra, *standalone], timeout),
    )
