"""The NVML boundary (``agent.nvml.api.NvmlApi``) against the installed pynvml and the simulator.

mypy cannot see into pynvml (it is untyped), so these tests prove what the Protocol claims about
it: every Protocol function is a pynvml function with the same parameters, every constant and
type exists, every struct shape names fields of pynvml's ctypes struct with matching kinds. The
simulator implements every Protocol function with pynvml's exact signature (mypy checks its
types), and every simulated ``nvml*`` function matches pynvml.
"""

import ctypes
import inspect
import types
import typing
from typing import Protocol

import pynvml
import pytest

from agent.nvml import api_types as api
from agent.nvml.api import NvmlApi, api_attributes, api_functions
from agent.sim.nvml import FakeNvml

PROTOCOL_FUNCTIONS = api_functions()


def simulated_calls(cls: type) -> list[str]:
    """Public methods whose names start with ``nvml`` (copied pynvml classes are not methods)."""
    return sorted(
        n for n in dir(cls) if n.startswith("nvml") and inspect.isfunction(getattr(cls, n))
    )


Shape = list[tuple[str, object, object]]


def _shape(params: list[inspect.Parameter]) -> Shape:
    return [(p.name, p.kind, p.default) for p in params]


def _method_shape(fn: typing.Callable[..., object]) -> Shape:
    return _shape(list(inspect.signature(fn).parameters.values())[1:])  # minus self


def _pynvml_shape(name: str) -> Shape | None:
    real = getattr(pynvml, name, None)
    if real is None or not inspect.isfunction(real):
        return None
    return _shape(list(inspect.signature(real).parameters.values()))


def signature_mismatches(cls: type) -> list[str]:
    """One line per simulated call that pynvml lacks or whose parameters differ from pynvml's."""
    problems = []
    for name in simulated_calls(cls):
        theirs = _pynvml_shape(name)
        if theirs is None:
            problems.append(f"{name}: not a pynvml function")
            continue
        ours = _method_shape(getattr(cls, name))
        if ours != theirs:
            problems.append(f"{name}: ours {ours} != pynvml {theirs}")
    return problems


def _overload_fits(overload: Shape, theirs: Shape) -> bool:
    """An overload may make a defaulted parameter required, nothing else."""
    if [(n, k) for n, k, _ in overload] != [(n, k) for n, k, _ in theirs]:
        return False
    return all(
        d in (e, inspect.Parameter.empty)
        for (_, _, d), (_, _, e) in zip(overload, theirs, strict=True)
    )


def protocol_mismatches(protocol: type, names: typing.Iterable[str]) -> list[str]:
    """One line per Protocol function pynvml lacks, or whose parameters (or any overload's)
    differ from pynvml's (names, kinds, defaults)."""
    problems = []
    for name in names:
        theirs = _pynvml_shape(name)
        if theirs is None:
            problems.append(f"{name}: not a pynvml function")
            continue
        fn = vars(protocol)[name]
        ours = _method_shape(fn)
        if ours != theirs:
            problems.append(f"{name}: ours {ours} != pynvml {theirs}")
        for item in typing.get_overloads(fn):
            if not _overload_fits(_method_shape(item), theirs):
                problems.append(f"{name}: overload {_method_shape(item)} != pynvml {theirs}")
    return problems


# -- the Protocol's functions -------------------------------------------------------------------


def test_the_protocol_declares_the_calls():
    assert len(PROTOCOL_FUNCTIONS) == 69  # 61 + seven vGPU host calls + persistence mode (issue 24)
    assert {"nvmlInit", "nvmlDeviceGetMemoryInfo", "nvmlGpmMetricsGet"} <= set(PROTOCOL_FUNCTIONS)


def test_every_protocol_function_matches_pynvml():
    assert protocol_mismatches(NvmlApi, PROTOCOL_FUNCTIONS) == []


