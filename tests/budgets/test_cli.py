"""``tessera budgets`` refuses settings it cannot work with, in one structured log record naming
the flags and the values, and names each replica apart in the Lease."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cli import main
from agent.config import BudgetsSettings, resolve_settings
from agent.daemon.budgets_compose import identity


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """The command installs its JSON handler on the root logger, as the process's entry point."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def run(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["budgets", *argv], env or {}, out, err)
    return code, err.getvalue()


def test_a_bad_value_names_its_flag_and_what_is_allowed() -> None:
    code, err = run(["--reconcile-interval", "0"])
    assert code == 2 and "--reconcile-interval" in err and "'0'" in err
    code, err = run([], {"TESSERA_LEASE_NAME": "Not_A_Name"})
    assert code == 2 and "TESSERA_LEASE_NAME" in err and "DNS subdomain" in err


def test_a_lease_timing_that_cannot_work_is_refused_in_one_json_record(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _ = run(["--lease-duration", "6", "--lease-renew-period", "5",
                   "--kubeconfig", str(tmp_path / "none")])  # fmt: skip
    assert code == 2
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    [record] = [r for r in records if r["msg"] == "budget controller cannot run"]
    assert "--lease-duration 6, --lease-renew-period 5" in record["error"]
    assert "renew deadline" in record["error"]


def test_without_a_cluster_it_says_what_to_do(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _ = run(["--kubeconfig", str(tmp_path / "missing")])
    assert code == 2
    [record] = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert "pass --kubeconfig FILE" in record["error"] and "--no-kube" not in record["error"]


def test_each_replica_has_its_own_holder_identity() -> None:
    settings = resolve_settings(BudgetsSettings, {}, {"POD_NAME": "tessera-budgets-7c9f-x2"})[0]
    a, b = identity(settings), identity(settings)
    assert a.startswith("tessera-budgets-7c9f-x2_") and b.startswith("tessera-budgets-7c9f-x2_")
    assert a != b  # a restarted replica is a new holder
