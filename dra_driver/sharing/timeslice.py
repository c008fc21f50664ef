"""Compute mode and time-slice interval of a whole GPU, set with ``nvidia-smi``.

- ``nvidia-smi -i <uuid> -c DEFAULT|EXCLUSIVE_PROCESS``: DEFAULT lets several processes (the pods
  and containers of a time-sliced claim, several claims' MPS servers) use the GPU;
  EXCLUSIVE_PROCESS lets one process in, which is what MPS wants on a GPU a claim holds alone.
- ``nvidia-smi compute-policy -i <uuid> --set-timeslice <0|1|2|3>`` (Default, Short, Medium,
  Long): how long a context runs before the GPU switches to another. Facts and sources:
  docs/gpu-facts.md, "Sharing tools". Both are whole-GPU settings: MIG devices have neither.

Both are idempotent, so a prepare that crashed after setting them simply sets them again.
"""

from __future__ import annotations

from dra_driver.sharing.node_tools import Tools, check_uuid

INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
COMPUTE_MODES = ("DEFAULT", "EXCLUSIVE_PROCESS")


class GpuSettings:
    """Sets a whole GPU's compute mode and time-slice interval through ``nvidia-smi``."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools

    def compute_mode(self, gpu_uuid: str, mode: str) -> None:
        if mode not in COMPUTE_MODES:
            raise ValueError(f"compute mode {mode!r} is not one of {', '.join(COMPUTE_MODES)}")
        self.tools.run([str(self.tools.nvidia_smi), "-i", check_uuid(gpu_uuid), "-c", mode])

    def timeslice(self, gpu_uuid: str, interval: str) -> None:
        """``interval`` one of Default, Short, Medium, Long."""
        if interval not in INTERVALS:
            raise ValueError(f"interval {interval!r} is not one of {', '.join(INTERVALS)}")
        self.tools.run(
            [
                str(self.tools.nvidia_smi),
                "compute-policy",
                "-i",
                check_uuid(gpu_uuid),
                "--set-timeslice",
                str(INTERVALS[interval]),
            ]
        )
