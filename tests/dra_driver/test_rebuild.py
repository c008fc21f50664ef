"""A lost or corrupt checkpoint rebuilt from what survives (dra_driver/kubeletplugin/rebuild.py
through
``Preparer.reconcile_on_start``): the CDI specs, the claims (standalone claim files here) and the
sharing leftovers of a simulated node, through the real tools (simulated nvidia-smi, MPS
daemons as subprocesses, NVML's MIG calls over the simulator). Every claim is either rebuilt as
a normal entry or kept holding its devices and reported with its reason."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli.node_access import open_node
from agent.config import Config
from agent.daemon import CurrentDevices, sharing_effects
from agent.node import NodeSource, discover
from agent.nvml.mig import MigControl
from agent.sim.driverroot import make_device_node
from dra_driver.device_model import DeviceModel, advertised_devices
from dra_driver.errors import KubeError
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.checkpoint import CheckpointStore
from dra_driver.kubeletplugin.claim_sources import DirClaimSource
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.prepare import Preparer
from dra_driver.kubeletplugin.rebuild import REASONS
from tests.integration.daemon import DRIVER, claim_manifest, write_claims
from tests.simnode import mig_instances, mps_daemons, reap_mps_daemons, sharing

MODEL = "dgx-h100"


def opaque(strategy: str, kind: str = "GpuConfig", **fields: Any) -> dict[str, Any]:
    block: dict[str, Any] = {"strategy": strategy}
    if fields:
        block["timeSlicing" if strategy == "TimeSlicing" else "mps"] = fields
    return {
        "source": "FromClaim",
        "requests": [],
        "opaque": {
            "driver": DRIVER,
            "parameters": {
                "apiVersion": f"{DRIVER}/v1alpha1",
                "kind": kind,
                "sharing": block,
            },
        },
    }


class Node:
    """A simulated node and the agent's files; ``agent()`` is a (re)started preparer."""

    def __init__(self, state: Path, config: Config | None = None) -> None:
        self.state = state
        self.config = config or Config.of(
            simulate=MODEL, mig_mode="dynamic", sharing="time-slicing"
        )
        self.source: NodeSource = open_node(self.config, state)
        self.source.nvml.init()
        self.model = advertised_devices(discover(self.source), self.config.driver.device_policy())
        self.index: Any = None
        """The claim index agents get (None: the claim files)."""

    @property
    def sim(self) -> Path:
        return self.state / "sim"

    def agent(
        self, model: DeviceModel | None = None, claims: Any = None, deadline_s: float = 40.0
    ) -> Preparer:
        """``claims``: where claims are read (None: the claim files)."""
        devices = CurrentDevices()
        devices.set(model or self.model)
        log = logging.getLogger("test.rebuild")
        files = DirClaimSource(self.state / "resourceclaims")
        p = Preparer(
            driver_name=DRIVER,
            pool=MODEL,
            claims=claims or files,
            store=CheckpointStore(self.state / "checkpoint.json", "boot"),
            cdi=CdiWriter(
                self.state / "cdi",
                DRIVER,
                self.source.driver_root,
                "550.90.07",
                make_node=make_device_node,
            ),
            devices=devices.get,
            log=log,
            effects=sharing_effects(
                self.config,
                self.source,
                self.state,
                devices,
                log,
                lambda point: None,
                lambda gpu: None,
            ),
            sharing=self.config.driver.sharing_policy(),
            index=self.index or files,
            deadline_s=deadline_s,
        )
        p.reconcile_on_start()
        return p

    def claim(self, name: str, *devices: str, config: dict[str, Any] | None = None) -> ClaimKey:
        obj = claim_manifest(
            name, f"uid-{name}", [("gpu", d) for d in devices], MODEL, "jobs",
            config=[config] if config else None,
        )  # fmt: skip
        write_claims(self.state, obj)
        return ClaimKey("jobs", name, f"uid-{name}")

    def spec_path(self, key: ClaimKey) -> Path:
        return self.state / "cdi" / f"k8s.{DRIVER}-claim_{key.uid}.json"

    def corrupt_checkpoint(self) -> None:
        (self.state / "checkpoint.json").write_text('{"version": 2, "claims": {')

    def placement(self, gpu: int, profile: str, start: int) -> str:
        return next(
            d.name
            for d in self.model.devices
            if d.kind == "mig"
            and d.gpu_minor == gpu
            and dict(d.attributes)["profile"]["string"] == profile
            and d.mig_placement_start == start
        )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    reap_mps_daemons(n.sim, MODEL)
    n.source.nvml.shutdown()


