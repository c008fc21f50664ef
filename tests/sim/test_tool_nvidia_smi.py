"""The simulated nvidia-smi against a simulated node: as the installed executable (a real process)
where the test is about what a caller of the executable sees, else its ``main`` with the
arguments the installed executable passes it (the same code, without 0.2 s of a Python start)."""

from __future__ import annotations

import io
import shutil
import subprocess

import pynvml
import pytest

from agent.sim.nvml_core import sysfs_to_nvml_bus_id
from agent.sim.tools import nvidia_smi
from tests.sim.tools_helpers import NodeFactory, SimNode, run


@pytest.fixture
def h100(sim_nodes: NodeFactory) -> SimNode:
    return sim_nodes("dgx-h100")


@pytest.fixture
def a100(sim_nodes: NodeFactory) -> SimNode:
    """MIG enabled on every GPU (the model's default layout)."""
    return sim_nodes("dgx-a100")


def smi(node: SimNode, *args: str) -> subprocess.CompletedProcess[str]:
    """``nvidia-smi args`` in this process, as the installed stand-in runs it."""
    out, err = io.StringIO(), io.StringIO()
    code = nvidia_smi.main(
        list(args), state_dir=str(node.state_dir), model=node.fake.model.name, out=out, err=err
    )
    return subprocess.CompletedProcess(["nvidia-smi", *args], code, out.getvalue(), err.getvalue())


def bus(node: SimNode, index: int) -> str:
    return sysfs_to_nvml_bus_id(node.fake.model.gpus[index].bus)


def mode_of(node: SimNode, index: int) -> int:
    return node.fake.nvmlDeviceGetComputeMode(node.fake.nvmlDeviceGetHandleByIndex(index))


def query(node: SimNode, *args: str) -> str:
    result = smi(node, *args, "--query-gpu=compute_mode", "--format=csv,noheader")
    assert result.returncode == 0, result.stderr
    return result.stdout


# -- compute mode ------------------------------------------------------------------------------


def test_set_exclusive_process_by_uuid_as_nvidia_smi_prints_it(h100: SimNode):
    uuid = h100.fake.model.gpus[2].uuid
    result = run(h100.smi, "-i", uuid, "-c", "EXCLUSIVE_PROCESS")
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout
        == f"Set compute mode to EXCLUSIVE_PROCESS for GPU {bus(h100, 2)}.\nAll done.\n"
    )
    assert result.stderr == ""
    assert mode_of(h100, 2) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS  # NVML agrees
    assert [mode_of(h100, i) for i in (0, 1, 3)] == [0, 0, 0]
    assert query(h100, "-i", uuid) == "Exclusive_Process\n"


@pytest.mark.parametrize(
    ("ident", "args"),
    [
        ("4", ("-c", "3")),
        ("gpu4-bus", ("--compute-mode=PROHIBITED",)),
        ("gpu4-serial", ("--compute-mode", "2")),
    ],
)
def test_ids_and_values_in_every_form(h100: SimNode, ident: str, args: tuple[str, ...]):
    if ident == "gpu4-bus":
        ident = bus(h100, 4).lower()
    elif ident == "gpu4-serial":
        ident = h100.fake.model.gpus[4].serial
    result = smi(h100, "--id", ident, *args)
    assert result.returncode == 0, result.stderr
    assert mode_of(h100, 4) in (2, 3)
    assert [mode_of(h100, i) for i in range(8) if i != 4] == [0] * 7


def test_already_set_and_back_to_default(h100: SimNode):
    smi(h100, "-i", "1", "-c", "3")
    again = smi(h100, "-i", "1", "-c", "EXCLUSIVE_PROCESS")
    assert again.returncode == 0
    assert again.stdout == (
        f"Compute mode is already set to EXCLUSIVE_PROCESS for GPU {bus(h100, 1)}.\nAll done.\n"
    )
    back = smi(h100, "-i", "1", "-c", "DEFAULT")
    assert back.stdout.startswith(f"Set compute mode to DEFAULT for GPU {bus(h100, 1)}.")
    assert mode_of(h100, 1) == 0


def test_without_id_every_gpu_and_several_ids(h100: SimNode):
    result = smi(h100, "-c", "3")
    assert result.returncode == 0
    assert result.stdout.count("Set compute mode to EXCLUSIVE_PROCESS") == 8
    assert [mode_of(h100, i) for i in range(8)] == [3] * 8
    smi(h100, "-i", "0,5", "-c", "0")
    assert query(h100) == "".join(
        ("Default" if i in (0, 5) else "Exclusive_Process") + "\n" for i in range(8)
    )


