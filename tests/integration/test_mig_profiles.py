"""--mig-profiles on a running daemon: only the chosen profiles' placements are published, the
whole GPUs stay, and a named profile no GPU of the node has is logged (structured), not fatal."""

from __future__ import annotations

from pathlib import Path

from tests.integration.daemon import Daemon
from tests.integration.test_rediscovery import devices, wait_for


def test_the_daemon_publishes_the_chosen_profiles_and_logs_the_missing_one(
    short_tmp: Path,
) -> None:
    d = Daemon(
        short_tmp, "dgx-h100", "--mig-mode", "dynamic",
        "--mig-profiles", "3g.40gb", "--mig-profiles", "3g.20gb",  # the second is an A100's
    ).start()  # fmt: skip
    try:
        record = d.wait_log("MIG profiles not on this node")
        assert record["level"] == "warning"
        assert record["mig_profiles"] == ["3g.20gb"]
        assert "3g.40gb" in record["node_mig_profiles"]
        wait_for("slices published", lambda: "gpu-7" in devices(d))
        found = devices(d)
        mig = sorted(n for n, dev in found.items() if "-mig-" in n)
        assert mig == [f"gpu-{g}-mig-3g40gb-9-{s}" for g in range(8) for s in (0, 4)]
        assert all(f"gpu-{g}" in found for g in range(8))
    finally:
        d.stop()