def ok(agent: Preparer, op: str, *keys: ClaimKey) -> None:
    results = (agent.prepare if op == "prepare" else agent.unprepare)(list(keys))
    assert {uid: r.error for uid, r in results.items()} == {k.uid: "" for k in keys}


def error(agent: Preparer, key: ClaimKey) -> str:
    return agent.prepare([key])[key.uid].error


def comparable(entry: Any) -> Any:
    """An entry less what a rebuild legitimately changes (its time and how it was built)."""
    return dataclasses.replace(entry, updated_at=0.0, rebuilt_from=None)


def test_claims_of_every_kind_are_rebuilt_and_their_unprepare_undoes_them(node):
    first = node.agent()
    whole = node.claim("whole", "gpu-0")
    sliced = node.claim("sliced", "gpu-1", config=opaque("TimeSlicing", interval="Long"))
    mps = node.claim(
        "mps", "gpu-2", config=opaque("MPS", activeThreadPercentage=40, pinnedMemoryLimit="2Gi")
    )
    mig = node.claim("mig", node.placement(3, "1g.10gb", 2))
    keys = (whole, sliced, mps, mig)
    ok(first, "prepare", *keys)
    before = {uid: comparable(e) for uid, e in first.checkpoint.claims.items()}
    (daemon,) = mps_daemons(node.sim, MODEL)
    (instance,) = mig_instances(node.sim, MODEL, 3)
    first.close(0)
    node.corrupt_checkpoint()

    again = node.agent()
    assert again.unrecovered() == []
    claims = again.checkpoint.claims
    assert {uid: comparable(e) for uid, e in claims.items()} == before  # names, plans, ids
    assert {e.rebuilt_from for e in claims.values()} == {"cdi-spec+claim-files"}
    assert not any(e.recovered for e in claims.values())
    assert {e.uid for e in again.prepared_claims()} == {k.uid for k in keys}  # telemetry's view
    saved = json.loads((node.state / "checkpoint.json").read_text())["claims"]
    assert saved[mps.uid]["rebuiltFrom"] == "cdi-spec+claim-files"
    assert saved[mps.uid]["namespace"] == "jobs" and saved[mps.uid]["name"] == "mps"
    # the MPS daemon was adopted (same process), the MIG device kept, the time-slice set
    assert [d.pid for d in mps_daemons(node.sim, MODEL)] == [daemon.pid]
    assert claims[mps.uid].mps is not None and claims[mps.uid].mps.pid == daemon.pid
    assert mig_instances(node.sim, MODEL, 3) == (instance,)
    assert sharing(node.sim, MODEL).gpus[1].timeslice == 3
    # a second claim for a held GPU is refused, naming the rebuilt holder
    other = node.claim("other", "gpu-0")
    assert "already prepared for claim jobs/whole (uid-whole)" in error(again, other)

    ok(again, "unprepare", *keys)
    assert mps_daemons(node.sim, MODEL) == []
    assert mig_instances(node.sim, MODEL, 3) == ()
    assert sharing(node.sim, MODEL).gpus[1].timeslice == 0
    assert again.checkpoint.claims == {} and list((node.state / "cdi").glob("*-claim_*")) == []


def test_a_gone_mps_daemon_and_mig_device_of_a_rebuilt_claim_are_made_again(node):
    first = node.agent()
    key = node.claim(
        "m", node.placement(4, "3g.40gb", 4), config=opaque("MPS", kind="MigDeviceConfig")
    )
    ok(first, "prepare", key)
    first.close(0)
    reap_mps_daemons(node.sim, MODEL)  # the daemon died with the agent
    (inst,) = mig_instances(node.sim, MODEL, 4)
    MigControl(node.source.nvml).destroy(4, inst.gpu_instance_id)  # and the MIG device
    node.corrupt_checkpoint()

    again = node.agent()
    assert again.unrecovered() == []
    entry = again.checkpoint.claims[key.uid]
    (made,) = mig_instances(node.sim, MODEL, 4)
    (daemon,) = mps_daemons(node.sim, MODEL)
    assert entry.devices[0].mig_uuid == made.uuid and entry.mps is not None
    assert entry.mps.pid == daemon.pid and daemon.devices == (made.uuid,)
    ok(again, "unprepare", key)
    assert mps_daemons(node.sim, MODEL) == [] and mig_instances(node.sim, MODEL, 4) == ()