@pytest.mark.parametrize("name", PROTOCOL_FUNCTIONS, ids=str)
def test_the_simulator_implements_the_protocol_function(name):
    """With pynvml's exact signature (test_every_simulated_call_matches_pynvml)."""
    assert name in simulated_calls(FakeNvml)
    assert _method_shape(getattr(FakeNvml, name)) == _pynvml_shape(name)


def test_every_simulated_call_matches_pynvml():
    assert signature_mismatches(FakeNvml) == []


class WrongApi(Protocol):
    """Deliberately wrong: renamed parameter, changed default, wrong overload, invented call."""

    def nvmlDeviceGetHandleByIndex(self, idx: int) -> object: ...

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: object, profile: int, version: int = 1
    ) -> object: ...

    @typing.overload
    def nvmlDeviceGetMemoryInfo(self, handle: object, version: int = 2) -> object: ...

    @typing.overload
    def nvmlDeviceGetMemoryInfo(self, handle: object) -> object: ...

    def nvmlDeviceGetMemoryInfo(self, handle: object, version: object = None) -> object: ...

    def nvmlDeviceGetMadeUpThing(self, handle: object) -> object: ...

    def nvmlDeviceGetName(self, handle: object) -> str: ...  # correct: not reported


def test_the_protocol_check_catches_wrong_signatures():
    names = [n for n in vars(WrongApi) if n.startswith("nvml")]
    reported = [p.split(":")[0] for p in protocol_mismatches(WrongApi, names)]
    assert sorted(reported) == [
        "nvmlDeviceGetGpuInstanceProfileInfo",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetMadeUpThing",
        "nvmlDeviceGetMemoryInfo",  # both overloads are wrong
        "nvmlDeviceGetMemoryInfo",
    ]


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


def test_the_simulator_check_catches_wrong_signatures():
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


# -- the Protocol's constants and types --------------------------------------------------------

# Each struct shape of agent.nvml.api_types and the pynvml type it describes (shapes nested in these
# are checked with them).
STRUCTS: dict[type, type] = {
    api.PciInfo: pynvml.nvmlPciInfo_t,
    api.Memory: pynvml.c_nvmlMemory_t,
    api.MemoryV2: pynvml.c_nvmlMemory_v2_t,
    api.GpuInstanceProfileInfo: pynvml.c_nvmlGpuInstanceProfileInfo_v2_t,
    api.GpuInstanceInfo: pynvml.c_nvmlGpuInstanceInfo_t,
    api.ComputeInstanceProfileInfo: pynvml.c_nvmlComputeInstanceProfileInfo_v2_t,
    api.ComputeInstanceInfo: pynvml.c_nvmlComputeInstanceInfo_t,
    api.Utilization: pynvml.c_nvmlUtilization_t,
    api.ProcessInfo: pynvml.c_nvmlProcessInfo_v3_t,
    api.ProcessUtilizationSample: pynvml.c_nvmlProcessUtilizationSample_t,
    api.FieldValue: pynvml.c_nvmlFieldValue_t,
    api.EventData: pynvml.c_nvmlEventData_t,
    api.GpmSupport: pynvml.c_nvmlGpmSupport_t,
    api.GpmMetricsGet: pynvml.c_nvmlGpmMetricsGet_t,
}
# The Protocol's struct types (StructType[...] attributes) and the shapes they make.
STRUCT_TYPES: dict[str, type] = {
    "c_nvmlGpuInstancePlacement_t": api.GpuInstancePlacement,
    "c_nvmlGpmMetricsGet_t": api.GpmMetricsGet,
}
CONSTANTS = {
    "NVML_GPU_INSTANCE_PROFILE_COUNT",
    "NVML_COMPUTE_INSTANCE_PROFILE_COUNT",
    "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED",
    "NVML_NVLINK_MAX_LINKS",
    "nvmlMemory_v2",
}
# The Protocol's handle types whose arrays the agent allocates (ctypes pointer types).
POINTER_TYPES = {"c_nvmlGpuInstance_t"}
_NOT_SHAPES = {NvmlApi, api.CArray, api.StructType}


