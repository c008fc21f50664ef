"""Load NVML (``libnvidia-ml.so.1``) from the driver root, before pynvml would load its own.

The agent's image carries no NVIDIA files: the driver's NVML is on the node, under the driver
root (``--driver-root``). pynvml loads the library on the first ``nvmlInit`` with
``CDLL("libnvidia-ml.so.1")`` (the system loader's search) in ``_LoadNvmlLibrary``, only while its
module global ``nvmlLib`` is None, under its ``libLoadLock``. Setting ``nvmlLib`` to the
``ctypes.CDLL`` of the exact file first, under the same lock, is therefore the supported way in:
pynvml then uses that handle for every call. NVIDIA's own DRA driver does the same through
go-nvml's ``nvml.WithLibraryPath`` with the ``libnvidia-ml.so.1`` it finds under its driver root
(``cmd/gpu-kubelet-plugin/root.go``, ``getDriverLibraryPath``).

When no file is found, or it does not load, nothing is set and pynvml falls back to the system
loader; :class:`NvmlLibrary` says which happened and why, for the log and ``tessera doctor``.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.driverfiles.discover import NVML_SONAME, find_library, under
from agent.nvml.facade import Nvml


class PynvmlModule(Protocol):
    """The part of the pynvml module the loader touches (its loading globals)."""

    nvmlLib: object | None
    libLoadLock: threading.Lock


@dataclass(frozen=True)
class NvmlLibrary:
    """Which ``libnvidia-ml.so.1`` NVML uses."""

    path: str | None
    """The file loaded (as the agent sees it); None: left to the system loader's search for
    ``libnvidia-ml.so.1`` (the agent's own ``LD_LIBRARY_PATH``, ld cache, ``/usr/lib``...)."""
    reason: str
    """How it was chosen, in words: where it was found, or why the system loader was left to
    it."""

    def describe(self) -> str:
        """One line for people: the file and how it was chosen."""
        return f"{self.path or NVML_SONAME + ' (system loader)'}: {self.reason}"


def find_nvml(driver_root: Path) -> str | None:
    """The agent-side path of ``libnvidia-ml.so.1`` under ``driver_root`` (its ld cache, then
    the standard library directories), or None."""
    rel = find_library(driver_root, NVML_SONAME)
    return None if rel is None else str(under(driver_root, rel))


def load_nvml(module: PynvmlModule, driver_root: Path) -> NvmlLibrary:
    """Load the driver root's ``libnvidia-ml.so.1`` into pynvml (``module``) unless a library
    is loaded already. Never raises: a file that does not load is reported and the system
    loader is left to find one at ``nvmlInit``."""
    path = find_nvml(driver_root)
    if path is None:
        return NvmlLibrary(None, f"no {NVML_SONAME} under the driver root {driver_root}")
    with module.libLoadLock:
        if module.nvmlLib is not None:
            loaded = getattr(module.nvmlLib, "_name", None)
            return NvmlLibrary(loaded, "already loaded before the driver root was searched")
        try:
            module.nvmlLib = ctypes.CDLL(path)
        except OSError as exc:
            return NvmlLibrary(None, f"{path} from the driver root does not load: {exc}")
    return NvmlLibrary(path, f"found under the driver root {driver_root}")


def open_real_nvml(driver_root: Path) -> tuple[Nvml, NvmlLibrary]:
    """This machine's NVML: the pynvml module (not yet initialized) behind the facade, its
    library loaded from ``driver_root`` when found there. The one place pynvml is imported."""
    import pynvml

    return Nvml(pynvml), load_nvml(pynvml, driver_root)
