"""The simulated driver state: persistence, sharing between processes, layouts."""

import json
import subprocess
import sys
import textwrap

import pynvml
import pytest

from agent.errors import ConfigError
from agent.sim import layouts
from agent.sim.model import load_model
from agent.sim.specs import gpu_specs
from agent.sim.state import (
    STATE_FILE,
    GpuState,
    StateFormatError,
    initial_state,
    state_from_json,
    state_to_json,
)


def mig_names(fake, index: int) -> list[str]:
    """Profile names of the GPU's MIG devices, in MIG-device index order."""
    h = fake.nvmlDeviceGetHandleByIndex(index)
    names = []
    for i in range(fake.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            m = fake.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        except pynvml.NVMLError_NotFound:
            continue
        names.append(fake.nvmlDeviceGetName(m).split(" MIG ")[1])
    return names


# -- layouts --------------------------------------------------------------------------------------


def test_dgx_a100_default_is_balanced(make_fake):
    fake = make_fake("dgx-a100")
    for i in range(8):
        assert mig_names(fake, i) == ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]
        h = fake.nvmlDeviceGetHandleByIndex(i)
        gi = fake.nvmlDeviceGetGpuInstanceById(h, 1)
        assert fake.nvmlGpuInstanceGetInfo(gi).placement.start == 4  # the 3g had to go high


@pytest.mark.parametrize(
    ("layout", "names"),
    [
        ("none", []),
        ("balanced", ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]),
        ("all-1g", ["1g.10gb"] * 7),
        ("all-7g", ["7g.80gb"]),
    ],
    ids=str,
)
def test_named_layouts_on_h100(make_fake, layout, names):
    fake = make_fake("dgx-h100", mig_layout=layout)
    h = fake.nvmlDeviceGetHandleByIndex(5)
    assert fake.nvmlDeviceGetMigMode(h) == ([0, 0] if layout == "none" else [1, 1])
    assert mig_names(fake, 5) == names


def test_layouts_leave_gpus_without_mig_alone(make_fake):
    fake = make_fake("mixed", mig_layout="balanced")
    assert mig_names(fake, 0) == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetMigMode(fake.nvmlDeviceGetHandleByIndex(2))


def test_unknown_layout_is_a_config_error(make_fake, state_dir):
    with pytest.raises(ConfigError, match=r"'half'.*none, balanced, all-1g, all-7g"):
        make_fake("dgx-a100", mig_layout="half")
    assert not state_dir.exists(), "nothing may be written for a bad layout name"


def test_plan_placements_backtracks():
    spec = gpu_specs()["A100-SXM4-40GB"]
    gpu = GpuState(index=0, uuid="GPU-x", mig_current=True, mig_pending=True)
    assert layouts.plan_placements(gpu, spec, (9, 14, 19, 19)) == [4, 0, 2, 3]
    assert layouts.plan_placements(gpu, spec, (5, 5)) is None


def test_apply_layout_is_pure():
    model = load_model("dgx-a100")
    before = initial_state(model)
    after = layouts.apply_layout(before, model, "all-7g")
    assert before == initial_state(model)
    assert after == layouts.apply_layout(before, model, "all-7g")
    assert all(len(g.gpu_instances) == 1 for g in after.gpus)


# -- persistence ----------------------------------------------------------------------------------


def test_state_survives_a_restart(make_fake, state_dir):
    first = make_fake("dgx-h100")
    h = first.nvmlDeviceGetHandleByIndex(0)
    first.nvmlDeviceSetMigMode(h, 1)
    gi = first.nvmlDeviceCreateGpuInstance(h, 9)
    first.nvmlGpuInstanceCreateComputeInstance(gi, 2)
    uuid = first.nvmlDeviceGetUUID(first.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
    del first
    second = make_fake("dgx-h100")  # no mig_layout given: keep what is there
    h = second.nvmlDeviceGetHandleByIndex(0)
    assert second.nvmlDeviceGetMigMode(h) == [1, 1]
    assert mig_names(second, 0) == ["3g.40gb"]
    assert second.nvmlDeviceGetUUID(second.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)) == uuid
    assert not list(state_dir.glob(".nvml-state.*")), "no temporary files left behind"


def test_a100_pending_mode_survives_a_restart(make_fake):
    first = make_fake("dgx-a100", mig_layout="none")
    first.nvmlDeviceSetMigMode(first.nvmlDeviceGetHandleByIndex(0), 1)
    second = make_fake("dgx-a100")
    assert second.nvmlDeviceGetMigMode(second.nvmlDeviceGetHandleByIndex(0)) == [0, 1]


def test_explicit_layout_is_reapplied_on_an_existing_directory(make_fake):
    first = make_fake("dgx-a100")  # balanced
    h = first.nvmlDeviceGetHandleByIndex(0)
    m = first.nvmlDeviceGetMigDeviceHandleByIndex(h, 3)
    gi = first.nvmlDeviceGetGpuInstanceById(h, first.nvmlDeviceGetGpuInstanceId(m))
    ci = first.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
    first.nvmlComputeInstanceDestroy(ci)
    first.nvmlGpuInstanceDestroy(gi)
    assert mig_names(make_fake("dgx-a100"), 0) == ["3g.20gb", "2g.10gb", "1g.5gb"]
    again = make_fake("dgx-a100", mig_layout="balanced")
    assert mig_names(again, 0) == ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]
    assert mig_names(make_fake("dgx-a100", mig_layout="all-1g"), 0) == ["1g.5gb"] * 7


