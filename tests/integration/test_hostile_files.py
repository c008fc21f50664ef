"""A hostile node: files that others can write, named like the agent's own, never hang or bloat
the agent (issue 23, item 10). The CDI root is shared with other vendors' tools: a FIFO, a link to
``/dev/zero`` or a huge file named like a claim's spec was read whole at start (a FIFO blocked
the open, so no HTTP listener, no DRA socket and SIGTERM ignored; ``/dev/zero`` grew the agent
without bound; a 300 MB file was read whole)."""

from __future__ import annotations

import os
import signal
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims

EVIL_UID = "0f0e0d0c-0000-4000-8000-00000000e71c"


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def link_to_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def sparse_300mb(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(300 * 1024 * 1024)  # no disk used; reading it whole costs 300 MB of memory


def readyz(d: Daemon) -> int:
    try:
        with urllib.request.urlopen(d.metrics_url("/readyz"), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:  # 503 is an answer too: the listener is up
        return int(exc.code)


@pytest.mark.parametrize("plant", [make_fifo, link_to_dev_zero, sparse_300mb])
def test_a_hostile_file_named_like_a_claim_spec_does_not_stop_the_agent(
    short_tmp: Path, plant: Callable[[Path], None]
) -> None:
    d = Daemon(short_tmp / "state", "dgx-h100", "--cdi-root", str(short_tmp / "cdi"))
    d.start()
    ref = ClaimRef("default", "a", "uid-a")
    try:
        write_claims(d.state, claim_manifest("a", "uid-a", [("gpu", "gpu-0")], d.node))
        with KubeletClient(d.dra_socket) as k:
            assert k.prepare([ref])["claims"]["uid-a"]["error"] == ""
        assert d.stop() == 0  # a valid checkpoint that lists uid-a
        evil = short_tmp / "cdi" / f"k8s.{DRIVER}-claim_{EVIL_UID}.json"
        plant(evil)
        d.start()  # "agent started": the HTTP listener and the DRA socket are up
        assert readyz(d) == 200
        with KubeletClient(d.dra_socket) as k:  # the prepared claim is still served
            assert k.prepare([ref])["claims"]["uid-a"]["error"] == ""
        # the checkpoint is authoritative: the file named like our spec is no claim of ours
        rec = d.wait_log("cannot read a CDI spec")
        assert rec["uid"] == EVIL_UID and str(evil) in rec["error"]
        assert not os.path.lexists(evil)
        assert d.status("VmHWM") < 250 * 1024  # kB: the 300 MB file was never read
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        assert d.wait_exit(timeout=30) == 0
    finally:
        d.kill()
        if os.path.lexists(evil := short_tmp / "cdi" / f"k8s.{DRIVER}-claim_{EVIL_UID}.json"):
            evil.unlink()  # a FIFO left open would keep nothing, but the tmp dir is removed
