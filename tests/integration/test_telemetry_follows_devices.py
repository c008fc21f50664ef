"""Telemetry follows the node's devices without a restart, as a user sees it: a `tessera run
--simulate` process, claims prepared over its DRA socket like the kubelet, `/metrics` scraped,
the telemetry API streamed and `tessera top` run.

- A MIG device a dynamic-MIG prepare creates has its ``tessera_mig_*`` series and its `top` row
  from the first tick that starts after the prepare answered (and loses them as fast at
  unprepare).
- After a GPU is hot-removed NVML renumbers the GPUs after it; every series keeps the labels it
  had and `top` names each GPU as its device name does (``gpu-6`` is GPU 6).

"No restart and no wait": a tick is waited for on the telemetry stream (the first message is the
latest tick T; tick T+1 may have begun before the stream opened, T+2 cannot), never by sleeping.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.cli import main
from agent.telemetry.api import telemetry_pb2 as pb
from agent.telemetry.api import telemetry_pb2_grpc as pb_grpc
from tests.integration.daemon import Daemon
from tests.integration.test_rediscovery import devices, sim, wait_for
from tests.integration.test_sharing import claim, find, ok, prepare, unprepare

INTERVAL = "0.2"
MIG_SERIES = (
    "tessera_mig_memory_used_bytes",
    "tessera_mig_memory_total_bytes",
)


@pytest.fixture
def dynamic(short_tmp: Path) -> Iterator[Daemon]:
    d = Daemon(
        short_tmp, "dgx-h100", "--mig-mode", "dynamic", "--telemetry-interval", INTERVAL,
        "--rediscovery-interval", "0",  # nothing re-reads the node behind the test's back
    ).start()  # fmt: skip
    yield d
    d.kill()


def tick_after_now(d: Daemon) -> Any:
    """The first telemetry sample of a tick that began after this call (module docstring)."""
    with grpc.insecure_channel(f"unix://{d.state / 'telemetry.sock'}") as channel:
        call = pb_grpc.TelemetryStub(channel).Watch(pb.WatchRequest(interval_seconds=0))
        try:
            first = next(call)
            for sample in call:
                if sample.tick >= first.tick + 2:
                    return sample
        finally:
            call.cancel()
    raise AssertionError("the telemetry stream ended")


def top(d: Daemon) -> str:
    out, err = io.StringIO(), io.StringIO()
    assert main(["top", "--once", "--state-dir", str(d.state)], {}, out, err) == 0, err.getvalue()
    return out.getvalue()


def mig_series(d: Daemon, uuid: str) -> dict[str, dict[str, str]]:
    """``tessera_mig_*`` series of GPU ``uuid``: name -> its labels (one MIG device)."""
    found: dict[str, dict[str, str]] = {}
    for name in MIG_SERIES:
        for labels, _ in d.scrape().get(name, {}).items():
            if ("uuid", uuid) in labels:
                assert name not in found, f"more than one MIG device: {name}"
                found[name] = dict(labels)
    return found


def test_a_dynamic_mig_device_is_in_telemetry_from_the_next_tick(dynamic: Daemon) -> None:
    name = find(dynamic, 2, "3g.40gb", 4)
    uuid = devices(dynamic)["gpu-2"]["attributes"]["uuid"]["string"]
    assert mig_series(dynamic, uuid) == {}
    ref = claim(dynamic, "part", name)
    ok(prepare(dynamic, ref), ref)

    sample = tick_after_now(dynamic)
    (gpu,) = [g for g in sample.gpus if g.uuid == uuid]
    (mig,) = gpu.mig
    assert mig.profile == "3g.40gb"
    series = mig_series(dynamic, uuid)
    assert set(series) == set(MIG_SERIES)
    labels = series["tessera_mig_memory_total_bytes"]
    assert labels["mig_profile"] == "3g.40gb"
    assert labels["gpu_instance"] == str(mig.gpu_instance_id)
    row = f"3g.40gb (GI {mig.gpu_instance_id})"
    assert re.search(rf"{re.escape(row)}.*│ default/part\s+│$", top(dynamic), re.MULTILINE)

    ok(unprepare(dynamic, ref), ref)
    sample = tick_after_now(dynamic)
    (gpu,) = [g for g in sample.gpus if g.uuid == uuid]
    assert list(gpu.mig) == []
    assert mig_series(dynamic, uuid) == {}
    assert "3g.40gb" not in top(dynamic)


def gpu_labels(d: Daemon) -> dict[str, dict[str, str]]:
    """Each GPU's labels on ``tessera_gpu_healthy``, by UUID."""
    out = {}
    for labels in d.scrape()["tessera_gpu_healthy"]:
        found = dict(labels)
        out[found["uuid"]] = found
    return out


def top_gpus(frame: str) -> list[str]:
    """The GPU column of `top`'s whole-GPU rows."""
    return re.findall(r"^│ (\d+)\s+│ NVIDIA", frame, flags=re.MULTILINE)


def test_a_hot_removed_gpu_leaves_every_other_gpu_its_identity(short_tmp: Path) -> None:
    d = Daemon(
        short_tmp, "dgx-h100", "--telemetry-interval", INTERVAL, "--rediscovery-debounce", "0.3",
        "--rediscovery-interval", "0",  # only udev's events trigger here
    ).start()  # fmt: skip
    try:
        wait_for("slices published", lambda: "gpu-7" in devices(d))
        uuids = {n: dev["attributes"]["uuid"]["string"] for n, dev in devices(d).items()}
        tick_after_now(d)
        before = gpu_labels(d)
        assert {before[u]["gpu"] for u in uuids.values()} == {str(i) for i in range(8)}

        code, _, err = sim(d, "remove-gpu", "--gpu", "3")
        assert code == 0, err
        d.wait_log("node inventory changed")
        sample = tick_after_now(d)

        # NVML renumbered the GPUs after the removed one (as it does: the test is void if not)
        assert {g.uuid: g.index for g in sample.gpus}[uuids["gpu-6"]] == 5
        after = gpu_labels(d)
        assert uuids["gpu-3"] not in after
        for name, uuid in uuids.items():
            if name != "gpu-3":
                assert after[uuid] == before[uuid], name
                assert after[uuid]["gpu"] == name.removeprefix("gpu-")
        # the telemetry API names each GPU as its device name does, and top shows that
        assert sorted((f"gpu-{g.minor}", g.uuid) for g in sample.gpus) == sorted(
            (n, u) for n, u in uuids.items() if n != "gpu-3"
        )
        assert top_gpus(top(d)) == ["0", "1", "2", "4", "5", "6", "7"]
    finally:
        d.kill()
