"""The real KernelWrite: one write, never a new file, the kernel's errno unchanged."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from agent.pcihost.kernel import write_attribute


def test_writes_exactly_the_value_over_what_the_file_held(tmp_path: Path) -> None:
    attr = tmp_path / "driver_override"
    attr.write_text("(null)\n")
    write_attribute(attr, "vfio-pci")
    assert attr.read_bytes() == b"vfio-pci"


def test_an_attribute_that_does_not_exist_is_not_created(tmp_path: Path) -> None:
    bind = tmp_path / "drivers" / "vfio-pci" / "bind"
    bind.parent.mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as err:
        write_attribute(bind, "0000:1b:00.0")
    assert err.value.errno == errno.ENOENT
    assert not bind.exists()


def test_the_kernels_answer_is_raised_as_it_is(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError) as err:
        write_attribute(tmp_path, "1")
    assert err.value.errno == errno.EISDIR
