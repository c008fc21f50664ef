"""``NvmlApi`` names exactly the NVML functions the agent calls, so it cannot drift from the code.

The agent's code (``agent/`` and ``dra_driver/``, not the simulator) is scanned for ``nvml*``
attribute names: one that is called, or that pynvml defines as a function (a function can be
passed to a helper before it is called), is an NVML call, and so is a name looked up with
``getattr``/``hasattr``. Struct fields (``v.nvmlReturn``) and constants (``api.nvmlMemory_v2``)
are neither.
"""

import ast
import inspect
import re
from collections.abc import Iterable
from pathlib import Path

import pynvml

from agent.nvml.api import api_attributes, api_functions

ROOT = Path(__file__).resolve().parents[2]
NVML_NAME = re.compile(r"^nvml[A-Z]\w*$")


def agent_sources() -> dict[str, str]:
    """Path -> source of every module of agent/ and dra_driver/ except the simulator's."""
    paths = [*(ROOT / "agent").rglob("*.py"), *(ROOT / "dra_driver").rglob("*.py")]
    sim = ROOT / "agent" / "sim"
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths if sim not in p.parents}


def nvml_calls(sources: Iterable[str]) -> set[str]:
    """The NVML functions ``sources`` call (see the module docstring)."""
    found: set[str] = set()
    for source in sources:
        tree = ast.parse(source)
        called = {
            node.func.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        }
        found |= {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and NVML_NAME.match(node.attr)
            and (node.attr in called or inspect.isfunction(getattr(pynvml, node.attr, None)))
        }
        found |= {
            node.args[1].value
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and NVML_NAME.match(node.args[1].value)
        }
    return found


def attribute_names(sources: Iterable[str]) -> set[str]:
    return {
        node.attr
        for source in sources
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
    }


def drift(called: set[str], declared: Iterable[str]) -> tuple[list[str], list[str]]:
    """(called but not declared, declared but never called)."""
    declared = set(declared)
    return sorted(called - declared), sorted(declared - called)


def test_the_protocol_declares_exactly_the_calls_the_agent_makes():
    sources = agent_sources()
    assert "agent/nvml/telemetry.py" in sources and "agent/sim/nvml.py" not in sources
    undeclared, unused = drift(nvml_calls(sources.values()), api_functions())
    assert undeclared == [], "calls the agent makes that agent.nvml.api.NvmlApi lacks"
    assert unused == [], "NvmlApi functions nothing in agent/ or dra_driver/ calls"


def test_every_protocol_constant_and_type_is_used():
    used = attribute_names(agent_sources().values())
    assert sorted(set(api_attributes()) - used) == []


WRONG = """
def read(api, get, h, v):
    api.nvmlDeviceGetUUID(h)                          # declared and called
    api.nvmlDeviceGetMadeUpThing(h)                   # called, not declared, not in pynvml
    get(api.nvmlDeviceGetPowerManagementLimit, h)     # passed along: a pynvml function
    getattr(api, "nvmlDeviceGetSerial")(h)            # looked up by name
    api.nvmlDeviceGetMemoryInfo(h, api.nvmlMemory_v2) # a constant is not a call
    return v.nvmlReturn                               # a struct field is not a call
"""


def test_the_scan_catches_drift_both_ways():
    called = nvml_calls([WRONG])
    assert called == {
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetMadeUpThing",
        "nvmlDeviceGetPowerManagementLimit",
        "nvmlDeviceGetSerial",
        "nvmlDeviceGetMemoryInfo",
    }
    declared = ["nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo", "nvmlShutdown"]
    assert drift(called, declared) == (
        ["nvmlDeviceGetMadeUpThing", "nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetSerial"],
        ["nvmlShutdown"],
    )
