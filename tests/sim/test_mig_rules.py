"""The simulated driver follows the MIG rules of docs/gpu-facts.md (via pynvml calls)."""

import ctypes

import pynvml
import pytest

from agent.sim.specs import gpu_specs

# (product, a model that has it); GPU 0 of each model is that product.
MIG_GPUS = [
    pytest.param(("A100-SXM4-40GB", "dgx-a100"), id="A100-40GB"),
    pytest.param(("H100-SXM5-80GB", "dgx-h100"), id="H100"),
    pytest.param(("H200-SXM5-141GB", "hgx-h200"), id="H200"),
]

# gpu-facts.md, MIG geometry: profile id -> (enum, starts, memory slots, max instances).
FACTS = {
    19: (0x0, (0, 1, 2, 3, 4, 5, 6), 1, 7),
    20: (0x7, (0, 1, 2, 3, 4, 5, 6), 1, 1),
    15: (0x9, (0, 2, 4, 6), 2, 4),
    14: (0x1, (0, 2, 4), 2, 3),
    9: (0x2, (0, 4), 4, 2),
    5: (0x3, (0,), 4, 1),
    0: (0x4, (0,), 8, 1),
}

E = pynvml  # error classes and constants


def placement(start: int, size: int):
    return ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size))


def slots(profile_id: int) -> int:
    return FACTS[profile_id][2]


@pytest.fixture(params=MIG_GPUS)
def gpu(request, make_fake):
    """(fake, GPU 0 handle, spec) with MIG enabled and no instances."""
    product, model = request.param
    fake = make_fake(model, mig_layout="none")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE)
    if fake.nvmlDeviceGetMigMode(h)[0] != 1:
        fake.reset_gpu(0)  # Ampere: the mode change waits for a GPU reset
    assert fake.nvmlDeviceGetMigMode(h) == [1, 1]
    return fake, h, gpu_specs()[product]


def gi_info(fake, gi):
    info = fake.nvmlGpuInstanceGetInfo(gi)
    return info.profileId, info.placement.start, info.placement.size


def occupied(fake, h) -> list[tuple[int, int, int]]:
    """(profile id, start, size) of every GI of the GPU."""
    out = []
    for pid in FACTS:
        arr = (pynvml.c_nvmlGpuInstance_t * 8)()
        n = ctypes.c_uint()
        fake.nvmlDeviceGetGpuInstances(h, pid, arr, ctypes.byref(n))
        out += [gi_info(fake, arr[i]) for i in range(n.value)]
    return sorted(out, key=lambda x: x[1])


# -- the profile table ----------------------------------------------------------------------------


def test_profile_info_and_possible_placements_match_the_facts(gpu):
    fake, h, spec = gpu
    for pid, (enum, starts, size, max_n) in FACTS.items():
        info = fake.nvmlDeviceGetGpuInstanceProfileInfo(h, enum)
        assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
        assert (info.id, info.instanceCount) == (pid, max_n)
        assert info.memorySizeMB == spec.profile(pid).memory_mib  # MiB
        assert info.name == f"MIG {spec.profile(pid).name}"
        arr = (pynvml.c_nvmlGpuInstancePlacement_t * 8)()
        n = ctypes.c_uint()
        assert fake.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, arr, ctypes.byref(n)) == 0
        assert [(arr[i].start, arr[i].size) for i in range(n.value)] == [(s, size) for s in starts]


def test_possible_placements_count_only_and_too_small_array(gpu):
    fake, h, _ = gpu
    n = ctypes.c_uint()
    fake.nvmlDeviceGetGpuInstancePossiblePlacements(h, 19, None, ctypes.byref(n))
    assert n.value == 7
    small = (pynvml.c_nvmlGpuInstancePlacement_t * 2)()
    with pytest.raises(E.NVMLError_InsufficientSize):
        fake.nvmlDeviceGetGpuInstancePossiblePlacements(h, 19, small, ctypes.byref(n))
    with pytest.raises(E.NVMLError_InvalidArgument):  # count passed by value, not byref
        fake.nvmlDeviceGetGpuInstancePossiblePlacements(h, 19, None, n)


