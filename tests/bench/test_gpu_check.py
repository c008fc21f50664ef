"""`make gpu-check` (python -m bench.gpu_check) as it runs without a GPU: the simulator of one
model is the "real" node, the reference is a copy of the GPU products with one change."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from importlib import resources
from pathlib import Path

import pytest
import yaml

from agent.cli import TREE
from bench.gpu_check import check
from tests.hardware import needs_no_driver

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bench" / "gpu_check"
NVLINK_FIELD = "telemetry.field.NVLINK_THROUGHPUT_DATA"


def gpu_check(*args):
    """``make gpu-check`` with these arguments against a simulated node, in this process (its
    ``tessera`` steps are real processes): (exit code, stdout, stderr)."""
    assert "--simulate" in args, "without --simulate it loads the real NVML: use gpu_check_process"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        code = check.main(list(args), out)
    return code, out.getvalue(), err.getvalue()


def gpu_check_process(*args, timeout=240):
    """``python -m bench.gpu_check`` with these arguments as a process of its own."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def specs_copy(tmp_path, change=None):
    """agent/sim/gpus.yaml copied (through YAML) with ``change(products)`` applied."""
    products = yaml.safe_load(resources.files("agent.sim").joinpath("gpus.yaml").read_text())
    if change is not None:
        change(products["products"])
    path = tmp_path / "gpus.yaml"
    path.write_text(yaml.safe_dump(products, sort_keys=False))
    return path


def set_profile(product, profile, column, value):
    """Change one column of one MIG profile row ([name, id, enum, g, MiB, SMs, ...])."""

    def change(products):
        row = next(r for r in products[product]["migProfiles"] if r[0] == profile)
        row[column] = value

    return change


def fake_tessera(tmp_path, body):
    """A `tessera` whose every command runs ``body`` (args in ``args``) and prints ``{}``."""
    path = tmp_path / "tessera"
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "args = sys.argv[1:]\n" + textwrap.dedent(body) + "\nprint('{}')\n"
    )
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("model", ["dgx-a100", "mixed"])
def test_an_unchanged_copy_of_the_products_has_no_difference(model, tmp_path):
    # dgx-a100 starts with MIG instances (balanced layout): the twin must hold the same ones
    code, out, err = gpu_check("--simulate", model, "--reference-specs", str(specs_copy(tmp_path)))
    assert code == 0, out + err
    assert "result: no difference (exit 0" in out
    assert "the same before and after" in out
    assert "ok        tessera discover -o json" in out
    assert "ok        tessera slices -o json" in out


def test_the_json_report_of_an_unchanged_model(tmp_path):
    code, out, err = gpu_check("--simulate", "dgx-a100", "-o", "json", "--save", str(tmp_path))
    assert code == 0, err
    report = json.loads(out)
    assert report["result"] == "same" and report["differences"] == []
    assert report["gpuStateUnchanged"] is True
    assert [g["simulatorProduct"] for g in report["gpus"]] == ["A100-SXM4-40GB"] * 8
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["tessera discover -o json"]["status"] == "ok"
    has_doctor = any(c.name == "doctor" for c in TREE.subcommands)
    doctor = steps["tessera doctor"]
    if has_doctor:
        assert doctor["status"] != "skipped"
    else:
        assert (doctor["status"], doctor["detail"]) == (
            "skipped",
            "this tessera has no doctor command",
        )
    real = json.loads((tmp_path / "facts-real.json").read_text())
    simulated = json.loads((tmp_path / "facts-simulated.json").read_text())
    # MIG instances of the balanced layout are there on both sides, at the same placements
    assert real["gpu[0].gpuInstance[start=4].profileId"] == 9
    assert simulated["gpu[0].gpuInstance[start=4].profileId"] == 9
    assert real["gpu[0].giProfile[enum=2].placements"] == ["0:4", "4:4"]
    assert "advertised[dynamic].device[gpu-0-mig-3g20gb-9-4].capacity[memory]" in simulated


