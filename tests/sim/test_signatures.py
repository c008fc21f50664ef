"""Every simulated ``nvml*`` function exists in the installed pynvml with a compatible signature."""

import inspect

import pynvml
import pytest

from agent.sim.nvml import FakeNvml

# The calls the agent relies on (the brief for the simulator); each must be simulated.
REQUIRED_TEXT = """
nvmlInit nvmlInitWithFlags nvmlShutdown nvmlSystemGetDriverVersion nvmlSystemGetCudaDriverVersion
nvmlSystemGetCudaDriverVersion_v2 nvmlSystemGetNVMLVersion nvmlDeviceGetCount
nvmlDeviceGetHandleByIndex nvmlDeviceGetHandleByPciBusId nvmlDeviceGetHandleByUUID
nvmlDeviceGetIndex nvmlDeviceGetMinorNumber nvmlDeviceGetUUID nvmlDeviceGetName nvmlDeviceGetBrand
nvmlDeviceGetSerial nvmlDeviceGetArchitecture nvmlDeviceGetCudaComputeCapability
nvmlDeviceGetPciInfo nvmlDeviceGetPciInfo_v3 nvmlDeviceGetMemoryInfo nvmlDeviceGetNumaNodeId
nvmlDeviceGetMigMode nvmlDeviceSetMigMode nvmlDeviceGetGpuInstanceProfileInfo
nvmlDeviceGetGpuInstancePossiblePlacements nvmlDeviceGetGpuInstanceRemainingCapacity
nvmlDeviceCreateGpuInstance nvmlDeviceCreateGpuInstanceWithPlacement nvmlDeviceGetGpuInstances
nvmlDeviceGetGpuInstanceById nvmlGpuInstanceGetInfo nvmlGpuInstanceDestroy
nvmlGpuInstanceGetComputeInstanceProfileInfo nvmlGpuInstanceCreateComputeInstance
nvmlGpuInstanceGetComputeInstances nvmlComputeInstanceGetInfo nvmlComputeInstanceDestroy
nvmlDeviceGetMaxMigDeviceCount nvmlDeviceGetMigDeviceHandleByIndex nvmlDeviceIsMigDeviceHandle
nvmlDeviceGetDeviceHandleFromMigDeviceHandle nvmlDeviceGetGpuInstanceId
nvmlDeviceGetComputeInstanceId nvmlDeviceGetNvLinkState nvmlDeviceGetNvLinkRemotePciInfo
nvmlDeviceGetNvLinkRemoteDeviceType
"""


def words(text: str) -> list[str]:
    return text.split()


REQUIRED = words(REQUIRED_TEXT)


def simulated_calls(cls: type) -> list[str]:
    """Public methods whose names start with ``nvml`` (copied pynvml classes are not methods)."""
    return sorted(
        n for n in dir(cls) if n.startswith("nvml") and inspect.isfunction(getattr(cls, n))
    )


def _shape(params: list[inspect.Parameter]) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in params]


def signature_mismatches(cls: type) -> list[str]:
    """One line per simulated call that pynvml lacks or whose parameters differ from pynvml's."""
    problems = []
    for name in simulated_calls(cls):
        real = getattr(pynvml, name, None)
        if real is None or not inspect.isfunction(real):
            problems.append(f"{name}: not a pynvml function")
            continue
        ours = list(inspect.signature(getattr(cls, name)).parameters.values())[1:]  # minus self
        theirs = list(inspect.signature(real).parameters.values())
        if _shape(ours) != _shape(theirs):
            problems.append(f"{name}: ours {_shape(ours)} != pynvml {_shape(theirs)}")
    return problems


def test_every_simulated_call_matches_pynvml():
    assert signature_mismatches(FakeNvml) == []


@pytest.mark.parametrize("name", REQUIRED, ids=str)
def test_required_call_is_simulated(name):
    assert name in simulated_calls(FakeNvml)
    assert inspect.isfunction(getattr(pynvml, name)), "the brief names a call pynvml lacks"


class WrongFake:
    """Deliberately wrong: renamed parameter, changed default, extra parameter, invented call."""

    def nvmlDeviceGetHandleByIndex(self, idx):
        raise NotImplementedError

    def nvmlDeviceGetMemoryInfo(self, handle, version=2):
        raise NotImplementedError

    def nvmlDeviceGetUUID(self, handle, length):
        raise NotImplementedError

    def nvmlDeviceGetMadeUpThing(self, handle):
        raise NotImplementedError

    def nvmlDeviceGetName(self, handle):  # correct: must not be reported
        raise NotImplementedError


def test_the_check_catches_wrong_signatures():
    problems = signature_mismatches(WrongFake)
    reported = sorted(p.split(":")[0] for p in problems)
    assert reported == [
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetMadeUpThing",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetUUID",
    ]


def test_copied_pynvml_classes_are_not_counted_as_calls():
    assert FakeNvml.nvmlPciInfo_t is pynvml.nvmlPciInfo_t
    assert "nvmlPciInfo_t" not in simulated_calls(FakeNvml)
