"""Fixtures of the daemon tests: a dgx-h100 daemon shared by the tests of a module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.daemon import Daemon, SharedDaemon
from tests.tmproot import short_tmp_dir


@pytest.fixture(scope="module")
def shared_h100() -> Iterator[SharedDaemon]:
    with short_tmp_dir() as state:
        shared = SharedDaemon(state, "dgx-h100")
        try:
            yield shared
        finally:
            shared.close()


@pytest.fixture
def h100(shared_h100: SharedDaemon, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """The module's dgx-h100 daemon; the test must leave no claim prepared."""
    with shared_h100.lend(request.node.nodeid) as d:
        yield d
