"""`make gpu-bundle` and `make gpu-check` on a GPU machine with no network and no room for .venv:
the bundle is built once per session, then gpu-check runs from it with only the bundle and the
source tree on sys.path (an isolated Python: ``-I -S``, a clean environment) and, where this
machine can make user namespaces, with no network and the virtualenv hidden under an empty
tmpfs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from bench.gpu_check import bundle_launch
from tests.hardware import needs_no_driver

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 50 * 1024 * 1024
BASE_PYTHON = os.path.realpath(sys._base_executable)
"""The interpreter the virtualenv was made from, run directly: it knows nothing of the venv."""
CLEAN_ENV = {"PATH": f"{os.path.dirname(BASE_PYTHON)}:/usr/bin:/bin", "LANG": "C.UTF-8"}


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bundle") / "gpu-bundle"
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check.bundle", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def run_bundle(bundle, *args, env=None, timeout=240):
    """The bundle's ``gpu-check`` launcher in a clean environment: (exit code, stdout, stderr)."""
    done = subprocess.run(
        [str(bundle / "gpu-check"), *args],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**CLEAN_ENV, "GPU_BUNDLE_SOURCE": str(ROOT), **(env or {})},
    )
    return done.returncode, done.stdout, done.stderr


def hidden_dirs():
    """Where installed packages could come from: the venv's and the base Python's."""
    venv = sysconfig.get_paths()["purelib"]
    base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})
    found = {os.path.realpath(venv), os.path.realpath(base["purelib"])}
    return sorted(d for d in found if os.path.isdir(d))


def can_unshare():
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-rnm", "true"], capture_output=True, check=False)
    return done.returncode == 0


def sandboxed(argv, hide_venv=False):
    """``argv`` with no network (a new network namespace: loopback only, down) and every
    site-packages directory hidden under an empty tmpfs (a new mount namespace); ``hide_venv``:
    the whole virtualenv too (its python and its install stamp)."""
    hidden = [*hidden_dirs(), *([os.path.realpath(ROOT / ".venv")] if hide_venv else [])]
    mounts = " && ".join(f"mount -t tmpfs none '{d}'" for d in hidden)
    return ["unshare", "-rnm", "sh", "-c", f'{mounts} && exec "$@"', "sh", *argv]


def test_the_bundle_is_small_pure_python_and_says_what_it_needs(bundle):
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert 0 < size <= LIMIT
    compiled = [p.name for p in bundle.rglob("*") if p.suffix in (".so", ".pyd", ".pyc")]
    assert compiled == []
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["python"]["requires"] == ">=3.11"
    assert set(manifest["distributions"]) == {"nvidia-ml-py", "PyYAML"}
    assert manifest["bytes"] == size - (bundle / "bundle.json").stat().st_size
    assert any("_yaml" in left for left in manifest["leftOut"])


def test_gpu_check_runs_from_the_bundle_in_an_isolated_python(bundle, tmp_path):
    code, out, err = run_bundle(bundle, "--simulate", "l40s-pcie", "-o", "json")
    assert code == 0, out + err
    report = json.loads(out)
    assert report["result"] == "same" and report["differences"] == []
    steps = {s["name"]: s for s in report["steps"]}
    # the counted steps ran the bundle's own `tessera`; doctor needs the Kubernetes client,
    # which the bundle leaves out, and says so instead of failing
    assert steps["tessera discover -o json"]["status"] == "ok"
    assert steps["tessera discover -o json"]["argv"][0] == str(bundle / "tessera")
    assert steps["tessera slices -o json"]["status"] == "ok"
    assert steps["tessera doctor"]["status"] == "skipped"
    assert "not in the gpu-check bundle" in steps["tessera doctor"]["detail"]


def test_a_difference_exits_1_from_the_bundle(bundle, tmp_path):
    products = yaml.safe_load((ROOT / "agent/sim/gpus.yaml").read_text())
    products["products"]["L40S"]["nvlinks"] = 4
    specs = tmp_path / "gpus.yaml"
    specs.write_text(yaml.safe_dump(products, sort_keys=False))
    code, out, err = run_bundle(bundle, "--simulate", "l40s-pcie", "--reference-specs", str(specs))
    assert code == 1, out + err
    assert "gpu[0,1,2,3].nvlink.links  real=0  simulated=4" in out
    assert "result: 4 difference(s) (exit 1" in out


@needs_no_driver
def test_without_a_driver_the_bundle_exits_2(bundle):
    """The real-GPU path (pynvml from the bundle) as far as a machine without a driver goes."""
    code, out, err = run_bundle(bundle)
    assert code == 2, out + err
    assert err.startswith("gpu-check: cannot run: no NVIDIA driver: pynvml.nvmlInit failed: ")


def fake_python(tmp_path, version):
    """A ``python3`` that answers the launcher's version question with ``version``."""
    path = tmp_path / "python3"
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


def test_too_old_a_python_cannot_run_and_says_what_it_needs(bundle, tmp_path):
    old = fake_python(tmp_path, "3.9.18")
    code, out, err = run_bundle(
        bundle, "--simulate", "l40s-pcie", env={"GPU_BUNDLE_PYTHON": str(old)}
    )
    assert code == 2 and out == ""
    assert err == (
        f"gpu-check: cannot run: {old} is Python 3.9.18; this bundle needs CPython >=3.11"
        " (it is pure Python: any 3.11 or later, any architecture): set"
        " GPU_BUNDLE_PYTHON=/path/to/python3.11 or later\n"
    )


