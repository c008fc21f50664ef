"""The real :data:`~agent.pcihost.vm_types.KernelWrite`: one ``write(2)`` to a sysfs attribute.

A sysfs attribute's ``store`` method sees exactly the bytes of one write and answers with an
errno (``EBUSY``, ``ENODEV``, ``EINVAL``, ...); a shell's ``echo -n value > path`` does the same
(sysfs-bus-pci: ``driver_override``, ``drivers/<drv>/bind|unbind``; sysfs-bus-vfio-mdev:
``create``, ``remove``; docs/gpu-facts.md). Written with ``os`` rather than ``Path.write_text``:
a buffered text file may split the write, and opening for writing must never create the file:
an attribute that does not exist (a driver that is not loaded has no ``bind``) fails with
``ENOENT`` instead of becoming a regular file."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def write_attribute(path: Path, value: str) -> None:
    """Write ``value`` to the attribute at ``path`` in one ``os.write``, as ``echo -n`` does.

    Opens write-only with ``O_TRUNC`` (a shell's ``>``; sysfs ignores it, a regular file, e.g. in
    a test, ends up holding exactly ``value``) and never ``O_CREAT``. Raises the kernel's
    OSError unchanged (callers translate it, naming what they wrote and why); a short write,
    which a sysfs ``store`` that consumed part of the value would give, is raised as ``EIO``."""
    data = value.encode()
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        written = os.write(fd, data)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(
            errno.EIO, f"short write: {written} of {len(data)} bytes of {value!r}", str(path)
        )
