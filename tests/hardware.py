"""Whether this machine has a real NVIDIA driver, for the tests that depend on it either way."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def why_a_driver_is_here() -> str | None:
    """None when no NVIDIA driver is installed (NVML cannot be loaded), else why the machine
    does not count as driverless: a driver answers, or NVML is there but fails to start."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        if exc.value in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
            return None
        return f"NVML is installed but fails to initialize: {exc}"
    pynvml.nvmlShutdown()
    return "a real NVIDIA driver loads on this machine (pynvml.nvmlInit() succeeds)"


def driver_loads() -> bool:
    """A real driver answers here (a GPU host)."""
    reason = why_a_driver_is_here()
    return reason is not None and not reason.startswith("NVML is installed but fails")


needs_no_driver = pytest.mark.skipif(
    why_a_driver_is_here() is not None,
    reason="this test checks what a machine without an NVIDIA driver says; here "
    + str(why_a_driver_is_here()),
)
needs_driver = pytest.mark.skipif(
    not driver_loads(), reason="no NVIDIA driver here: pynvml.nvmlInit() fails"
)