def test_the_tool_sees_what_nvml_set(h100: SimNode):
    h100.fake.nvmlDeviceSetComputeMode(h100.fake.nvmlDeviceGetHandleByIndex(6), 2)
    assert query(h100, "-i", "6") == "Prohibited\n"


def test_query_csv_with_header_and_several_fields(h100: SimNode):
    smi(h100, "-i", "7", "-c", "3")
    result = run(
        h100.smi, "-i", "7", "--query-gpu=index,uuid,pci.bus_id,compute_mode", "--format=csv"
    )
    assert result.returncode == 0, result.stderr
    uuid = h100.fake.model.gpus[7].uuid
    assert result.stdout == (
        f"index, uuid, pci.bus_id, compute_mode\n7, {uuid}, {bus(h100, 7)}, Exclusive_Process\n"
    )


def test_mig_mode_in_queries(a100: SimNode, h100: SimNode):
    assert (
        smi(a100, "-i", "0", "--query-gpu=mig.mode.current", "--format=csv,noheader").stdout
        == "Enabled\n"
    )
    assert (
        smi(h100, "-i", "0", "--query-gpu=mig.mode.current", "--format=csv,noheader").stdout
        == "Disabled\n"
    )


def test_power_fields_show_a_limit_nvml_set(h100: SimNode) -> None:
    h100.fake.nvmlDeviceSetPowerManagementLimit(h100.fake.nvmlDeviceGetHandleByIndex(2), 350_000)
    fields = "power.limit,power.default_limit,power.min_limit,power.max_limit,power.draw"
    result = smi(h100, "-i", "2", f"--query-gpu={fields}", "--format=csv")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "power.limit [W], power.default_limit [W], power.min_limit [W], power.max_limit [W],"
        " power.draw [W]\n350.00 W, 700.00 W, 200.00 W, 700.00 W, 84.00 W\n"
    )  # idle: 12 % of the 700 W board power
    bare = smi(h100, "-i", "2,3", "--query-gpu=power.limit", "--format=csv,noheader,nounits")
    assert bare.stdout == "350.00\n700.00\n"


# -- errors ----------------------------------------------------------------------------------


def one_line_error(result, code: int) -> str:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


@pytest.mark.parametrize(
    "ident", ["8", "GPU-00000000-0000-0000-0000-000000000000", "0000:ff:00.0", "nope"]
)
def test_an_unknown_gpu_is_exit_6(h100: SimNode, ident: str):
    err = one_line_error(smi(h100, "-i", ident, "-c", "3"), 6)
    assert err.startswith("No devices were found") and repr(ident) in err and "0..7" in err
    assert [mode_of(h100, i) for i in range(8)] == [0] * 8


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("1", "removed"),
        ("EXCLUSIVE_THREAD", "removed"),
        ("4", "not a compute mode"),
        ("exclusive", "not a compute mode"),
    ],
)
def test_a_bad_compute_mode_is_exit_2_naming_the_allowed_ones(h100: SimNode, value: str, why: str):
    err = one_line_error(smi(h100, "-i", "0", "-c", value), 2)
    assert repr(value) in err and why in err
    assert "0|DEFAULT, 2|PROHIBITED, 3|EXCLUSIVE_PROCESS" in err


def test_a_lost_gpu_is_exit_15(h100: SimNode):
    h100.fake.lose_gpu(3)
    err = one_line_error(smi(h100, "-i", "3", "-c", "3"), 15)
    assert err == f"Unable to set the compute mode for GPU {bus(h100, 3)}: GPU is lost\n"
    assert one_line_error(smi(h100, "-i", "3", "--query-gpu=compute_mode", "--format=csv"), 15)
    h100.fake.recover_gpu(3)
    assert smi(h100, "-i", "3", "-c", "3").returncode == 0


