"""The fast slice of the crash matrix (tests/crashmatrix.py; the whole matrix runs in `make
reliability`): a crash inside a batch of whole GPUs and one inside a batch of dynamic MIG
devices (a GPU instance made, its compute instance not), in a batch of power-capped GPUs on
either side of the cap, in a batch of GPUs handed to VMs (one unbound from nvidia, not yet on
vfio-pci), in a batch of vGPUs (one made, its claim not completed) and in a VM claim's unprepare
(its GPU back on nvidia, the claim still recorded), each restarted, retried and checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.crashmatrix import BY_NAME, MODES, POINTS, SHAPES, cells, run_cell


@pytest.mark.parametrize(
    ("mode", "point"),
    [
        ("whole-gpu", "after-cdi"),
        ("dynamic-mig", "after-gi-create"),
        ("power-limit", "after-power-recorded"),  # the limit to set back durable, not yet capped
        ("power-limit", "after-power-limit"),  # capped, the claim not yet completed
    ],
)
def test_a_crash_inside_a_batch_leaves_a_node_the_retries_make_whole(
    short_tmp: Path, mode: str, point: str
) -> None:
    out = run_cell(short_tmp, BY_NAME[mode], point, "batch")
    assert out.problems == [], "\n".join(out.problems)
    assert out.fired_in == "prepare" and out.crashes == 1


def test_a_gpu_left_between_its_drivers_by_a_crash_goes_back_to_nvidia(short_tmp: Path) -> None:
    """A batch of passthrough claims killed at the second unbind (the claims of other GPUs are
    prepared side by side, so others may be on vfio-pci or unbound too): a GPU is bound to no
    driver (NVIDIA's let go of it, vfio-pci not yet bound). The start rolls its claim back,
    giving the GPU back to nvidia; the retry hands it to the VM again; at the end every GPU is
    on nvidia with no driver_override (tests/crashnode_vm.py)."""
    out = run_cell(short_tmp, BY_NAME["passthrough"], "after-vfio-unbind", "batch")
    assert out.problems == [], "\n".join(out.problems)
    assert out.fired_in == "prepare" and out.crashes == 1
    drivers = out.drivers_at_crash
    assert None in drivers.values() and set(drivers.values()) <= {"nvidia", "vfio-pci", None}, (
        drivers
    )


def test_a_vgpu_made_before_a_crash_is_removed_or_kept_as_recorded(short_tmp: Path) -> None:
    """A batch of vGPU claims (SR-IOV VFs) killed after its second vGPU was made, its claim not
    yet completed: the start removes it with the claim's rollback (nothing holds a VF no claim
    records), the retry makes it again, and the unprepare leaves no vGPU."""
    out = run_cell(short_tmp, BY_NAME["vgpu-vf"], "after-vgpu-create", "batch")
    assert out.problems == [], "\n".join(out.problems)
    assert out.fired_in == "prepare" and out.crashes == 1
    assert set(out.drivers_at_crash.values()) == {"nvidia"}, out.drivers_at_crash


def test_the_matrix_covers_every_point_in_every_mode() -> None:
    """Every crash point the driver has is armed in every mode (a batch at least), and a mode's
    unreachable points are points the driver has: a renamed point cannot leave a stale entry
    that silently stops covering it."""
    run = set(cells())
    for m in MODES:
        assert m.unreachable <= set(POINTS), f"{m.name}: {sorted(m.unreachable - set(POINTS))}"
        for point in POINTS:
            assert (m.name, point, "batch") in run
            assert ((m.name, point, "single") in run) == (point not in m.unreachable)
        assert len(m.batch) >= 3 and len(m.single) == 1
    assert set(BY_NAME) == {m.name for m in MODES} and SHAPES == ("single", "batch")


def test_a_vm_claim_bound_again_at_start_leaves_the_other_gpus_readable(short_tmp: Path) -> None:
    """An unprepare killed after it gave the GPU back to nvidia, its claim still recorded: the
    start binds the GPU to vfio-pci again (the claim is the kubelet's until it retries), so NVML
    loses it and the other GPUs' indexes shift. No other GPU may be reported lost for it (the
    node is read again after the start's repair); the retry gives the GPU back."""
    out = run_cell(short_tmp, BY_NAME["passthrough"], "after-unprepare-undo", "single")
    assert out.problems == [], "\n".join(out.problems)
    assert out.fired_in == "unprepare" and out.crashes == 1
    assert set(out.drivers_at_crash.values()) == {"nvidia"}, out.drivers_at_crash