def test_the_launcher_refuses_an_old_python_itself():
    """Run directly (``python -I -S launch.py``), the launcher checks again."""
    assert bundle_launch.python_problem((3, 10, 4), "cpython", (3, 11)) == (
        "Python 3.10.4 (cpython); this bundle needs CPython >=3.11"
    )
    assert bundle_launch.python_problem((3, 12, 0), "pypy", (3, 11)) is not None
    assert bundle_launch.python_problem((3, 11, 0), "cpython", (3, 11)) is None
    assert bundle_launch.python_problem((3, 13, 1), "cpython", (3, 11)) is None


def test_without_a_source_tree_it_cannot_run(bundle, tmp_path):
    code, _, err = run_bundle(bundle, env={"GPU_BUNDLE_SOURCE": str(tmp_path)})
    assert code == 2
    assert err.startswith(f"gpu-check: cannot run: no Tessera source tree at {tmp_path} ")


def make_gpu_check(tmp_path, *variables, sandbox=False):
    """``make gpu-check`` with these variables; the exit file goes to tmp_path/run."""
    argv = [
        shutil.which("make") or "make",
        "--no-print-directory",
        "gpu-check",
        f"RUN_DIR={tmp_path / 'run'}",
        *variables,
    ]
    done = subprocess.run(
        sandboxed(argv, hide_venv=True) if sandbox else argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**CLEAN_ENV, "GPU_BUNDLE_SOURCE": str(ROOT), "MAKEFLAGS": ""},
    )
    exit_file = tmp_path / "run" / "gpu-check.exit"
    recorded = int(exit_file.read_text()) if exit_file.exists() else None
    return done.returncode, recorded, done.stdout + done.stderr


def fake_bundle(tmp_path, code):
    path = tmp_path / "bundle"
    path.mkdir()
    (path / "gpu-check").write_text(f'#!/bin/sh\necho checked "$@"\nexit {code}\n')
    (path / "gpu-check").chmod(0o755)
    return path


@pytest.mark.parametrize(
    ("check_exit", "recorded", "says"),
    [
        (0, 0, "make gpu-check: exit 0: no difference"),
        (1, 1, "make gpu-check: exit 1: the GPUs and the simulator differ"),
        (2, 2, "make gpu-check: exit 2: gpu-check cannot run here"),
        (139, 2, "make gpu-check: exit 2: gpu-check cannot run here (it ended with 139"),
    ],
)
def test_make_keeps_different_and_cannot_run_apart(tmp_path, check_exit, recorded, says):
    """No venv (VENV names nothing), a bundle: make runs the bundle and passes its verdict on.
    make itself exits 2 for any failed recipe, so the verdict is the last line and a file."""
    fake = fake_bundle(tmp_path, check_exit)
    code, written, output = make_gpu_check(
        tmp_path, f"VENV={tmp_path / 'none'}", f"GPU_BUNDLE={fake}", "ARGS=--simulate mixed"
    )
    assert (
        f"no {tmp_path / 'none'} here (or not up to date): running gpu-check from the bundle {fake}"
        in output
    )
    assert "checked --simulate mixed" in output
    assert written == recorded
    assert output.rstrip().splitlines()[-1 if check_exit == 0 else -2].startswith(says)
    assert code == (0 if check_exit == 0 else 2)


def test_make_without_venv_network_or_bundle_cannot_run(tmp_path):
    """The venv cannot be built (PYTHON=false stands for pip with no index) and no bundle."""
    code, written, output = make_gpu_check(
        tmp_path, f"VENV={tmp_path / 'none'}", f"GPU_BUNDLE={tmp_path / 'nobundle'}", "PYTHON=false"
    )
    assert code == 2 and written == 2
    assert "make gpu-check: exit 2: gpu-check cannot run here" in output
    assert f"no {tmp_path / 'none'} and it could not be built" in output
    assert "make gpu-bundle" in output


@pytest.mark.skipif(not can_unshare(), reason="no user namespaces here (unshare -rnm fails)")
def test_make_gpu_check_offline_runs_the_bundle(bundle, tmp_path):
    """The GPU machine as the issue describes it: no network, no venv (hidden), a bundle."""
    probe = subprocess.run(
        sandboxed(
            [
                BASE_PYTHON,
                "-c",
                "import os, socket, sys\n"
                "print(sorted(os.listdir(sys.argv[1])))\n"
                "try:\n"
                "    socket.create_connection(('1.1.1.1', 443), timeout=2)\n"
                "except OSError as exc:\n"
                "    print('offline', type(exc).__name__)\n",
                os.path.realpath(ROOT / ".venv"),
            ],
            hide_venv=True,
        ),
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.split("\n")[:2] == ["[]", "offline OSError"]
    code, written, output = make_gpu_check(
        tmp_path,
        f"GPU_BUNDLE={bundle}",
        "ARGS=--simulate l40s-pcie",
        sandbox=True,
    )
    assert code == 0 and written == 0, output
    assert "running gpu-check from the bundle" in output
    assert "result: no difference (exit 0" in output


def test_a_directory_that_is_not_a_bundle_is_not_replaced(tmp_path):
    (tmp_path / "keep.txt").write_text("mine\n")
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check.bundle", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr == (
        f"gpu-bundle: {tmp_path} exists and is not a gpu-check bundle (no bundle.json):"
        " not replaced\n"
    )
    assert (tmp_path / "keep.txt").read_text() == "mine\n"
