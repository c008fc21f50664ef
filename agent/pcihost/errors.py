"""Errors of the host PCI layer (``agent.pcihost``)."""

from __future__ import annotations

import errno as errno_names
import os
from pathlib import Path

from agent.errors import TesseraError


class PciHostError(TesseraError):
    """A PCI function could not be read or changed as asked.

    The message names the sysfs path, the value written (where there was one) and what the
    kernel answered (the errno's name and text). Not an OSError: callers handle this one error
    whatever the kernel said; ``path``, ``value`` and ``errno`` keep the parts for a caller that
    must tell them apart (``errno`` None: refused before any write, e.g. a function bound to
    another driver)."""

    def __init__(
        self,
        message: str,
        *,
        path: Path | None = None,
        value: str | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.value = value
        self.errno = errno


def kernel_answer(exc: OSError) -> str:
    """What the kernel answered, as ``EBUSY (Device or resource busy)``."""
    if exc.errno is None:
        return str(exc)
    name = errno_names.errorcode.get(exc.errno, f"errno {exc.errno}")
    return f"{name} ({os.strerror(exc.errno)})"


def write_failed(path: Path, value: str, exc: OSError, why: str = "") -> PciHostError:
    """The error of a sysfs write the kernel refused; ``why`` says what the write was for."""
    purpose = f" ({why})" if why else ""
    return PciHostError(
        f"writing {value!r} to {path}{purpose} failed: the kernel answered {kernel_answer(exc)}",
        path=path,
        value=value,
        errno=exc.errno,
    )


def read_failed(path: Path, exc: OSError) -> PciHostError:
    """The error of a sysfs read that failed."""
    return PciHostError(f"cannot read {path}: {kernel_answer(exc)}", path=path, errno=exc.errno)