def _ctype_kind(ctype: type) -> str:
    if issubclass(ctype, ctypes.Array):
        return "text" if issubclass(ctype._type_, ctypes.c_char) else "array"
    if issubclass(ctype, ctypes._Pointer):
        return "pointer"
    if issubclass(ctype, ctypes.Structure | ctypes.Union):
        return "struct"
    if issubclass(ctype, ctypes.c_float | ctypes.c_double):
        return "float"
    if issubclass(ctype, ctypes._SimpleCData):
        return "int"
    return f"unknown {ctype!r}"


def _hint_kind(hint: object) -> str:
    if isinstance(hint, types.UnionType):
        args = set(hint.__args__) - {type(None)}
        if args == {str, bytes}:
            return "text"
        (hint,) = args
    if isinstance(hint, typing.NewType):
        return "pointer" if hint.__supertype__ is ctypes._Pointer else "int"
    if typing.get_origin(hint) is api.CArray:
        return "array"
    if isinstance(hint, type) and getattr(hint, "_is_protocol", False):
        return "struct"
    return {int: "int", float: "float"}.get(hint, f"unknown {hint!r}")


def shape_mismatches(shape: type, ctype: type, seen: set[type]) -> list[str]:
    """One line per field of Protocol ``shape`` that ``ctype`` lacks or holds as another kind;
    nested shapes (struct fields, array elements) are checked against their ctypes too."""
    seen.add(shape)
    fields = dict(ctype._fields_)
    problems = []
    for name, hint in typing.get_type_hints(shape).items():
        if name not in fields:
            problems.append(f"{shape.__name__}.{name}: not a field of {ctype.__name__}")
            continue
        ours, theirs = _hint_kind(hint), _ctype_kind(fields[name])
        if ours != theirs:
            problems.append(f"{shape.__name__}.{name}: {ours} != pynvml {theirs}")
        elif ours == "struct":
            problems += shape_mismatches(hint, fields[name], seen)
        elif ours == "array":
            (element,) = typing.get_args(hint)
            problems += shape_mismatches(element, fields[name]._type_, seen)
    return problems


def test_struct_shapes_name_pynvml_fields_of_the_same_kind():
    seen: set[type] = set()
    problems = []
    for shape, ctype in STRUCTS.items():
        problems += shape_mismatches(shape, ctype, seen)
    for name, shape in STRUCT_TYPES.items():
        problems += shape_mismatches(shape, getattr(pynvml, name), seen)
    assert problems == []
    shapes = {
        v
        for v in vars(api).values()
        if getattr(v, "_is_protocol", False) and v.__module__ == api.__name__
    } - _NOT_SHAPES
    assert shapes - seen == set(), "a struct shape of agent.nvml.api_types is unchecked"


class WrongMemory(Protocol):
    total: float  # c_ulonglong
    cached: int  # no such field


def test_the_shape_check_catches_wrong_fields():
    problems = shape_mismatches(WrongMemory, pynvml.c_nvmlMemory_t, set())
    assert [p.split(":")[0] for p in problems] == ["WrongMemory.total", "WrongMemory.cached"]


def test_protocol_constants_and_types_exist_in_pynvml_and_the_simulator():
    assert set(api_attributes()) == CONSTANTS | set(STRUCT_TYPES) | POINTER_TYPES | {"NVMLError"}
    assert issubclass(pynvml.NVMLError, Exception)
    for name in CONSTANTS:
        assert isinstance(getattr(pynvml, name), int), name
    for name in STRUCT_TYPES:
        assert issubclass(getattr(pynvml, name), ctypes.Structure), name
    for name in POINTER_TYPES:
        assert issubclass(getattr(pynvml, name), ctypes._Pointer), name
    for name in api_attributes():
        assert getattr(FakeNvml, name) is getattr(pynvml, name), name