@pytest.mark.parametrize(
    ("enum", "error"),
    [
        pytest.param(pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE, E.NVMLError_NotSupported, id="8g"),
        pytest.param(
            pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1, E.NVMLError_NotSupported, id="2g-rev1"
        ),
        pytest.param(
            pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT, E.NVMLError_InvalidArgument, id="count"
        ),
        pytest.param(0x1000, E.NVMLError_InvalidArgument, id="huge"),
    ],
)
def test_profile_enums_the_gpu_lacks(gpu, enum, error):
    fake, h, _ = gpu
    with pytest.raises(error):
        fake.nvmlDeviceGetGpuInstanceProfileInfo(h, enum)


def test_profile_info_is_there_while_mig_is_disabled(make_fake):
    fake = make_fake("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetMigMode(h) == [0, 0]
    assert fake.nvmlDeviceGetGpuInstanceProfileInfo(h, 0x0).id == 19
    assert fake.nvmlDeviceGetGpuInstanceProfileInfo(h, 0x0, 1).id == 19  # version 1 struct


@pytest.mark.parametrize("pid", list(FACTS), ids=lambda p: f"profile{p}")
def test_every_placement_of_the_table_can_be_created_on_an_empty_gpu(gpu, pid):
    fake, h, _ = gpu
    for start in FACTS[pid][1]:
        gi = fake.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, placement(start, slots(pid)))
        assert isinstance(gi, pynvml.c_nvmlGpuInstance_t)
        assert gi_info(fake, gi) == (pid, start, slots(pid))
        assert fake.nvmlGpuInstanceDestroy(gi) == pynvml.NVML_SUCCESS
    assert occupied(fake, h) == []


# -- whole layouts --------------------------------------------------------------------------------

LEGAL = {
    "7x1g": [(19, s) for s in range(7)],
    "3g+2g+1g+1g": [(9, 4), (14, 0), (19, 2), (19, 3)],
    "4g+3g": [(5, 0), (9, 4)],
    "3g+3g": [(9, 0), (9, 4)],
    "2g+2g+2g+1g": [(14, 0), (14, 2), (14, 4), (19, 6)],
    "4x1g.10gb": [(15, s) for s in (0, 2, 4, 6)],
    "7g": [(0, 0)],
    "1g+me+6x1g": [(20, 0)] + [(19, s) for s in range(1, 7)],
}


SLICES = {19: 1, 20: 1, 15: 1, 14: 2, 9: 3, 5: 4, 0: 7}
FULL_CI = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}  # compute slices -> CI profile id (= enum)


@pytest.mark.parametrize("layout", list(LEGAL), ids=str)
def test_legal_layouts_with_placements(gpu, layout):
    fake, h, _ = gpu
    for pid, start in LEGAL[layout]:
        gi = fake.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, placement(start, slots(pid)))
        fake.nvmlGpuInstanceCreateComputeInstance(gi, FULL_CI[SLICES[pid]])
    want = sorted(((pid, s, slots(pid)) for pid, s in LEGAL[layout]), key=lambda x: x[1])
    assert occupied(fake, h) == want
    mig_devices = [fake.nvmlDeviceGetMigDeviceHandleByIndex(h, i) for i in range(len(want))]
    assert len({fake.nvmlDeviceGetUUID(m) for m in mig_devices}) == len(want)


@pytest.mark.parametrize(
    "order",
    [[19] * 7, [9, 14, 19, 19], [5, 9], [9, 9], [14, 14, 14, 19], [15] * 4, [0]],
    ids=lambda o: "+".join(map(str, o)),
)
def test_legal_layouts_without_placements_in_a_good_order(gpu, order):
    fake, h, _ = gpu
    for pid in order:
        fake.nvmlDeviceCreateGpuInstance(h, pid)
    assert len(occupied(fake, h)) == len(order)


