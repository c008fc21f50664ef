"""Fixtures shared by every test package."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.leakcheck import LeakCheck

# Property tests: a few hundred cases per property in `make test`; `make reliability` passes
# --hypothesis-profile=reliability for thousands.
settings.register_profile("default", max_examples=150)
settings.register_profile("reliability", max_examples=2500)
settings.load_profile("default")


def pytest_configure(config: pytest.Config) -> None:
    """Every test is checked for threads and processes it leaves running (tests/leakcheck.py)."""
    config.pluginmanager.register(LeakCheck(), "tessera-leakcheck")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path: unix socket paths are limited to 107 bytes and
    pytest's tmp_path is long."""
    path = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