@pytest.mark.parametrize(
    ("model", "change", "expected"),
    [
        pytest.param(
            "hgx-h200",
            set_profile("H200-SXM5-141GB", "3g.71gb", 4, 70000),
            [("gpu[0,1,2,3,4,5,6,7].giProfile[enum=2].memorySizeMB", 71680, 70000)],
            id="mig-profile-memory",
        ),
        pytest.param(
            "mixed",
            set_profile("A100-PCIE-80GB", "1g.10gb", 5, 16),
            [("gpu[0,1].giProfile[enum=0].multiprocessorCount", 14, 16)],
            id="mig-profile-sms",
        ),
        pytest.param(
            "mixed",
            lambda products: products["L4"].update(memoryMiB=24000),
            [("gpu[2,3].memory.total_bytes", 23034 * 2**20, 24000 * 2**20)],
            id="gpu-memory",
        ),
        pytest.param(
            "l40s-pcie",
            lambda products: products["L40S"].update(nvlinks=4),
            [  # with links, NVML answers for links 0-3 and the NVLink throughput fields
                ("gpu[0,1,2,3].nvlink.afterLastLink", "<NOT_SUPPORTED>", "<INVALID_ARGUMENT>"),
                ("gpu[0,1,2,3].nvlink.links", 0, 4),
                (f"gpu[0,1,2,3].{NVLINK_FIELD}_RX", "<NOT_SUPPORTED>", "valueType 3"),
                (f"gpu[0,1,2,3].{NVLINK_FIELD}_TX", "<NOT_SUPPORTED>", "valueType 3"),
            ],
            id="not-supported",
        ),
    ],
)
def test_one_injected_difference_is_reported_and_nothing_else(model, change, expected, tmp_path):
    specs = specs_copy(tmp_path, change)
    saved = tmp_path / "saved"
    code, out, err = gpu_check(
        "--simulate", model, "--reference-specs", str(specs), "--save", str(saved)
    )
    assert code == 1, out + err
    report = json.loads((saved / "report.json").read_text())
    assert report["result"] == "different"
    found = [(d["path"], d["real"], d["simulated"]) for d in report["differences"]]
    assert found == expected
    # the text report: one line per difference, path, real value, simulated value
    for path, real, simulated in expected:
        assert f"  {path}  real={real}  simulated={simulated}\n" in out
    assert f"result: {len(expected)} difference(s) (exit 1" in out


def test_a_gpu_the_simulator_has_no_product_for_is_one_line(tmp_path):
    specs = specs_copy(tmp_path, lambda products: products.pop("L4"))
    code, out, err = gpu_check("--simulate", "mixed", "--reference-specs", str(specs), "-o", "json")
    assert code == 1, err
    report = json.loads(out)
    assert report["differences"] == [
        {
            "path": "gpu[2,3].product",
            "real": "NVIDIA L4 (PCI device id 0x27B810DE)",
            "simulated": f"<none in {specs}>",
        }
    ]
    assert [g["simulatorProduct"] for g in report["gpus"]] == ["A100-PCIE-80GB"] * 2 + [None] * 2


@pytest.mark.parametrize(
    ("model", "change", "path", "before", "after"),
    [
        pytest.param(
            "l40s-pcie",
            "fake.nvmlDeviceSetComputeMode(fake.nvmlDeviceGetHandleByIndex(1), 3)",
            "gpu[1].computeMode",
            0,
            3,
            id="compute-mode",
        ),
        pytest.param(
            "dgx-h100",
            "fake.nvmlDeviceSetMigMode(fake.nvmlDeviceGetHandleByIndex(0), 1)",
            "gpu[0].migMode",
            [0, 0],
            [1, 1],
            id="mig-mode",
        ),
        pytest.param(
            "dgx-a100",
            """
            h = fake.nvmlDeviceGetHandleByIndex(2)
            gi = fake.nvmlDeviceGetGpuInstanceById(h, 1)
            fake.nvmlComputeInstanceDestroy(fake.nvmlGpuInstanceGetComputeInstanceById(gi, 0))
            fake.nvmlGpuInstanceDestroy(gi)
            """,
            "gpu[2].gpuInstance[start=4]",
            "present",
            "<absent>",
            id="mig-instance",
        ),
    ],
)
def test_a_gpu_changed_while_the_check_runs_fails_loudly(
    model, change, path, before, after, tmp_path
):
    body = f"""
        if args[0] == "discover":
            from pathlib import Path
            from agent.sim.model import load_model
            from agent.sim.nvml import FakeNvml
            state = Path(args[args.index("--state-dir") + 1]) / "sim"
            fake = FakeNvml(load_model(args[args.index("--simulate") + 1]), state)
            fake.nvmlInit()
{textwrap.indent(textwrap.dedent(change).strip(), " " * 12)}
    """
    tessera = fake_tessera(tmp_path, body)
    saved = tmp_path / "saved"
    code, out, err = gpu_check("--simulate", model, "--tessera", str(tessera), "--save", str(saved))
    assert code == 2, out + err
    assert "THE GPU STATE CHANGED WHILE IT RAN" in err
    report = json.loads((saved / "report.json").read_text())
    assert report["result"] == "error" and report["gpuStateUnchanged"] is False
    assert {"path": path, "before": before, "after": after} in report["gpuStateChanges"]
    assert "!!! THE GPU STATE CHANGED WHILE gpu-check RAN" in out
    assert f"  {path}: before " in out