def test_the_3g_must_come_first_in_3_2_1_1(gpu):
    """gpu-facts: the driver's own placement makes a late 3g fail (A100 quirk)."""
    fake, h, _ = gpu
    for pid in (14, 19, 19):
        fake.nvmlDeviceCreateGpuInstance(h, pid)
    with pytest.raises(E.NVMLError_InsufficientResources):
        fake.nvmlDeviceCreateGpuInstance(h, 9)


ILLEGAL = {
    "overlap": ([(9, 0)], (14, 2), E.NVMLError_InsufficientResources),
    "start-not-in-table": ([], (9, 2), E.NVMLError_InvalidArgument),
    "2g-at-6": ([], (14, 6), E.NVMLError_InvalidArgument),
    "second-me": ([(20, 0)], (20, 3), E.NVMLError_InsufficientResources),
    "8th-1g": ([(19, s) for s in range(7)], (19, 6), E.NVMLError_InsufficientResources),
    "4g+4g": ([(5, 0)], (5, 0), E.NVMLError_InsufficientResources),
    "7g-on-1g": ([(19, 6)], (0, 0), E.NVMLError_InsufficientResources),
    "unknown-profile": ([], (99, 0), E.NVMLError_InvalidArgument),
}


@pytest.mark.parametrize("case", list(ILLEGAL), ids=str)
def test_illegal_creations_are_refused(gpu, case):
    fake, h, _ = gpu
    before, (pid, start), error = ILLEGAL[case]
    for p, s in before:
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(h, p, placement(s, slots(p)))
    size = slots(pid) if pid in FACTS else 1
    with pytest.raises(error):
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, placement(start, size))
    assert len(occupied(fake, h)) == len(before), "a refused create must change nothing"


def test_wrong_placement_size_and_argument_form(gpu):
    fake, h, _ = gpu
    with pytest.raises(E.NVMLError_InvalidArgument):
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, placement(0, 2))
    with pytest.raises(E.NVMLError_InvalidArgument):  # the struct itself, not byref(struct)
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(
            h, 9, pynvml.c_nvmlGpuInstancePlacement_t(0, 4)
        )


def test_8th_1g_without_placement(gpu):
    fake, h, _ = gpu
    for _ in range(7):
        fake.nvmlDeviceCreateGpuInstance(h, 19)
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 0
    with pytest.raises(E.NVMLError_InsufficientResources):
        fake.nvmlDeviceCreateGpuInstance(h, 19)


def test_remaining_capacity(gpu):
    fake, h, _ = gpu
    assert {pid: fake.nvmlDeviceGetGpuInstanceRemainingCapacity(h, pid) for pid in FACTS} == {
        pid: f[3] for pid, f in FACTS.items()
    }
    fake.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, placement(4, 4))
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 4
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 9) == 1
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 5) == 1  # 4g+3g
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 0) == 0


# -- ids, destroy order ---------------------------------------------------------------------------


def test_gi_with_a_ci_cannot_be_destroyed(gpu):
    fake, h, _ = gpu
    gi = fake.nvmlDeviceCreateGpuInstance(h, 9)
    ci = fake.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    with pytest.raises(E.NVMLError_InUse):
        fake.nvmlGpuInstanceDestroy(gi)
    assert fake.nvmlComputeInstanceDestroy(ci) == pynvml.NVML_SUCCESS
    fake.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(E.NVMLError_InvalidArgument):  # the handle is stale now
        fake.nvmlGpuInstanceGetInfo(gi)


def test_gi_ids_come_from_the_driver_and_are_reused(gpu):
    fake, h, _ = gpu
    gis = [fake.nvmlDeviceCreateGpuInstance(h, 19) for _ in range(3)]
    ids = [fake.nvmlGpuInstanceGetInfo(g).id for g in gis]
    assert ids == [1, 2, 3]
    starts = [fake.nvmlGpuInstanceGetInfo(g).placement.start for g in gis]
    assert starts == [6, 5, 4], "without a placement the driver takes the highest free start"
    fake.nvmlGpuInstanceDestroy(gis[1])
    again = fake.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, placement(0, 1))
    assert fake.nvmlGpuInstanceGetInfo(again).id == 2
    assert fake.nvmlDeviceGetGpuInstanceById(h, 2) == again
    with pytest.raises(E.NVMLError_NotFound):
        fake.nvmlDeviceGetGpuInstanceById(h, 9)