def test_corrupt_state_file_is_set_aside(make_fake, state_dir):
    state_dir.mkdir()
    (state_dir / STATE_FILE).write_text("{not json")
    fake = make_fake("dgx-a100")
    assert mig_names(fake, 0) == ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]  # fresh: the default
    assert (state_dir / (STATE_FILE + ".corrupt")).read_text() == "{not json"
    assert json.loads((state_dir / STATE_FILE).read_text())["model"] == "dgx-a100"


def test_state_of_another_model_starts_fresh(make_fake):
    make_fake("dgx-h100", mig_layout="all-7g")
    fake = make_fake("dgx-a100")
    assert mig_names(fake, 0) == ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]
    assert fake.state.model == "dgx-a100"


def test_a_corrupted_file_under_a_running_fake_is_ignored(make_fake, state_dir):
    fake = make_fake("dgx-a100")
    (state_dir / STATE_FILE).write_text("[]")
    assert mig_names(fake, 0) == ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]  # kept its last state


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"apiVersion": "tessera.sim/v0", "kind": "NvmlState", "model": "x", "gpus": []},
        {"apiVersion": "tessera.sim/v1", "kind": "NvmlState", "model": "x"},
        {
            "apiVersion": "tessera.sim/v1",
            "kind": "NvmlState",
            "model": "x",
            "gpus": [
                {"index": "0", "uuid": "u", "migCurrent": 1, "migPending": 0, "gpuInstances": []}
            ],
        },
    ],
    ids=["list", "old-version", "no-gpus", "wrong-types"],
)
def test_state_decoding_rejects_bad_documents(raw):
    with pytest.raises(StateFormatError):
        state_from_json(raw)


def test_state_json_round_trip():
    model = load_model("dgx-a100")
    state = layouts.apply_layout(initial_state(model), model, "balanced")
    assert state_from_json(json.loads(json.dumps(state_to_json(state)))) == state


# -- sharing --------------------------------------------------------------------------------------


def test_two_fakes_on_one_directory_see_each_others_changes(make_fake):
    a = make_fake("dgx-h100")
    b = make_fake("dgx-h100")
    ha, hb = a.nvmlDeviceGetHandleByIndex(7), b.nvmlDeviceGetHandleByIndex(7)
    a.nvmlDeviceSetMigMode(ha, 1)
    assert b.nvmlDeviceGetMigMode(hb) == [1, 1]
    gi = b.nvmlDeviceCreateGpuInstance(hb, 0)
    b.nvmlGpuInstanceCreateComputeInstance(gi, 4)
    assert mig_names(a, 7) == ["7g.80gb"]
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # a sees b's 7g
        a.nvmlDeviceCreateGpuInstance(ha, 19)


def test_another_process_sees_and_changes_the_same_state(make_fake, state_dir):
    fake = make_fake("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(2)
    fake.nvmlDeviceSetMigMode(h, 1)
    script = textwrap.dedent(
        f"""
        from agent.sim.model import load_model
        from agent.sim.nvml import FakeNvml
        f = FakeNvml(load_model("dgx-h100"), {str(state_dir)!r})
        f.nvmlInit()
        h = f.nvmlDeviceGetHandleByIndex(2)
        assert f.nvmlDeviceGetMigMode(h) == [1, 1]
        for _ in range(2):
            gi = f.nvmlDeviceCreateGpuInstance(h, 9)
            f.nvmlGpuInstanceCreateComputeInstance(gi, 2)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert mig_names(fake, 2) == ["3g.40gb", "3g.40gb"]


def test_concurrent_processes_do_not_lose_updates(make_fake, state_dir):
    """Each mutation is lock -> reload -> change -> save: two writers at once lose nothing."""
    fake = make_fake("dgx-h100")
    fake.nvmlDeviceSetMigMode(fake.nvmlDeviceGetHandleByIndex(0), 1)
    script = textwrap.dedent(
        f"""
        from agent.sim.model import load_model
        from agent.sim.nvml import FakeNvml
        f = FakeNvml(load_model("dgx-h100"), {str(state_dir)!r})
        f.nvmlInit()
        h = f.nvmlDeviceGetHandleByIndex(0)
        for _ in range(3):
            f.nvmlDeviceCreateGpuInstance(h, 19)
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    gis = fake.state.gpus[0].gpu_instances
    assert sorted(gi.id for gi in gis) == [1, 2, 3, 4, 5, 6]
    assert sorted(gi.start for gi in gis) == [1, 2, 3, 4, 5, 6]


def test_reset_gpu_of_an_unknown_index_is_a_config_error(make_fake):
    with pytest.raises(ConfigError, match="GPU index 8"):
        make_fake("dgx-h100").reset_gpu(8)
