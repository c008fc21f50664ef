"""What both stand-ins share: their errors, and refusing to act for a node that is gone.

Kept light (no simulator imports): the MPS client imports only this, ``socket`` and
:mod:`agent.sim.tools.mps_paths`, so every ``echo … | nvidia-cuda-mps-control`` starts fast.
"""

from __future__ import annotations

from pathlib import Path

NODE_STATE_FILE = "nvml-state.json"
""":data:`agent.sim.state.STATE_FILE`, the file whose presence says the simulated node exists
(a test pins the two together)."""


class ToolError(Exception):
    """A failure the tool reports with one line and exit status ``code``."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def require_state_dir(state_dir: Path, tool: str, code: int) -> None:
    """Refuse to act when the simulated node this tool was installed for is gone."""
    if not (state_dir / NODE_STATE_FILE).is_file():
        raise ToolError(
            f"{tool} (simulated): the simulated node it belongs to is gone: no {NODE_STATE_FILE}"
            f" in {state_dir}; start the simulator again (`tessera run --simulate MODEL`), which"
            " reinstalls this tool",
            code,
        )