# -- compute instances ----------------------------------------------------------------------------


CI_OFFERS = {  # GI profile -> {CI profile id: instance count}; 4g has no 3c
    0: {0: 7, 1: 3, 2: 2, 3: 1, 4: 1},
    5: {0: 4, 1: 2, 3: 1},
    9: {0: 3, 1: 1, 2: 1},
    14: {0: 2, 1: 1},
    19: {0: 1},
}


@pytest.mark.parametrize("gi_pid", list(CI_OFFERS), ids=lambda p: f"gi{p}")
def test_compute_instance_profiles(gpu, gi_pid):
    fake, h, _ = gpu
    gi = fake.nvmlDeviceCreateGpuInstance(h, gi_pid)
    shared = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    offered = {}
    for ci_pid in range(5):
        try:
            info = fake.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_pid, shared)
        except pynvml.NVMLError_NotSupported:
            continue
        assert info.id == ci_pid
        offered[ci_pid] = info.instanceCount
    assert offered == CI_OFFERS[gi_pid]
    with pytest.raises(E.NVMLError_InvalidArgument):
        fake.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 99, shared)


def test_compute_instances_in_a_7g(gpu):
    fake, h, spec = gpu
    gi = fake.nvmlDeviceCreateGpuInstance(h, 0)
    cis = [fake.nvmlGpuInstanceCreateComputeInstance(gi, 0) for _ in range(7)]
    assert [fake.nvmlComputeInstanceGetInfo(c).id for c in cis] == list(range(7))
    assert [fake.nvmlComputeInstanceGetInfo(c).placement.start for c in cis] == list(range(7))
    with pytest.raises(E.NVMLError_InsufficientResources):
        fake.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    arr = (pynvml.c_nvmlComputeInstance_t * 7)()
    n = ctypes.c_uint()
    fake.nvmlGpuInstanceGetComputeInstances(gi, 0, arr, ctypes.byref(n))
    assert n.value == 7 and [arr[i] for i in range(7)] == cis
    # seven MIG devices now, one per compute instance, all of the 7g's memory
    assert fake.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    for i in range(7):
        m = fake.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        assert fake.nvmlDeviceGetComputeInstanceId(m) == i
        assert fake.nvmlDeviceGetMemoryInfo(m).total == spec.profile(0).memory_mib * 1024 * 1024


def test_default_ci_uses_all_slices(gpu):
    fake, h, _ = gpu
    gi = fake.nvmlDeviceCreateGpuInstance(h, 9)
    ci = fake.nvmlGpuInstanceCreateComputeInstance(gi, 2)  # 3c in a 3g
    info = fake.nvmlComputeInstanceGetInfo(ci)
    assert (info.placement.start, info.placement.size) == (0, 3)
    assert fake.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 0) == 0
    assert fake.nvmlDeviceGetGpuInstanceId(fake.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)) == 1


# -- MIG mode -------------------------------------------------------------------------------------


def test_a100_mode_change_is_pending_until_reset(make_fake):
    fake = make_fake("dgx-a100", mig_layout="none")
    h = fake.nvmlDeviceGetHandleByIndex(2)
    status = fake.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert status == pynvml.NVML_ERROR_RESET_REQUIRED
    assert fake.nvmlDeviceGetMigMode(h) == [0, 1]
    with pytest.raises(E.NVMLError_NotSupported):  # MIG is not on yet
        fake.nvmlDeviceCreateGpuInstance(h, 19)
    fake.reset_gpu(2)
    assert fake.nvmlDeviceGetMigMode(h) == [1, 1]
    gi = fake.nvmlDeviceCreateGpuInstance(h, 19)
    with pytest.raises(E.NVMLError_InUse):
        fake.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE)
    fake.nvmlGpuInstanceDestroy(gi)
    assert fake.nvmlDeviceSetMigMode(h, 0) == pynvml.NVML_ERROR_RESET_REQUIRED
    assert fake.nvmlDeviceGetMigMode(h) == [1, 0]
    fake.reset_gpu(2)
    assert fake.nvmlDeviceGetMigMode(h) == [0, 0]
    assert fake.nvmlDeviceGetMigMode(fake.nvmlDeviceGetHandleByIndex(1)) == [0, 0]


