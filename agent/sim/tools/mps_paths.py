"""Where an MPS control daemon and its clients meet (light: the client imports it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
DEFAULT_LOG_DIRECTORY = "/var/log/nvidia-mps"
CONTROL = "control"
LOCK = "control_lock"
PID_FILE = "nvidia-cuda-mps-control.pid"
LOG_FILE = "control.log"
REPLY_END = b"\0"
"""Ends each reply on the control socket (the simulator's own protocol)."""
EXIT_FAILURE = 1


@dataclass(frozen=True)
class Paths:
    pipe_dir: Path
    log_dir: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Paths:
        """The directories the real tools take from the environment (absolute)."""
        pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY
        log = env.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIRECTORY
        return cls(Path(os.path.abspath(pipe)), Path(os.path.abspath(log)))

    @property
    def control(self) -> Path:
        return self.pipe_dir / CONTROL

    @property
    def pid_file(self) -> Path:
        return self.pipe_dir / PID_FILE
