"""Fixtures shared by every test package."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests import tmproot
from tests.leakcheck import LeakCheck

# Property tests: a few hundred cases per property in `make test`; `make reliability` passes
# --hypothesis-profile=reliability for thousands.
settings.register_profile("default", max_examples=150)
settings.register_profile("reliability", max_examples=2500)
settings.load_profile("default")


@pytest.hookimpl(tryfirst=True)  # before pytest's tmp_path plugin reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    """Every test is checked for threads and processes it leaves running (tests/leakcheck.py);
    temporary files go to RAM where there is a tmpfs (tests/tmproot.py)."""
    config.pluginmanager.register(LeakCheck(), "tessera-leakcheck")
    tmproot.choose(config)
    # `tessera explain` keeps the CEL grammar's parser under $XDG_CACHE_HOME/tessera
    # (dra_driver/scheduler/cel/grammar.py): the tests' commands keep it with their other
    # temporary files, never in the home directory of whoever runs them
    os.environ["XDG_CACHE_HOME"] = os.path.join(tempfile.gettempdir(), "tessera-tests-cache")


def pytest_unconfigure(config: pytest.Config) -> None:
    tmproot.release()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path for one test (tests/tmproot.py)."""
    with tmproot.short_tmp_dir() as path:
        yield path
