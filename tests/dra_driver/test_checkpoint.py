"""The driver checkpoint: format, atomic saves, corruption, versions, reboots, immutability."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from dra_driver.errors import CheckpointCorrupt, CheckpointError, CheckpointTooNew
from dra_driver.kubeletplugin.checkpoint import (
    CHECKPOINT_VERSION,
    MIGRATIONS,
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    CheckpointStore,
    ClaimEntry,
    PreparedDevice,
    checksum_of,
    decode,
    encode,
)

BOOT = "6f1c3c1e-4e1a-4b8a-9d51-0c1f6f1b2a3d"
OTHER_BOOT = "0b7e1a2c-9f3d-4c5e-8a6b-7d8e9f0a1b2c"
UID_A = "0d9a6b5e-3c2f-4e1d-9a8b-7c6d5e4f3a2b"
UID_B = "1e2f3a4b-5c6d-4e7f-8a9b-0c1d2e3f4a5b"
FIXED_NOW = 1_717_171_717.0  # 2024-05-31T16:08:37Z


def gpu_device(name: str = "gpu-0", minor: int = 0) -> PreparedDevice:
    return PreparedDevice(
        request_names=("gpu",),
        pool="node-a",
        device=name,
        cdi_device_ids=(f"k8s.gpu.tessera.dev/claim={UID_A}-{name}",),
        kind="gpu",
        gpu_uuid=f"GPU-0000000{minor}-aaaa-bbbb-cccc-dddddddddddd",
        gpu_minor=minor,
    )


def mig_device() -> PreparedDevice:
    return PreparedDevice(
        request_names=("small", "also-small"),
        pool="node-a",
        device="gpu-1-mig-1g10gb-19-0",
        cdi_device_ids=(f"k8s.gpu.tessera.dev/claim={UID_B}-gpu-1-mig-1g10gb-19-0",),
        kind="mig",
        gpu_uuid="GPU-00000001-aaaa-bbbb-cccc-dddddddddddd",
        gpu_minor=1,
        mig_uuid="MIG-11111111-2222-3333-4444-555555555555",
        gpu_instance_id=9,
        compute_instance_id=0,
    )


def claim_a(state: str = PREPARE_COMPLETED) -> ClaimEntry:
    return ClaimEntry(
        uid=UID_A,
        namespace="team-a",
        name="train",
        state=state,
        devices=(gpu_device("gpu-0", 0), gpu_device("gpu-3", 3)),
        updated_at=1_717_000_000.25,
    )


def claim_b() -> ClaimEntry:
    return ClaimEntry(
        uid=UID_B,
        namespace="team-b",
        name="notebook",
        state=PREPARE_STARTED,
        devices=(mig_device(),),
        updated_at=1_717_000_001.5,
    )


def sample() -> Checkpoint:
    return Checkpoint(BOOT).with_claim(claim_a()).with_claim(claim_b())


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "checkpoint.json"


@pytest.fixture
def store(path: Path) -> CheckpointStore:
    return CheckpointStore(path, BOOT, clock=lambda: FIXED_NOW)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# --- round trip and file format ---------------------------------------------------------------


def test_missing_file_loads_empty(store: CheckpointStore) -> None:
    result = store.load()
    assert result.checkpoint == Checkpoint(BOOT)
    assert (result.rebooted, result.corrupt_moved_to, result.migrated_from) == (False, None, None)


def test_save_load_round_trip(store: CheckpointStore, path: Path) -> None:
    cp = sample()
    store.save(cp)
    result = store.load()
    assert result.checkpoint == cp
    assert result.checkpoint.claims[UID_B].devices[0] == mig_device()
    assert (result.rebooted, result.corrupt_moved_to, result.migrated_from) == (False, None, None)


def test_file_format(store: CheckpointStore, path: Path) -> None:
    store.save(sample())
    obj = json.loads(path.read_text())
    assert obj["apiVersion"] == "tessera.dev/v1"
    assert obj["kind"] == "Checkpoint"
    assert obj["version"] == 1  # no version-2 content: an older build can still read it
    assert obj["bootID"] == BOOT
    assert obj["checksum"].startswith("sha256:") and len(obj["checksum"]) == 7 + 64
    dev = obj["claims"][UID_B]["devices"][0]
    assert dev["gpuInstanceID"] == 9 and dev["migUUID"].startswith("MIG-")
    assert dev["cdiDeviceIDs"] == list(mig_device().cdi_device_ids)
    assert obj["claims"][UID_A]["state"] == "PrepareCompleted"
    assert obj["claims"][UID_A]["updatedAt"] == 1_717_000_000.25


def test_file_mode_0600(store: CheckpointStore, path: Path) -> None:
    store.save(sample())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    store.save(Checkpoint(BOOT))  # a rewrite keeps the mode
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_save_leaves_no_temp_files(store: CheckpointStore, path: Path) -> None:
    for _ in range(3):
        store.save(sample())
    assert leftovers(path.parent) == []
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.json"]


def test_failed_write_keeps_old_file(
    store: CheckpointStore, path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.save(sample())
    old = path.read_bytes()

    def boom(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*No space left"):
        store.save(Checkpoint(BOOT))
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert leftovers(path.parent) == []
    assert store.load().checkpoint == sample()


def test_unknown_fields_are_tolerated(store: CheckpointStore, path: Path) -> None:
    """A later build of the same version may add fields; the checksum still has to match."""
    obj = json.loads(encode(sample()))
    del obj["checksum"]
    obj["futureTopLevel"] = {"x": 1}
    obj["claims"][UID_A]["futureClaimField"] = "y"
    obj["claims"][UID_A]["devices"][0]["futureDeviceField"] = [1, 2]
    obj["checksum"] = checksum_of(obj)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(obj))
    result = store.load()
    assert result.corrupt_moved_to is None
    assert result.checkpoint == sample()


def test_encoding_is_deterministic() -> None:
    reordered = Checkpoint(BOOT).with_claim(claim_b()).with_claim(claim_a())
    assert encode(reordered) == encode(sample())


# --- corruption -------------------------------------------------------------------------------


def corrupt_cases() -> list[Any]:
    good = json.loads(encode(sample()))

    def edited(**changes: Any) -> bytes:
        obj = {**good, **changes}
        return json.dumps(obj).encode()

    def retyped() -> bytes:
        """A valid checksum over a wrong type: strict decoding still refuses it."""
        obj = json.loads(encode(sample()))
        obj["claims"][UID_A]["devices"][0]["gpuMinor"] = "0"
        del obj["checksum"]
        obj["checksum"] = checksum_of(obj)
        return json.dumps(obj).encode()

    return [
        pytest.param(edited(bootID=OTHER_BOOT), "checksum mismatch", id="checksum-mismatch"),
        pytest.param(encode(sample())[:-40], "not valid JSON", id="truncated"),
        pytest.param(b"\x00\x00\x00\x00", "not valid JSON", id="zeros"),
        pytest.param(b"", "not valid JSON", id="empty"),
        pytest.param(b"[1, 2]", "expected a JSON object", id="not-an-object"),
        pytest.param(edited(kind="ConfigMap"), "kind is 'ConfigMap'", id="wrong-kind"),
        pytest.param(edited(apiVersion="other/v1"), "apiVersion", id="wrong-api-version"),
        pytest.param(edited(version="1"), "expected an integer", id="version-string"),
        pytest.param(edited(version=-1), "unknown checkpoint version", id="version-negative"),
        pytest.param(retyped(), "gpuMinor: expected an integer", id="wrong-type"),
    ]


@pytest.mark.parametrize(("data", "reason"), corrupt_cases())
def test_corrupt_file_is_moved_aside(
    store: CheckpointStore, path: Path, data: bytes, reason: str
) -> None:
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    result = store.load()
    assert result.checkpoint == Checkpoint(BOOT)
    assert result.corrupt_moved_to == path.with_name("checkpoint.json.corrupt-20240531T160837Z")
    assert result.corrupt_moved_to.read_bytes() == data  # the original bytes, kept for forensics
    assert result.corrupt_reason is not None and reason in result.corrupt_reason
    assert not path.exists()
    assert not result.rebooted


def test_corrupt_copies_are_never_overwritten(store: CheckpointStore, path: Path) -> None:
    path.parent.mkdir(parents=True)
    moved = []
    for i in range(3):
        path.write_bytes(f"garbage {i}".encode())
        result = store.load()  # the clock does not move: same timestamp each time
        assert result.corrupt_moved_to is not None
        moved.append(result.corrupt_moved_to)
    assert [p.name for p in moved] == [
        "checkpoint.json.corrupt-20240531T160837Z",
        "checkpoint.json.corrupt-20240531T160837Z.1",
        "checkpoint.json.corrupt-20240531T160837Z.2",
    ]
    assert [p.read_text() for p in moved] == ["garbage 0", "garbage 1", "garbage 2"]


def test_decode_raises_corrupt() -> None:
    with pytest.raises(CheckpointCorrupt, match="not valid JSON"):
        decode(b"{")


# --- versions ---------------------------------------------------------------------------------


def test_newer_version_is_refused_and_left_alone(store: CheckpointStore, path: Path) -> None:
    obj = {
        "apiVersion": "tessera.dev/v2",
        "kind": "Checkpoint",
        "version": CHECKPOINT_VERSION + 1,
        "somethingNew": True,
        "checksum": "sha512:whatever",
    }
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(obj))
    before = path.read_bytes()
    with pytest.raises(CheckpointTooNew) as info:
        store.load()
    message = str(info.value)
    assert str(path) in message
    assert f"version {CHECKPOINT_VERSION + 1}" in message
    assert f"up to {CHECKPOINT_VERSION}" in message
    assert "upgrade Tessera or move the file aside" in message
    assert (info.value.version, info.value.supported) == (
        CHECKPOINT_VERSION + 1,
        CHECKPOINT_VERSION,
    )
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.json"]


def v0_document(boot: str = BOOT) -> dict[str, Any]:
    return {
        "version": 0,
        "bootId": boot,
        "preparedClaims": [
            {
                "uid": UID_A,
                "namespace": "team-a",
                "name": "train",
                "status": "PrepareCompleted",
                "devices": [
                    {
                        "requests": ["gpu"],
                        "pool": "node-a",
                        "device": "gpu-0",
                        "cdiDevices": [f"k8s.gpu.tessera.dev/claim={UID_A}-gpu-0"],
                        "type": "gpu",
                        "uuid": "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd",
                        "minor": 0,
                    }
                ],
            },
            {
                "uid": UID_B,
                "namespace": "team-b",
                "name": "notebook",
                "status": "PrepareStarted",
                "devices": [
                    {
                        "requests": ["small", "also-small"],
                        "pool": "node-a",
                        "device": "gpu-1-mig-1g10gb-19-0",
                        "cdiDevices": [f"k8s.gpu.tessera.dev/claim={UID_B}-gpu-1-mig-1g10gb-19-0"],
                        "type": "mig",
                        "uuid": "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd",
                        "minor": 1,
                        "migUuid": "MIG-11111111-2222-3333-4444-555555555555",
                        "giId": 9,
                        "ciId": 0,
                    }
                ],
            },
        ],
    }


def expected_from_v0() -> Checkpoint:
    a = dataclasses.replace(claim_a(), devices=(gpu_device("gpu-0", 0),), updated_at=0.0)
    b = dataclasses.replace(claim_b(), updated_at=0.0)
    return Checkpoint(BOOT, {UID_A: a, UID_B: b})


def test_migration_table_covers_every_older_version() -> None:
    assert sorted(MIGRATIONS) == list(range(CHECKPOINT_VERSION))


def test_v0_migration(store: CheckpointStore, path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(v0_document()))
    result = store.load()
    assert result.migrated_from == 0
    assert result.corrupt_moved_to is None
    assert result.checkpoint == expected_from_v0()


def test_v0_round_trip(store: CheckpointStore, path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(v0_document()))
    first = store.load()
    store.save(first.checkpoint)
    assert json.loads(path.read_text())["version"] == 1  # the lowest version that holds it
    second = store.load()
    assert second.checkpoint == first.checkpoint
    assert (first.migrated_from, second.migrated_from) == (0, None)


def test_v0_of_another_boot(store: CheckpointStore, path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(v0_document(OTHER_BOOT)))
    result = store.load()
    assert (result.rebooted, result.migrated_from) == (True, 0)
    assert result.checkpoint == Checkpoint(BOOT)


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda d: d["preparedClaims"][0].pop("uid"), id="missing-uid"),
        pytest.param(lambda d: d["preparedClaims"][0].update(status="Done"), id="bad-status"),
        pytest.param(lambda d: d["preparedClaims"][1]["devices"][0].update(giId="9"), id="gi-str"),
        pytest.param(lambda d: d["preparedClaims"].append(d["preparedClaims"][0]), id="dup-uid"),
    ],
)
def test_broken_v0_is_corrupt(store: CheckpointStore, path: Path, edit: Any) -> None:
    doc = v0_document()
    edit(doc)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    result = store.load()
    assert result.corrupt_moved_to is not None
    assert result.checkpoint == Checkpoint(BOOT)


# --- boot id ----------------------------------------------------------------------------------


def test_other_boot_discards_claims(path: Path) -> None:
    CheckpointStore(path, OTHER_BOOT).save(
        Checkpoint(OTHER_BOOT).with_claim(claim_a()).with_claim(claim_b())
    )
    result = CheckpointStore(path, BOOT).load()
    assert result.rebooted
    assert result.checkpoint == Checkpoint(BOOT)
    assert result.corrupt_moved_to is None
    assert path.exists()  # nothing is deleted until the caller saves


# --- the Checkpoint value ---------------------------------------------------------------------


def test_holder_of() -> None:
    cp = sample()
    assert cp.holder_of("node-a", "gpu-3") == claim_a()
    assert cp.holder_of("node-a", "gpu-1-mig-1g10gb-19-0") == claim_b()  # PrepareStarted too
    assert cp.holder_of("node-a", "gpu-1") is None
    assert cp.holder_of("node-b", "gpu-0") is None


def test_with_and_without_claim_do_not_modify() -> None:
    empty = Checkpoint(BOOT)
    one = empty.with_claim(claim_a(PREPARE_STARTED))
    assert empty.claims == {}
    assert set(one.claims) == {UID_A}
    done = one.with_claim(claim_a(PREPARE_COMPLETED))
    assert one.claims[UID_A].state == PREPARE_STARTED
    assert done.claims[UID_A].state == PREPARE_COMPLETED
    gone = done.without_claim(UID_A)
    assert gone == empty and UID_A in done.claims
    assert done.without_claim("not-there") == done


def test_checkpoint_is_read_only() -> None:
    source = {UID_A: claim_a()}
    cp = Checkpoint(BOOT, source)
    source[UID_B] = claim_b()  # the checkpoint holds its own copy
    assert set(cp.claims) == {UID_A}
    with pytest.raises(TypeError):
        cp.claims[UID_B] = claim_b()  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cp.boot_id = OTHER_BOOT  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        claim_a().state = PREPARE_STARTED  # type: ignore[misc]


def test_lists_become_tuples() -> None:
    dev = dataclasses.replace(gpu_device(), request_names=["gpu"], cdi_device_ids=["x/y=z"])  # type: ignore[arg-type]
    assert dev.request_names == ("gpu",) and dev.cdi_device_ids == ("x/y=z",)


def test_claim_key_must_match_uid() -> None:
    with pytest.raises(ValueError, match="has uid"):
        Checkpoint(BOOT, {UID_B: claim_a()})


def test_sharing_records_are_written_as_version_2_and_read_back(store: CheckpointStore, path: Path):
    from dra_driver.kubeletplugin.checkpoint import MpsRecord

    mig = PreparedDevice(
        ("mig",), "node-a", "gpu-0-mig-1g10gb-19-3", ("k8s.x/claim=u-d",), "mig", "GPU-0", 0,
        mig_uuid="MIG-1", gpu_instance_id=9, compute_instance_id=0, placement=(19, 3, 1),
        sharing="MPS",
    )  # fmt: skip
    shared = PreparedDevice(
        ("gpu",), "node-a", "gpu-1", ("k8s.x/claim=u-g",), "gpu", "GPU-1", 1,
        sharing="MemoryShare", share_id="3f2a", memory_bytes=4 * 1024**3,
    )  # fmt: skip
    entry = ClaimEntry(
        "uid-a", "ns", "a", PREPARE_COMPLETED, (mig, shared), 5.0,
        mps=MpsRecord(42, 1700000000.5, "/s/mps/uid-a/pipe", "/s/mps/uid-a/log",
                      "/s/mps/uid-a/shm", ("MIG-1",)),
        pods=("pod-1", "pod-2"),
    )  # fmt: skip
    store.save(Checkpoint(BOOT, {"uid-a": entry}))
    assert json.loads(path.read_text())["version"] == 2
    result = store.load()
    assert result.checkpoint.claims["uid-a"] == entry and result.migrated_from is None
    # an older build (version 1 only) refuses it rather than misread it
    assert "version 2" in str(CheckpointTooNew(str(path), 2, 1))


def test_a_power_cap_is_written_as_version_3_and_read_back(
    store: CheckpointStore, path: Path
) -> None:
    """A capped GPU's record (the cap and the limit to set back) needs version 3, so that a build
    that does not know power limits refuses the file instead of never setting the limit back;
    once no claim caps a GPU the file is the lowest version again."""
    capped = dataclasses.replace(
        gpu_device("gpu-2", 2), power_limit_mw=350_000, power_restore_mw=700_000
    )
    entry = dataclasses.replace(claim_a(), devices=(capped,))
    store.save(Checkpoint(BOOT, {entry.uid: entry}))
    obj = json.loads(path.read_text())
    assert obj["version"] == 3
    (device,) = obj["claims"][entry.uid]["devices"]
    assert (device["powerLimitMilliwatts"], device["powerRestoreMilliwatts"]) == (350_000, 700_000)
    assert store.load().checkpoint.claims[entry.uid] == entry
    store.save(Checkpoint(BOOT, {}))
    assert json.loads(path.read_text())["version"] == 1


def test_a_version_2_file_is_read_by_this_build(store: CheckpointStore, path: Path) -> None:
    entry = dataclasses.replace(claim_a(), pods=("pod-1",))
    store.save(Checkpoint(BOOT, {entry.uid: entry}))
    obj = json.loads(path.read_text())
    assert obj["version"] == 2
    result = store.load()
    assert result.checkpoint.claims[entry.uid] == entry
    assert result.migrated_from is None  # versions 1..3 are current formats


def test_a_devices_class_is_kept_and_an_older_checkpoint_reads_it_as_unknown(
    store: CheckpointStore, path: Path
) -> None:
    """The DeviceClass that labels a holding's usage survives a restart; a checkpoint written
    before it was recorded (no ``deviceClass``) reads as "" (unknown)."""
    labelled = dataclasses.replace(gpu_device(), device_class="gpu.tessera.dev")
    entry = dataclasses.replace(claim_a(), devices=(labelled, gpu_device("gpu-3", 3)))
    store.save(Checkpoint(BOOT, {UID_A: entry}))
    assert path.read_text().count('"deviceClass"') == 1  # written only when known
    loaded = store.load().checkpoint.claims[UID_A].devices
    assert [d.device_class for d in loaded] == ["gpu.tessera.dev", ""]


def test_vm_devices_are_written_as_version_4_and_read_back(
    store: CheckpointStore, path: Path
) -> None:
    """A GPU handed to a VM (its group's functions with the drivers they had) and a vGPU (its VF
    or mdev UUID) need version 4: a build that does not know them must refuse the file (it would
    call the kind corrupt, move the file aside and never bind the GPU back); a version 3 file
    (a capped GPU) is still read, and once no claim holds a VM device the file is the lowest
    version again."""
    vfio = dataclasses.replace(
        gpu_device("gpu-0-vfio", 0), kind="vfio", pci_bus_id="0000:1b:00.0", iommu_group=12,
        vfio_functions=(("0000:1b:00.0", "nvidia"), ("0000:1b:00.1", "snd_hda_intel")),
    )  # fmt: skip
    mdev = dataclasses.replace(
        gpu_device("gpu-1-vgpu-230-0", 1), kind="vgpu", pci_bus_id="0000:3c:00.0",
        iommu_group=101, vgpu_type_id=230, mdev_uuid="00000000-0000-4000-8000-000000000001",
    )  # fmt: skip
    entry = dataclasses.replace(claim_a(), devices=(vfio, mdev))
    store.save(Checkpoint(BOOT, {entry.uid: entry}))
    obj = json.loads(path.read_text())
    assert obj["version"] == 4
    device = obj["claims"][entry.uid]["devices"][0]
    assert device["vfioFunctions"] == [
        ["0000:1b:00.0", "nvidia"],
        ["0000:1b:00.1", "snd_hda_intel"],
    ]
    result = store.load()
    assert result.checkpoint.claims[entry.uid] == entry and result.migrated_from is None
    assert "version 4" in str(CheckpointTooNew(str(path), 4, 3))  # what a version-3 build says
    capped = dataclasses.replace(gpu_device("gpu-2", 2), power_limit_mw=350_000)
    store.save(Checkpoint(BOOT, {UID_A: dataclasses.replace(claim_a(), devices=(capped,))}))
    assert json.loads(path.read_text())["version"] == 3
    assert store.load().checkpoint.claims[UID_A].devices == (capped,)
    store.save(Checkpoint(BOOT, {}))
    assert json.loads(path.read_text())["version"] == 1


def test_a_malformed_vfio_function_list_is_corrupt() -> None:
    vfio = dataclasses.replace(gpu_device("gpu-0-vfio"), kind="vfio", vfio_functions=(("a", "b"),))
    obj = json.loads(
        encode(Checkpoint(BOOT, {UID_A: dataclasses.replace(claim_a(), devices=(vfio,))}))
    )
    obj["claims"][UID_A]["devices"][0]["vfioFunctions"] = [["0000:1b:00.0"]]
    obj["checksum"] = checksum_of(obj)
    with pytest.raises(CheckpointCorrupt, match="vfioFunctions"):
        decode(json.dumps(obj).encode())
