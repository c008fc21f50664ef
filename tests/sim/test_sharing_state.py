"""The simulated sharing state: its JSON codec, and the NVML compute-mode calls over it."""

from __future__ import annotations

import json

import pynvml
import pytest

from agent.sim.model import load_model
from agent.sim.sharing import (
    STATE_FILE,
    MpsDaemon,
    SharingFormatError,
    compute_mode_name,
    initial_sharing,
    sharing_from_json,
    sharing_to_json,
)
from tests.sim.conftest import MakeFake


def test_the_codec_round_trips_settings_and_daemons():
    state = initial_sharing(load_model("dgx-h100"))
    state = state.with_gpu(state.gpus[2].__class__(2, state.gpus[2].uuid, 3, 2))
    daemon = MpsDaemon(
        7, 99, "/p", "/l", (state.gpus[2].uuid,), 25.0, ((state.gpus[2].uuid, 2048),)
    )
    state = state.with_daemon(daemon)
    assert sharing_from_json(json.loads(json.dumps(sharing_to_json(state)))) == state


def test_a_daemon_record_replaces_the_stale_one_of_its_pipe_directory():
    state = initial_sharing(load_model("l40s-pcie"))
    old, new = MpsDaemon(1, 1, "/p", "/l", ()), MpsDaemon(2, 2, "/p", "/l", ())
    other = MpsDaemon(3, 3, "/q", "/l", ())
    state = state.with_daemon(old).with_daemon(other).with_daemon(new)
    assert state.mps_daemons == (other, new)
    assert state.without_daemon(2, "/p").mps_daemons == (other,)
    assert state.without_daemon(2, "/q").mps_daemons == (other, new)  # pid and directory


@pytest.mark.parametrize(
    "change",
    [
        lambda raw: raw.update(kind="Other"),
        lambda raw: raw["gpus"][0].update(computeMode="3"),
        lambda raw: raw["mpsDaemons"].append({"pid": 1}),
        lambda raw: raw["mpsDaemons"].append(
            {
                "pid": 1,
                "startTicks": 1,
                "pipeDirectory": "/p",
                "logDirectory": "/l",
                "devices": "GPU-x",
                "activeThreadPercentage": 1,
                "pinnedMemLimitsMiB": {},
            }
        ),  # devices is not a list
    ],
)
def test_malformed_state_is_a_format_error(change):
    raw = sharing_to_json(initial_sharing(load_model("l40s-pcie")))
    change(raw)
    with pytest.raises(SharingFormatError):
        sharing_from_json(raw)


def test_compute_mode_names_are_nvidia_smis():
    assert [compute_mode_name(m) for m in (0, 1, 2, 3)] == [
        "Default",
        "Exclusive_Thread",
        "Prohibited",
        "Exclusive_Process",
    ]


# -- the NVML calls ---------------------------------------------------------------------------


def test_compute_mode_is_default_after_boot_and_shared_between_processes(
    make_fake: MakeFake, state_dir
):
    fake = make_fake("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(3)
    assert fake.nvmlDeviceGetComputeMode(h) == pynvml.NVML_COMPUTEMODE_DEFAULT
    fake.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    other = make_fake("dgx-h100")  # another process on the same state directory
    assert other.nvmlDeviceGetComputeMode(other.nvmlDeviceGetHandleByIndex(3)) == 3
    assert other.nvmlDeviceGetComputeMode(other.nvmlDeviceGetHandleByIndex(2)) == 0
    assert (state_dir / STATE_FILE).is_file()
    fake.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_PROHIBITED)
    assert other.sharing_state.gpus[3].compute_mode == 2


@pytest.mark.parametrize("mode", [pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD, 4, -1])
def test_exclusive_thread_and_unknown_modes_are_invalid(make_fake: MakeFake, mode):
    fake = make_fake("l40s-pcie")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceSetComputeMode(h, mode)
    assert fake.nvmlDeviceGetComputeMode(h) == 0


def test_compute_mode_is_not_a_mig_device_setting(make_fake: MakeFake):
    fake = make_fake("dgx-a100")
    gpu = fake.nvmlDeviceGetHandleByIndex(0)
    mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetComputeMode(mig)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceSetComputeMode(mig, 3)
    fake.nvmlDeviceSetComputeMode(gpu, 3)  # the MIG-enabled GPU itself has one
    assert fake.nvmlDeviceGetComputeMode(gpu) == 3


def test_a_lost_gpu_answers_gpu_is_lost(make_fake: MakeFake):
    fake = make_fake("dgx-h100")
    fake.lose_gpu(1)
    h = fake.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetComputeMode(h)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceSetComputeMode(h, 3)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.set_timeslice(h, 1)


def test_timeslice_control(make_fake: MakeFake):
    fake = make_fake("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(5)
    assert fake.get_timeslice(h) == 0
    fake.set_timeslice(h, 3)
    assert make_fake("dgx-h100").get_timeslice(h) == 3
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.set_timeslice(h, 4)


def test_the_calls_need_init(make_fake: MakeFake):
    fake = make_fake("l40s-pcie", init=False)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetComputeMode(None)


def test_the_tools_know_which_file_says_the_node_exists():
    from agent.sim.state import STATE_FILE as NODE_STATE
    from agent.sim.tools.common import NODE_STATE_FILE

    assert NODE_STATE_FILE == NODE_STATE