def test_reset_destroys_mig_instances(make_fake):
    fake = make_fake("dgx-a100")  # balanced
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.reset_gpu(0)
    assert fake.nvmlDeviceGetMigMode(h) == [1, 1]
    with pytest.raises(E.NVMLError_NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)


@pytest.mark.parametrize("model", ["dgx-h100", "hgx-h200"], ids=str)
def test_hopper_toggles_when_idle_and_refuses_with_instances(make_fake, model):
    fake = make_fake(model)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceSetMigMode(h, 1) == pynvml.NVML_SUCCESS
    assert fake.nvmlDeviceGetMigMode(h) == [1, 1]
    gi = fake.nvmlDeviceCreateGpuInstance(h, 0)
    with pytest.raises(E.NVMLError_InUse):
        fake.nvmlDeviceSetMigMode(h, 0)
    assert fake.nvmlDeviceGetMigMode(h) == [1, 1]
    fake.nvmlGpuInstanceDestroy(gi)
    assert fake.nvmlDeviceSetMigMode(h, 0) == pynvml.NVML_SUCCESS
    assert fake.nvmlDeviceGetMigMode(h) == [0, 0]
    with pytest.raises(E.NVMLError_InvalidArgument):
        fake.nvmlDeviceSetMigMode(h, 2)


@pytest.mark.parametrize(
    "call",
    [
        "nvmlDeviceCreateGpuInstance",
        "nvmlDeviceGetGpuInstanceRemainingCapacity",
        "nvmlDeviceGetGpuInstanceById",
        "nvmlDeviceGetMigDeviceHandleByIndex",
    ],
    ids=str,
)
def test_instance_calls_with_mig_disabled_are_not_supported(make_fake, call):
    fake = make_fake("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(E.NVMLError_NotSupported):
        getattr(fake, call)(h, 1)
    assert fake.nvmlDeviceGetMaxMigDeviceCount(h) == 0


# -- GPUs without MIG -----------------------------------------------------------------------------

NO_MIG_CALLS = {
    "GetMigMode": lambda f, h: f.nvmlDeviceGetMigMode(h),
    "SetMigMode": lambda f, h: f.nvmlDeviceSetMigMode(h, 1),
    "ProfileInfo": lambda f, h: f.nvmlDeviceGetGpuInstanceProfileInfo(h, 0),
    "Placements": lambda f, h: f.nvmlDeviceGetGpuInstancePossiblePlacements(
        h, 19, None, ctypes.byref(ctypes.c_uint())
    ),
    "Create": lambda f, h: f.nvmlDeviceCreateGpuInstance(h, 19),
    "Capacity": lambda f, h: f.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19),
    "MigHandle": lambda f, h: f.nvmlDeviceGetMigDeviceHandleByIndex(h, 0),
}


@pytest.mark.parametrize(("model", "index"), [("l40s-pcie", 0), ("mixed", 2)], ids=["L40S", "L4"])
@pytest.mark.parametrize("call", list(NO_MIG_CALLS), ids=str)
def test_gpus_without_mig_answer_not_supported(make_fake, model, index, call):
    fake = make_fake(model)
    h = fake.nvmlDeviceGetHandleByIndex(index)
    with pytest.raises(E.NVMLError_NotSupported):
        NO_MIG_CALLS[call](fake, h)
    assert fake.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    assert fake.nvmlDeviceIsMigDeviceHandle(h).value == 0