def _rewrite_claim(node: Node, key: ClaimKey, change: Callable[[dict[str, Any]], None]) -> None:
    path = node.state / "resourceclaims" / f"{key.namespace}-{key.name}.yaml"
    obj = yaml.safe_load(path.read_text())
    change(obj)
    path.write_text(yaml.safe_dump(obj))


def _results(obj: dict[str, Any]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = obj["status"]["allocation"]["devices"]["results"]
    return results


def _edit_spec(node: Node, key: ClaimKey, change: Callable[[dict[str, Any]], None]) -> None:
    path = node.spec_path(key)
    spec = json.loads(path.read_text())
    change(spec)
    path.write_text(json.dumps(spec))


class Unreachable:
    origin = "api"

    def by_uid(self, uids: Collection[str]) -> dict[str, dict[str, Any]]:
        raise KubeError(0, "ConnectionError", "connection refused", "GET", "/apis/...")


def damage_no_claim(node: Node, key: ClaimKey) -> None:
    (node.state / "resourceclaims" / f"{key.namespace}-{key.name}.yaml").unlink()


def damage_other_device(node: Node, key: ClaimKey) -> None:
    _rewrite_claim(node, key, lambda o: _results(o)[0].update(device="gpu-7"))


def damage_not_allocated(node: Node, key: ClaimKey) -> None:
    _rewrite_claim(node, key, lambda o: o.pop("status"))


def damage_bad_config(node: Node, key: ClaimKey) -> None:
    bad = opaque("TimeSlicing", interval="Forever")
    _rewrite_claim(node, key, lambda o: o["status"]["allocation"]["devices"].update(config=[bad]))


def damage_share_not_time_sliced(node: Node, key: ClaimKey) -> None:
    """Part of the GPU's memory with no config: what this time-slicing node refuses."""
    _rewrite_claim(node, key, lambda o: _results(o)[0].update(consumedCapacity={"memory": "8Gi"}))


def damage_config_now_mps(node: Node, key: ClaimKey) -> None:
    mps = opaque("MPS")
    _rewrite_claim(node, key, lambda o: o["status"]["allocation"]["devices"].update(config=[mps]))


def damage_device_node(node: Node, key: ClaimKey) -> None:
    def change(spec: dict[str, Any]) -> None:
        spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] = "/dev/nvidia6"

    _edit_spec(node, key, change)


def damage_unreadable_spec(node: Node, key: ClaimKey) -> None:
    node.spec_path(key).write_text("{not json")


def damage_source(node: Node, key: ClaimKey) -> None:
    node.index = Unreachable()


DAMAGES = {
    "no_claim": damage_no_claim,
    "allocation_disagrees": damage_other_device,
    "allocation_invalid": damage_not_allocated,
    "invalid_config": damage_bad_config,
    "invalid_config-sharing": damage_share_not_time_sliced,
    "allocation_disagrees-mps": damage_config_now_mps,
    "leftovers_inconsistent": damage_device_node,
    "spec_unreadable": damage_unreadable_spec,
    "claim_source_unavailable": damage_source,
}


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
def test_a_claim_that_cannot_be_rebuilt_keeps_its_gpu_and_is_reported_with_why(
    node, damage, request, caplog
):
    reason = request.node.callspec.id.split("-")[0]
    first = node.agent()
    key = node.claim("a", "gpu-5")
    kept = node.claim("b", "gpu-6")
    ok(first, "prepare", key, kept)
    first.close(0)
    node.corrupt_checkpoint()
    damage(node, key)
    if reason == "claim_source_unavailable":
        damage_no_claim(node, kept)  # neither can be looked up

    with caplog.at_level(logging.ERROR, "test.rebuild"):
        again = node.agent()
    lost = {u.uid: u for u in again.unrecovered()}
    assert lost[key.uid].reason == reason and reason in REASONS
    records = [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage().startswith("cannot rebuild a prepared claim")
    ]
    assert [f["reason"] for f in records if f["uid"] == key.uid] == [reason]  # one record each
    entry = again.checkpoint.claims[key.uid]
    assert entry.recovered and (entry.namespace, entry.name) == ("", "")
    if reason != "spec_unreadable":  # a spec that cannot be read names no device to hold
        assert [d.device for d in entry.devices] == ["gpu-5"]
        assert "gpu-5 is already prepared for claim" in error(again, node.claim("c", "gpu-5"))
    if reason != "claim_source_unavailable":
        assert kept.uid not in lost and again.checkpoint.claims[kept.uid].name == "b"
    # the kubelet's unprepare releases it, and the report follows
    ok(again, "unprepare", key)
    assert key.uid not in {u.uid for u in again.unrecovered()}
    assert key.uid not in again.checkpoint.claims


