"""Partitioning and sharing end to end: a real `tessera run --simulate` process driven over its
DRA socket like the kubelet, the simulated driver's state read back as NVML and the tools see it.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from dra_driver.kubeletplugin.cdi_spec import validate_spec
from dra_driver.quantity import parse_bytes
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims
from tests.simnode import mig_instances, mps_daemons, reap_mps_daemons, sharing

GIB = 1024**3


def advertised(d: Daemon) -> list[dict[str, Any]]:
    """The devices of the daemon's published ResourceSlices (standalone mode writes them)."""
    d.wait_log("published ResourceSlices")
    return [
        dev
        for path in sorted((d.state / "resourceslices").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
        for dev in doc["spec"].get("devices") or []
    ]


def placements(d: Daemon, gpu: int) -> list[dict[str, Any]]:
    return [
        dev
        for dev in advertised(d)
        if dev["attributes"]["type"]["string"] == "mig" and dev["attributes"]["minor"]["int"] == gpu
    ]


def sharing_config(kind: str, strategy: str, **fields: Any) -> dict[str, Any]:
    block: dict[str, Any] = {"strategy": strategy}
    if fields:
        block["timeSlicing" if strategy == "TimeSlicing" else "mps"] = fields
    parameters = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": kind, "sharing": block}
    return {
        "source": "FromClaim",
        "requests": [],
        "opaque": {"driver": DRIVER, "parameters": parameters},
    }


def claim(
    d: Daemon,
    name: str,
    *devices: str,
    config: dict[str, Any] | None = None,
    memory: str | None = None,
) -> ClaimRef:
    obj = claim_manifest(
        name,
        f"uid-{name}",
        [("gpu", x) for x in devices],
        d.node,
        config=[config] if config else None,
    )
    if memory is not None:
        for result in obj["status"]["allocation"]["devices"]["results"]:
            result["consumedCapacity"] = {"memory": memory}
    write_claims(d.state, obj)
    return ClaimRef("default", name, f"uid-{name}")


def running(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process no one reaped yet does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def prepare(d: Daemon, *claims: ClaimRef) -> dict[str, Any]:
    with KubeletClient(d.dra_socket) as k:
        result: dict[str, Any] = k.prepare(list(claims))["claims"]
        return result


def unprepare(d: Daemon, *claims: ClaimRef) -> dict[str, Any]:
    with KubeletClient(d.dra_socket) as k:
        result: dict[str, Any] = k.unprepare(list(claims))["claims"]
        return result


def ok(result: dict[str, Any], ref: ClaimRef) -> dict[str, Any]:
    entry: dict[str, Any] = result[ref.uid]
    assert entry.get("error", "") == "", entry["error"]
    return entry


def spec(d: Daemon, ref: ClaimRef) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (d.cdi_dir / f"k8s.{DRIVER}-claim_{ref.uid}.json").read_text()
    )
    validate_spec(data)
    return data


@pytest.fixture
def node(short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """``@pytest.mark.parametrize("node", [(model, *flags)], indirect=True)``."""
    model, *flags = request.param
    d = Daemon(short_tmp, model, *flags).start()
    yield d
    d.kill()
    reap_mps_daemons(d.state / "sim", model)


# -- dynamic MIG -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "node", [("dgx-a100", "--mig-mode", "dynamic"), ("dgx-h100", "--mig-mode", "dynamic")],
    indirect=True, ids=["a100", "h100"],
)  # fmt: skip
def test_every_profile_at_every_placement_is_created_and_destroyed(node):
    devices = placements(node, 0)
    assert len({dev["attributes"]["profile"]["string"] for dev in devices}) >= 5
    for i, dev in enumerate(devices):
        ref = claim(node, f"p{i}", dev["name"])
        (prepared,) = ok(prepare(node, ref), ref)["devices"]
        assert prepared["deviceName"] == dev["name"]
        (inst,) = mig_instances(node.state / "sim", node.model, 0)
        profile = dev["attributes"]["profile"]["string"]
        assert inst.profile_name == profile, f"{dev['name']}: made a {inst.profile_name}"
        assert inst.placement.start == int(dev["name"].rsplit("-", 1)[1])
        (record,) = node.checkpoint()["claims"][ref.uid]["devices"]
        assert record["migUUID"] == inst.uuid
        assert record["gpuInstanceID"] == inst.gpu_instance_id
        # the container gets the MIG device's capability files for its GPU and compute instance
        nodes = [n["path"] for n in spec(node, ref)["devices"][0]["containerEdits"]["deviceNodes"]]
        assert nodes[0] == "/dev/nvidia0" and len(nodes) == 3
        assert ok(unprepare(node, ref), ref)
        assert mig_instances(node.state / "sim", node.model, 0) == ()
    assert node.checkpoint()["claims"] == {} and node.cdi_files() == []


def find(node: Daemon, gpu: int, profile: str, start: int) -> str:
    return next(
        dev["name"]
        for dev in placements(node, gpu)
        if dev["attributes"]["profile"]["string"] == profile and dev["name"].endswith(f"-{start}")
    )


@pytest.mark.parametrize("node", [("dgx-a100", "--mig-mode", "dynamic")], indirect=True)
def test_an_overlapping_placement_fails_cleanly_naming_the_holder(node):
    small = claim(node, "small", find(node, 1, "1g.5gb", 0))
    ok(prepare(node, small), small)
    big = claim(node, "big", find(node, 1, "2g.10gb", 0))
    error = prepare(node, big)[big.uid]["error"]
    assert "overlaps" in error and "default/small (uid-small)" in error
    (only,) = mig_instances(node.state / "sim", node.model, 1)
    assert only.profile_name == "1g.5gb"
    assert set(node.checkpoint()["claims"]) == {small.uid}
    assert node.cdi_files() == [f"k8s.{DRIVER}-claim_{small.uid}.json"]


@pytest.mark.parametrize("node", [("dgx-h100", "--mig-mode", "dynamic")], indirect=True)
def test_a_whole_gpu_is_refused_while_one_of_its_placements_is_held(node):
    part = claim(node, "part", find(node, 2, "3g.40gb", 4))
    ok(prepare(node, part), part)
    whole = claim(node, "whole", "gpu-2")
    error = prepare(node, whole)[whole.uid]["error"]
    assert "a whole GPU and its MIG devices are never held at once" in error
    ok(unprepare(node, part), part)
    ok(prepare(node, whole), whole)  # once the placement is gone
    mode = sharing(node.state / "sim", node.model)
    assert mode.gpus[2].index == 2
    assert mig_instances(node.state / "sim", node.model, 2) == ()


@pytest.mark.parametrize("node", [("dgx-h100", "--mig-mode", "dynamic")], indirect=True)
def test_a_placement_survives_a_restart_and_strays_do_not(node):
    kept = claim(node, "kept", find(node, 3, "1g.10gb", 6))
    ok(prepare(node, kept), kept)
    node.kill()  # SIGKILL: no clean shutdown
    node.start()
    (inst,) = mig_instances(node.state / "sim", node.model, 3)
    assert inst.profile_name == "1g.10gb" and inst.placement.start == 6
    ok(unprepare(node, kept), kept)
    assert mig_instances(node.state / "sim", node.model, 3) == ()


# -- time-slicing ------------------------------------------------------------------------------


def timeslice(d: Daemon, gpu: int) -> int:
    return sharing(d.state / "sim", d.model).gpus[gpu].timeslice


@pytest.mark.parametrize("node", [("dgx-h100", "--sharing", "time-slicing")], indirect=True)
def test_claims_time_slice_a_gpu_at_one_interval_until_the_last_leaves(node):
    long = sharing_config("GpuConfig", "TimeSlicing", interval="Long")
    a, b = claim(node, "a", "gpu-0", config=long), claim(node, "b", "gpu-0", config=long)
    ok(prepare(node, a), a)
    ok(prepare(node, b), b)
    assert timeslice(node, 0) == 3
    short = claim(
        node, "c", "gpu-0", config=sharing_config("GpuConfig", "TimeSlicing", interval="Short")
    )
    error = prepare(node, short)[short.uid]["error"]
    assert "at interval Long" in error and "asks Short: sharers must agree" in error
    exclusive = claim(node, "d", "gpu-0")
    assert (
        "already prepared for claim default/a" in prepare(node, exclusive)[exclusive.uid]["error"]
    )
    ok(unprepare(node, a), a)
    assert timeslice(node, 0) == 3  # b still runs on it
    ok(unprepare(node, b), b)
    assert timeslice(node, 0) == 0


@pytest.mark.parametrize("node", [("dgx-h100", "--sharing", "time-slicing")], indirect=True)
def test_memory_shares_on_a_time_slicing_node_are_refused_naming_the_mismatch(node):
    """examples/memory-share-8gi.yaml's claims as a scheduler that ignores the `sharing`
    attribute would place them: two 8Gi shares of gpu-0 with no config. Both are refused, each
    naming what it asked and what the node offers (before: the first was prepared alone and the
    second refused as if the GPU were allocated twice)."""
    gpu = next(dev for dev in advertised(node) if dev["name"] == "gpu-0")
    assert gpu["attributes"]["sharing"] == {"string": "time-slicing"}
    a, b = claim(node, "a", "gpu-0", memory="8Gi"), claim(node, "b", "gpu-0", memory="8Gi")
    result = prepare(node, a, b)
    for ref in (a, b):
        error = result[ref.uid]["error"]
        assert "already prepared" not in error
        assert f"the claim asks a share of {8 * GIB} of its" in error, error
        assert "without time-slicing it (no config), but this node runs --sharing time-slicing" in (
            error
        )
    assert not (node.cdi_dir / f"k8s.{DRIVER}-claim_{a.uid}.json").exists()
    # the same two shares time-sliced are what the node offers
    ts = sharing_config("GpuConfig", "TimeSlicing")
    c = claim(node, "c", "gpu-0", config=ts, memory="8Gi")
    d = claim(node, "d", "gpu-0", config=ts, memory="8Gi")
    result = prepare(node, c, d)
    ok(result, c)
    ok(result, d)


@pytest.mark.parametrize("node", [("dgx-h100",)], indirect=True)
def test_without_sharing_a_time_sliced_gpu_is_its_claims_alone(node):
    ts = sharing_config("GpuConfig", "TimeSlicing", interval="Medium")
    a, b = claim(node, "a", "gpu-1", config=ts), claim(node, "b", "gpu-1", config=ts)
    ok(prepare(node, a), a)
    assert timeslice(node, 1) == 2  # the claim's own pods and containers take turns
    assert "already prepared for claim default/a" in prepare(node, b)[b.uid]["error"]


# -- MPS ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("node", [("dgx-h100",)], indirect=True)
def test_an_mps_claim_keeps_its_daemon_across_an_agent_crash(node):
    ref = claim(
        node,
        "mps",
        "gpu-4",
        config=sharing_config(
            "GpuConfig", "MPS", activeThreadPercentage=50, pinnedMemoryLimit="4Gi"
        ),
    )
    ok(prepare(node, ref), ref)
    (daemon,) = mps_daemons(node.state / "sim", node.model)
    assert daemon.active_thread_percentage == 50
    assert [limit for _, limit in daemon.pinned_mem_limits] == [4096]
    edits = spec(node, ref)["containerEdits"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/run/tessera/mps" in edits["env"]
    mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    assert mounts["/run/tessera/mps"] == daemon.pipe_dir
    assert stat.S_ISSOCK(os.stat(Path(daemon.pipe_dir) / "control").st_mode)
    node.kill()  # the agent dies; the daemon (and the pods using it) must not
    node.start()
    assert node.wait_log("adopted a running MPS daemon")["pid"] == daemon.pid
    assert [x.pid for x in mps_daemons(node.state / "sim", node.model)] == [daemon.pid]
    ok(unprepare(node, ref), ref)
    assert mps_daemons(node.state / "sim", node.model) == []
    assert not Path(daemon.pipe_dir).exists()


SILENT_MPS = """#!/bin/sh
# an nvidia-cuda-mps-control that starts and never answers
if [ "$1" = "-d" ]; then
    sh -c 'echo $$ > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"; exec sleep 600' \
        >/dev/null 2>&1 &
    exit 0
fi
exec sleep 600
"""


def test_an_mps_daemon_that_never_answers_fails_the_prepare_and_is_stopped(short_tmp):
    silent = short_tmp / "silent-mps"
    silent.write_text(SILENT_MPS)
    silent.chmod(0o755)
    d = Daemon(
        short_tmp / "s", "dgx-h100", "--mps-control", str(silent), "--mps-ready-timeout", "1"
    )
    d.start()
    try:
        ref = claim(d, "mps", "gpu-5", config=sharing_config("GpuConfig", "MPS"))
        error = prepare(d, ref)[ref.uid]["error"]
        assert "did not answer within 1 s" in error
        assert d.checkpoint()["claims"] == {} and d.cdi_files() == []
        pid = int(next(r for r in d.logs if r.get("msg") == "MPS control daemon stopped")["pid"])
        assert not running(pid)
        assert not (d.state / "mps" / ref.uid).exists()
        assert sharing(d.state / "sim", d.model).gpus[5].compute_mode == 0  # back to DEFAULT
    finally:
        d.kill()
        for proc in psutil.process_iter(["cmdline"]):
            if str(silent) in " ".join(proc.info["cmdline"] or ()):
                proc.kill()


# -- memory shares -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "node",
    [("dgx-h100", "--sharing", "memory-shares", "--memory-share-min", "10Gi")],
    indirect=True,
)
def test_memory_shares_fill_a_gpu_and_not_beyond(node):
    gpu = next(dev for dev in advertised(node) if dev["name"] == "gpu-6")
    assert gpu["allowMultipleAllocations"] is True
    policy = gpu["capacity"]["memory"]["requestPolicy"]
    assert parse_bytes(policy["default"]) == parse_bytes(policy["validRange"]["min"]) == 10 * GIB
    total = int(gpu["capacity"]["memory"]["value"])
    shares = [claim(node, f"s{i}", "gpu-6", memory="20Gi") for i in range(total // (20 * GIB))]
    for ref in shares:
        ok(prepare(node, ref), ref)
    daemons = mps_daemons(node.state / "sim", node.model)
    assert len(daemons) == len(shares)
    assert all(dict(x.pinned_mem_limits).popitem()[1] == 20 * 1024 for x in daemons)
    over = claim(node, "over", "gpu-6", memory="20Gi")
    error = prepare(node, over)[over.uid]["error"]
    assert "memory shares would total" in error and f"held: {len(shares) * 20 * GIB}" in error
    unprepare(node, *shares)
    assert mps_daemons(node.state / "sim", node.model) == []


def test_sigterm_leaves_mps_daemons_to_the_next_agent(short_tmp):
    d = Daemon(short_tmp, "dgx-h100").start()
    try:
        ref = claim(d, "m", "gpu-7", config=sharing_config("GpuConfig", "MPS"))
        ok(prepare(d, ref), ref)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        assert len(mps_daemons(d.state / "sim", d.model)) == 1  # pods keep using it
    finally:
        d.kill()
        reap_mps_daemons(d.state / "sim", d.model)
