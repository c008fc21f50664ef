"""The stand-in executables the simulated driver root installs (pure: their paths and text).

Each is a Python script whose interpreter is the one running the simulator (so the ``agent``
package is importable) and which names the simulated node it acts on: the simulator's state
directory and the node model. It is the entry point, so it is what reads the process environment
and passes it in.
"""

from __future__ import annotations

BIN_DIR = "usr/bin"
NVIDIA_SMI = f"{BIN_DIR}/nvidia-smi"
MPS_CONTROL = f"{BIN_DIR}/nvidia-cuda-mps-control"
MODE = 0o755

_HEADER = '''\
#!{python}
"""{what} of Tessera's simulated node in {state_dir}: acts on the simulated state, not on GPUs.
Written by agent/sim/driverroot.py; rewritten whenever the simulator starts."""
import os
import sys

from {module} import main

'''

_SMI = "sys.exit(main(sys.argv[1:], state_dir={state_dir!r}, model={model!r}))\n"
_MPS = "sys.exit(main(sys.argv[1:], dict(os.environ), state_dir={state_dir!r}, model={model!r}))\n"


def tool_scripts(python: str, state_dir: str, model: str) -> dict[str, str]:
    """Relative path -> text of every stand-in, for the node in ``state_dir`` simulating
    ``model`` (a model name or an absolute model file path), run by ``python`` (pure)."""
    tools = {
        NVIDIA_SMI: ("agent.sim.tools.nvidia_smi", "The simulated nvidia-smi", _SMI),
        MPS_CONTROL: (
            "agent.sim.tools.mps_control",
            "The simulated nvidia-cuda-mps-control",
            _MPS,
        ),
    }
    return {
        path: _HEADER.format(python=python, what=what, state_dir=state_dir, module=module)
        + call.format(state_dir=state_dir, model=model)
        for path, (module, what, call) in tools.items()
    }
