"""``tessera uninstall`` (issue 23, item 8): the base CDI spec, which the agent leaves by design
when it stops, is removed once no agent runs and no claim is prepared; while either is not so,
it refuses, saying what to do first. A real daemon, real files, the command in process."""

from __future__ import annotations

import io
from pathlib import Path

from agent.cli import main
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims

MODEL = "dgx-h100"


def uninstall(state: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["uninstall", "--simulate", MODEL, "--state-dir", str(state)], {}, out, err)
    return code, out.getvalue(), err.getvalue()


def test_uninstall_removes_the_base_spec_only_once_nothing_runs_or_is_prepared(short_tmp):
    state = short_tmp / "state"
    write_claims(state, claim_manifest("c0", "uid-0", [("gpu", "gpu-0")], MODEL))
    claim = ClaimRef("default", "c0", "uid-0")
    d = Daemon(state, MODEL)
    d.start()
    try:
        base = d.cdi_dir / f"k8s.{DRIVER}-driver.json"
        with KubeletClient(d.dra_socket) as k:
            assert k.prepare([claim])["claims"]["uid-0"]["error"] == ""
        code, _, err = uninstall(state)
        assert code == 2 and "an agent still runs" in err and f"PID {d.proc.pid}" in err
        assert d.stop() == 0
        code, _, err = uninstall(state)
        assert code == 2 and "1 claim still prepared on this node: default/c0 (uid-0)" in err
        assert base.exists()
        d.start()
        with KubeletClient(d.dra_socket) as k:
            assert k.unprepare([claim])["claims"]["uid-0"]["error"] == ""
        assert d.stop() == 0
        code, out, err = uninstall(state)
        assert (code, err) == (0, "")
        assert out == f"removed {base}\n"
        assert not base.exists() and not list(d.cdi_dir.glob(f"k8s.{DRIVER}-*"))
        assert uninstall(state)[:2] == (0, f"nothing of {DRIVER} left in {d.cdi_dir}\n")
    finally:
        d.kill()