def test_a_mig_device_has_no_compute_mode_of_its_own(a100: SimNode):
    gpu = a100.fake.nvmlDeviceGetHandleByIndex(1)
    mig = a100.fake.nvmlDeviceGetUUID(a100.fake.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0))
    err = one_line_error(smi(a100, "-i", mig, "-c", "3"), 3)
    assert mig in err and "MIG device" in err and bus(a100, 1) in err
    assert smi(a100, "-i", "1", "-c", "3").returncode == 0  # the MIG-enabled GPU: yes
    assert mode_of(a100, 1) == 3


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--bogus",), "'--bogus'"),
        (("-i",), "-i needs a value"),
        (("-i", "0"), "only sets (-c) and queries"),
        (("-c", "3", "--query-gpu=compute_mode", "--format=csv"), "cannot be combined"),
        (("--query-gpu=compute_mode",), "--format=csv"),
        (("--query-gpu=compute_mode", "--format=json"), "--format=csv"),
        (("-c", "3", "-c", "0"), "given twice"),
    ],
)
def test_bad_command_lines_are_exit_2(h100: SimNode, args: tuple[str, ...], words: str):
    err = one_line_error(smi(h100, *args), 2)
    assert err.startswith("Invalid combination of input arguments") and words in err
    assert err.rstrip().endswith("Please run 'nvidia-smi -h' for help.")


def test_an_unknown_query_field_is_exit_2(h100: SimNode):
    err = one_line_error(smi(h100, "--query-gpu=compute_mode,power.fun", "--format=csv"), 2)
    assert err.startswith('Field "power.fun" is not a valid field to query')


def test_refuses_to_run_when_its_simulated_node_is_gone(h100: SimNode):
    shutil.rmtree(h100.state_dir)
    err = one_line_error(smi(h100, "-i", "0", "-c", "3"), 9)
    assert str(h100.state_dir) in err and "gone" in err
    assert not h100.state_dir.exists()  # and did not make a new one


def test_help(h100: SimNode):
    result = run(h100.smi, "-h")
    assert result.returncode == 0 and "-c MODE" in result.stdout


# -- compute-policy (time-slice) -------------------------------------------------------------


def listing(node: SimNode, *ids: str) -> str:
    args = ("-i", ",".join(ids)) if ids else ()
    result = smi(node, "compute-policy", *args, "-l")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_set_and_list_the_timeslice(h100: SimNode):
    uuid = h100.fake.model.gpus[1].uuid
    result = smi(h100, "compute-policy", "-i", uuid, "--set-timeslice", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"Set timeslice to SHORT for GPU {bus(h100, 1)}.\nAll done.\n"
    assert smi(h100, "compute-policy", "--id=2", "--set-timeslice=3").returncode == 0
    assert listing(h100, "1", "2") == (
        f"GPU {bus(h100, 1)}\n    Timeslice{' ' * 26}: SHORT\n"
        f"GPU {bus(h100, 2)}\n    Timeslice{' ' * 26}: LONG\n"
    )
    handle = h100.fake.nvmlDeviceGetHandleByIndex(2)
    assert h100.fake.get_timeslice(handle) == 3
    assert listing(h100).count(": DEFAULT") == 6
    assert smi(h100, "compute-policy", "--list").stdout == listing(h100)


@pytest.mark.parametrize("value", ["4", "-1", "LONG", ""])
def test_a_bad_timeslice_is_exit_2(h100: SimNode, value: str):
    err = one_line_error(smi(h100, "compute-policy", "-i", "0", "--set-timeslice", value), 2)
    assert repr(value) in err and "0=DEFAULT, 1=SHORT, 2=MEDIUM, 3=LONG" in err


def test_timeslice_errors(h100: SimNode, a100: SimNode):
    h100.fake.lose_gpu(0)
    err = one_line_error(smi(h100, "compute-policy", "-i", "0", "--set-timeslice", "1"), 15)
    assert "GPU is lost" in err
    one_line_error(smi(h100, "compute-policy", "-i", "9", "-l"), 6)
    one_line_error(smi(h100, "compute-policy", "-l", "--set-timeslice", "1"), 2)
    one_line_error(smi(h100, "compute-policy", "--frob"), 2)
    gpu = a100.fake.nvmlDeviceGetHandleByIndex(0)
    mig = a100.fake.nvmlDeviceGetUUID(a100.fake.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0))
    one_line_error(smi(a100, "compute-policy", "-i", mig, "--set-timeslice", "1"), 3)


def test_compute_policy_without_an_action_prints_its_help(h100: SimNode):
    result = smi(h100, "compute-policy")
    assert result.returncode == 0 and "--set-timeslice" in result.stdout