def test_a_tessera_command_that_hangs_is_cut_off_and_fails_the_check(tmp_path):
    tessera = fake_tessera(tmp_path, "import time\ntime.sleep(120)\n")
    code, out, err = gpu_check(
        "--simulate", "l40s-pcie", "--tessera", str(tessera), "--step-timeout", "1", "-o", "json"
    )
    assert code == 1, out + err
    report = json.loads(out)
    assert report["differences"] == []
    assert [s["status"] for s in report["steps"]] == ["timed out"] * 3


def test_a_tessera_that_is_missing_fails_the_steps(tmp_path):
    code, out, _ = gpu_check("--simulate", "l40s-pcie", "--tessera", str(tmp_path / "nope"))
    assert code == 1
    assert "failed    tessera discover -o json" in out and "cannot run" in out


@needs_no_driver
@pytest.mark.parametrize("output", ["text", "json"])
def test_without_a_driver_it_says_so_and_exits_2(output):
    code, out, err = gpu_check_process("-o", output)
    assert code == 2
    assert err.startswith("gpu-check: cannot run: no NVIDIA driver: pynvml.nvmlInit failed: ")
    assert "; run on a GPU node" in err and "--simulate" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    if output == "json":
        assert json.loads(out)["result"] == "error"


def test_make_gpu_check_runs_the_module():
    done = subprocess.run(
        ["make", "-n", "gpu-check", "ARGS=--simulate mixed -o json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MAKEFLAGS": ""},
    )
    assert "bench/gpu_check/make_gpu_check.sh --simulate mixed -o json" in done.stdout
    assert "result" not in done.stdout  # -n runs nothing (tests/bench/test_gpu_bundle.py runs it)


def test_unknown_reference_specs_file_cannot_run(tmp_path):
    code, _, err = gpu_check("--simulate", "mixed", "--reference-specs", str(tmp_path / "x.yaml"))
    assert code == 2
    assert "cannot read GPU spec file" in err and "Traceback" not in err


MUTATING = ("Set", "Create", "Destroy", "Reset", "Clear", "Register")


def test_only_the_simulated_twin_is_ever_changed():
    """Every NVML call that could change a GPU is made on the simulator (``fake.``), in
    reference.py; everything else reads. (The XID check registers events in an event set of
    its own process, through the agent's EventWatcher, which changes nothing on the GPU.)"""
    offenders = []
    for module in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            mutating = name == "reset_gpu" or (
                name.startswith("nvml") and any(word in name for word in MUTATING)
            )
            if not mutating:
                continue
            receiver = node.func.value
            on_fake = isinstance(receiver, ast.Name) and receiver.id == "fake"
            if module.name != "reference.py" or not on_fake:
                offenders.append(f"{module.name}:{node.lineno} {ast.unparse(node.func)}")
    assert offenders == []


def test_a_crash_is_no_verdict_and_exits_2(monkeypatch):
    """Python exits 1 on an uncaught exception, which would read as "different"."""

    def crash(**_):
        raise RuntimeError("boom")

    monkeypatch.setattr(check, "run_check", crash)
    code, _, err = gpu_check("--simulate", "mixed")
    assert code == 2
    assert "Traceback" in err
    assert err.splitlines()[-1].startswith("gpu-check: cannot run: it failed: RuntimeError: boom")