def test_a_device_no_longer_advertised_keeps_the_claim_held_and_a_restart_retries(node):
    first = node.agent()
    key = node.claim("a", "gpu-7")
    ok(first, "prepare", key)
    first.close(0)
    node.corrupt_checkpoint()
    gone = dataclasses.replace(
        node.model, devices=tuple(d for d in node.model.devices if d.gpu_minor != 7)
    )
    again = node.agent(gone)
    (lost,) = again.unrecovered()
    assert (lost.uid, lost.reason) == (key.uid, "device_not_advertised")
    assert again.checkpoint.claims[key.uid].recovered
    again.close(0)
    # the GPU is back at the next start: the kept entry is rebuilt then (a valid checkpoint)
    third = node.agent()
    assert third.unrecovered() == []
    assert third.checkpoint.claims[key.uid].name == "a"


def test_a_prepare_of_an_unrecovered_claim_adopts_it_and_clears_the_report(node):
    first = node.agent()
    key = node.claim("a", "gpu-5", config=opaque("MPS"))
    ok(first, "prepare", key)
    first.close(0)
    node.corrupt_checkpoint()
    damage_no_claim(node, key)
    again = node.agent()
    assert [u.reason for u in again.unrecovered()] == ["no_claim"]
    assert len(mps_daemons(node.sim, MODEL)) == 1  # not swept: the claim still holds it
    node.claim("a", "gpu-5", config=opaque("MPS"))  # the claim is readable again
    ok(again, "prepare", key)
    assert again.unrecovered() == [] and again.checkpoint.claims[key.uid].name == "a"
    assert len(mps_daemons(node.sim, MODEL)) == 1  # the old daemon stopped, its own started


def test_claims_time_slicing_one_gpu_are_both_rebuilt_and_the_interval_stays_until_the_last(node):
    first = node.agent()
    long = opaque("TimeSlicing", interval="Long")
    a, b = node.claim("a", "gpu-2", config=long), node.claim("b", "gpu-2", config=long)
    ok(first, "prepare", a, b)
    first.close(0)
    node.corrupt_checkpoint()
    again = node.agent()
    assert again.unrecovered() == []
    assert {again.checkpoint.claims[k.uid].devices[0].interval for k in (a, b)} == {"Long"}
    short = node.claim("c", "gpu-2", config=opaque("TimeSlicing", interval="Short"))
    assert "asks Short: sharers must agree" in error(again, short)
    ok(again, "unprepare", a)
    assert sharing(node.sim, MODEL).gpus[2].timeslice == 3  # b still time-slices it
    ok(again, "unprepare", b)
    assert sharing(node.sim, MODEL).gpus[2].timeslice == 0


def test_two_specs_exposing_one_gpu_rebuild_one_and_report_the_other_as_a_conflict(node):
    first = node.agent()
    a = node.claim("a", "gpu-5")
    ok(first, "prepare", a)
    first.close(0)
    node.corrupt_checkpoint()
    b = node.claim("b", "gpu-5")  # someone copied the spec under another claim's UID
    text = node.spec_path(a).read_text().replace(a.uid, b.uid)
    node.spec_path(b).write_text(text)
    again = node.agent()
    assert again.checkpoint.claims[a.uid].name == "a"
    (lost,) = again.unrecovered()
    assert (lost.uid, lost.reason) == (b.uid, "conflict") and "jobs/a (uid-a)" in lost.detail
    assert [d.device for d in again.checkpoint.claims[b.uid].devices] == ["gpu-5"]  # held too
