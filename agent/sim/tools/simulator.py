"""Opening the simulated node a stand-in acts on."""

from __future__ import annotations

from pathlib import Path

from agent.sim.errors import ModelError
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from agent.sim.tools.common import ToolError, require_state_dir


def open_simulator(state_dir: Path, model_ref: str, tool: str, code: int) -> FakeNvml:
    """The simulated NVML of the node in ``state_dir`` (initialized); ToolError with ``code``
    when the node is gone or its model does not load."""
    require_state_dir(state_dir, tool, code)
    try:
        model = load_model(model_ref)
    except ModelError as exc:
        raise ToolError(f"{tool} (simulated): {exc}", code) from exc
    fake = FakeNvml(model, state_dir)
    fake.nvmlInit()
    return fake
