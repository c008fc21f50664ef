"""CDI specs: contents, schema validation, MIG capability nodes, names, files on disk.

The driver's files in the base spec, host/container paths and the loader's view of them are in
test_cdi_driver_files.py."""

from __future__ import annotations

import copy
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest

from agent.sim.driverroot import caps_minor, make_device_node, write_driver_root
from agent.sim.model import load_model
from dra_driver.errors import CdiError
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.cdi_spec import CDI_VERSION, CdiRequest, validate_spec

DRIVER = "gpu.tessera.dev"
UID = "7f3c2a1e-9b8d-4c6f-a5e4-3d2c1b0a9f8e"
UID2 = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
MIG_NAME = "gpu-2-mig-1g10gb-19-0"
LIB_OPTS = ["ro", "nosuid", "nodev", "rbind", "rprivate"]


@pytest.fixture(scope="module")
def driver_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("driver-root")
    write_driver_root(load_model("dgx-h100"), root)
    return root


@pytest.fixture(scope="module")
def version() -> str:
    return load_model("dgx-h100").driver_version


@pytest.fixture
def cdi_root(tmp_path: Path) -> Path:
    return tmp_path / "cdi"


@pytest.fixture
def writer(cdi_root: Path, driver_root: Path, version: str) -> CdiWriter:
    """The agent sees the host's / at ``driver_root`` (as the DaemonSet mounts it)."""
    return CdiWriter(
        cdi_root,
        DRIVER,
        driver_root,
        version,
        host_driver_root=Path("/"),
        make_node=make_device_node,
    )


def nodes(edits: dict[str, Any]) -> list[str]:
    return [n["path"] for n in edits["deviceNodes"]]


# --- building specs ---------------------------------------------------------------------------


def test_whole_gpu_spec(writer: CdiWriter) -> None:
    spec = writer.build_spec(UID, [CdiRequest("gpu-0", 0), CdiRequest("gpu-5", 5)])
    validate_spec(spec)
    assert spec["cdiVersion"] == CDI_VERSION == "0.5.0"
    assert spec["kind"] == f"k8s.{DRIVER}/claim"
    assert [d["name"] for d in spec["devices"]] == [f"{UID}-gpu-0", f"{UID}-gpu-5"]
    assert spec["devices"][1]["containerEdits"] == {
        "deviceNodes": [{"path": "/dev/nvidia5", "hostPath": "/dev/nvidia5"}]
    }
    # the driver's files and control nodes are in the base spec, named by every device
    assert spec["containerEdits"] == {
        "env": [f"TESSERA_CLAIM_UID={UID}", "TESSERA_DEVICES=gpu-0,gpu-5"]
    }


def test_base_spec_holds_the_control_nodes_and_libraries(
    writer: CdiWriter, driver_root: Path, version: str
) -> None:
    spec = writer.build_base_spec()
    validate_spec(spec)
    assert spec["kind"] == f"k8s.{DRIVER}/driver"
    assert spec["devices"] == [
        {"name": "common", "containerEdits": {"env": [f"TESSERA_DRIVER_VERSION={version}"]}}
    ]
    assert writer.base_device_id == f"k8s.{DRIVER}/driver=common"
    edits = spec["containerEdits"]
    assert nodes(edits) == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert all(n["hostPath"] == n["path"] for n in edits["deviceNodes"])
    assert not any(e.startswith("NVIDIA_VISIBLE_DEVICES") for e in edits.get("env", []))
    libs = "/usr/lib/x86_64-linux-gnu"
    assert {
        "hostPath": f"{libs}/libcuda.so.{version}",
        "containerPath": f"{libs}/libcuda.so.1",
        "options": LIB_OPTS,
    } in edits["mounts"]
    assert not [m for m in edits["mounts"] if str(driver_root) in m["hostPath"]]


def test_mig_spec_reads_caps_minors(writer: CdiWriter) -> None:
    spec = writer.build_spec(
        UID, [CdiRequest(MIG_NAME, 2, gpu_instance_id=9, compute_instance_id=0)]
    )
    validate_spec(spec)
    (dev,) = spec["devices"]
    assert dev["name"] == f"{UID}-{MIG_NAME}"
    gi, ci = caps_minor(2, 9), caps_minor(2, 9, 0)
    assert (gi, ci) == (3 + 2 * 135 + 81, 3 + 2 * 135 + 81 + 1)
    assert nodes(dev["containerEdits"]) == [
        "/dev/nvidia2",
        f"/dev/nvidia-caps/nvidia-cap{gi}",
        f"/dev/nvidia-caps/nvidia-cap{ci}",
    ]
    assert spec["containerEdits"]["env"][1] == f"TESSERA_DEVICES={MIG_NAME}"


def test_caps_minor_comes_from_the_file_not_a_formula(tmp_path: Path, version: str) -> None:
    root = tmp_path / "root"
    write_driver_root(load_model("dgx-h100"), root)
    access = root / "proc/driver/nvidia/capabilities/gpu0/mig/gi3/ci1/access"
    access.write_text("DeviceFileMinor: 4242\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    w = CdiWriter(tmp_path / "cdi", DRIVER, root, version, make_node=make_device_node)
    spec = w.build_spec(UID, [CdiRequest("gpu-0-mig-1g10gb-19-3", 0, 3, 1)])
    assert nodes(spec["devices"][0]["containerEdits"])[2] == "/dev/nvidia-caps/nvidia-cap4242"


def _read_only_under(root: Path, err: int = errno.EROFS) -> Any:
    """A ``make_node`` for which ``root`` is a read-only mount (the container-driver component
    mounts the driver container's root read-only): making a node there fails as mknod(2) does."""

    def make(path: Path, major: int, minor: int, mode: int) -> None:
        if path.is_relative_to(root):
            raise OSError(err, os.strerror(err), str(path))
        make_device_node(path, major, minor, mode)

    return make


def test_a_read_only_driver_root_gets_its_caps_nodes_made_in_the_hosts_dev(
    tmp_path: Path, version: str
) -> None:
    """Issue 23 item 8: with the container-driver component the dev root is the driver
    container's, mounted read-only; a MIG prepare must not fail for a capability node it cannot
    make there. The node is made in the host's /dev instead, and the spec names it there."""
    root, host_dev = tmp_path / "driver-root", tmp_path / "host"
    write_driver_root(load_model("dgx-h100"), root)
    assert (root / "dev").is_dir()  # a dev root: the driver container's /dev
    w = CdiWriter(
        tmp_path / "cdi", DRIVER, root, version, host_driver_root=Path("/run/nvidia/driver"),
        make_node=_read_only_under(root), caps_fallback_root=host_dev,
    )  # fmt: skip
    spec = w.build_spec(UID, [CdiRequest(MIG_NAME, 2, gpu_instance_id=9, compute_instance_id=0)])
    validate_spec(spec)
    gi = caps_minor(2, 9)
    by_path = {n["path"]: n for n in spec["devices"][0]["containerEdits"]["deviceNodes"]}
    caps = by_path[f"/dev/nvidia-caps/nvidia-cap{gi}"]
    assert caps["hostPath"] == str(host_dev / f"dev/nvidia-caps/nvidia-cap{gi}")
    assert (host_dev / f"dev/nvidia-caps/nvidia-cap{gi}").is_file()  # the simulator's mknod
    assert by_path["/dev/nvidia2"]["hostPath"] == "/run/nvidia/driver/dev/nvidia2"  # as before
    again = w.build_spec(UID, [CdiRequest(MIG_NAME, 2, gpu_instance_id=9, compute_instance_id=0)])
    assert again == spec  # found there the next time, not made again


def test_a_caps_node_that_cannot_be_made_for_another_reason_is_still_an_error(
    tmp_path: Path, version: str
) -> None:
    root = tmp_path / "driver-root"
    write_driver_root(load_model("dgx-h100"), root)
    w = CdiWriter(
        tmp_path / "cdi", DRIVER, root, version,
        make_node=_read_only_under(root, errno.EPERM), caps_fallback_root=tmp_path / "host",
    )  # fmt: skip
    with pytest.raises(CdiError, match="the agent needs CAP_MKNOD"):
        w.build_spec(UID, [CdiRequest(MIG_NAME, 2, gpu_instance_id=9, compute_instance_id=0)])
    assert not (tmp_path / "host").exists()


def test_mixed_claim(writer: CdiWriter) -> None:
    spec = writer.build_spec(
        UID, [CdiRequest("gpu-0", 0), CdiRequest("gpu-1-mig-1g10gb-19-0", 1, 11, 0)]
    )
    validate_spec(spec)
    assert [len(d["containerEdits"]["deviceNodes"]) for d in spec["devices"]] == [1, 3]


@pytest.mark.parametrize(
    ("rel", "which"),
    [
        pytest.param("gpu2/mig/gi9/access", "gi9/access", id="gi"),
        pytest.param("gpu2/mig/gi9/ci0/access", "gi9/ci0/access", id="ci"),
    ],
)
def test_missing_caps_file_is_an_error(tmp_path: Path, version: str, rel: str, which: str) -> None:
    root = tmp_path / "root"
    write_driver_root(load_model("dgx-h100"), root)
    (root / "proc/driver/nvidia/capabilities" / rel).unlink()
    w = CdiWriter(tmp_path / "cdi", DRIVER, root, version, make_node=make_device_node)
    with pytest.raises(CdiError, match=f"{which} does not exist"):
        w.build_spec(UID, [CdiRequest(MIG_NAME, 2, 9, 0)])


def test_no_caps_for_non_mig_node(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = load_model("l40s-pcie")
    write_driver_root(model, root)
    w = CdiWriter(tmp_path / "cdi", DRIVER, root, model.driver_version, make_node=make_device_node)
    validate_spec(w.build_spec(UID, [CdiRequest("gpu-0", 0)]))
    with pytest.raises(CdiError, match="capabilities/gpu0/mig/gi1/access does not exist"):
        w.build_spec(UID, [CdiRequest("gpu-0-mig-x", 0, 1, 0)])


def test_caps_file_without_minor(tmp_path: Path, version: str) -> None:
    root = tmp_path / "root"
    write_driver_root(load_model("dgx-h100"), root)
    (root / "proc/driver/nvidia/capabilities/gpu0/mig/gi1/access").write_text("garbage\n")
    w = CdiWriter(tmp_path / "cdi", DRIVER, root, version, make_node=make_device_node)
    with pytest.raises(CdiError, match="no 'DeviceFileMinor"):
        w.build_spec(UID, [CdiRequest("gpu-0-mig-a", 0, 1, 0)])


def test_mig_needs_both_instance_ids(writer: CdiWriter) -> None:
    with pytest.raises(CdiError, match="both the GPU instance id and the compute instance id"):
        writer.build_spec(UID, [CdiRequest(MIG_NAME, 2, gpu_instance_id=9)])


def test_libraries_found_in_other_dirs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/lib64").mkdir(parents=True)
    (root / "usr/lib").mkdir(parents=True)
    (root / "usr/lib64/libnvidia-ml.so.535.1").write_bytes(b"")
    (root / "usr/lib/libcuda.so.535.1").write_bytes(b"")
    (root / "usr/lib/libcudadebugger.so.535.1").write_bytes(b"")
    (root / "usr/lib/libnvidia-nvvm.so.999.9").write_bytes(b"")  # other driver version: ignored
    w = CdiWriter(tmp_path / "cdi", DRIVER, root, "535.1", hook="/usr/bin/nvidia-cdi-hook")
    mounts = w.build_base_spec()["containerEdits"]["mounts"]
    assert [m["containerPath"] for m in mounts] == [
        "/usr/lib64/libnvidia-ml.so.535.1",
        "/usr/lib/libcuda.so.535.1",
        "/usr/lib/libcudadebugger.so.535.1",
    ]
    assert mounts[0]["hostPath"] == str(root / "usr/lib64/libnvidia-ml.so.535.1")


def test_no_libraries_no_mounts(tmp_path: Path) -> None:
    w = CdiWriter(tmp_path / "cdi", DRIVER, tmp_path / "empty-root", "550.90.07")
    spec = w.build_spec(UID, [CdiRequest("gpu-0", 0)])
    validate_spec(spec)
    assert "mounts" not in spec["containerEdits"]
    base = w.build_base_spec()
    validate_spec(base)
    assert "mounts" not in base["containerEdits"] and "hooks" not in base["containerEdits"]


# --- names ------------------------------------------------------------------------------------


def test_device_id_and_path(writer: CdiWriter, cdi_root: Path) -> None:
    assert writer.kind == "k8s.gpu.tessera.dev/claim"
    assert writer.device_id(UID, "gpu-0") == f"k8s.gpu.tessera.dev/claim={UID}-gpu-0"
    assert writer.device_id(UID, MIG_NAME) == f"k8s.gpu.tessera.dev/claim={UID}-{MIG_NAME}"
    assert writer.path(UID) == cdi_root / f"k8s.gpu.tessera.dev-claim_{UID}.json"


def test_device_ids_name_the_spec_devices(writer: CdiWriter) -> None:
    spec = writer.build_spec(UID, [CdiRequest("gpu-0", 0)])
    kind, _, name = writer.device_id(UID, "gpu-0").partition("=")
    assert (kind, name) == (spec["kind"], spec["devices"][0]["name"])


BAD_UIDS = ["../etc", "..", "ABC-def", "a/b", "", "-abc", "abc-", "a" * 64, "x.y", "uid\n"]


@pytest.mark.parametrize("uid", BAD_UIDS)
def test_bad_claim_uid(writer: CdiWriter, uid: str) -> None:
    for call in (
        lambda: writer.path(uid),
        lambda: writer.device_id(uid, "gpu-0"),
        lambda: writer.build_spec(uid, [CdiRequest("gpu-0", 0)]),
        lambda: writer.write(uid, {}),
        lambda: writer.remove(uid),
    ):
        with pytest.raises(CdiError, match="claim UID") as info:
            call()
        assert repr(uid) in str(info.value)


@pytest.mark.parametrize("name", ["GPU-0", "gpu_0", "../gpu-0", "gpu-0/x", "", "-gpu", "g" * 64])
def test_bad_device_name(writer: CdiWriter, name: str) -> None:
    with pytest.raises(CdiError, match="device name") as info:
        writer.build_spec(UID, [CdiRequest(name, 0)])
    assert repr(name) in str(info.value)
    with pytest.raises(CdiError, match="device name"):
        writer.device_id(UID, name)


def test_duplicate_and_empty_device_lists(writer: CdiWriter) -> None:
    with pytest.raises(CdiError, match="listed twice"):
        writer.build_spec(UID, [CdiRequest("gpu-0", 0), CdiRequest("gpu-0", 0)])
    with pytest.raises(CdiError, match="no devices"):
        writer.build_spec(UID, [])


@pytest.mark.parametrize(
    ("driver", "version", "match"),
    [
        pytest.param("Gpu.Tessera.dev", "550.90.07", "driver name", id="upper-driver"),
        pytest.param("../x", "550.90.07", "driver name", id="path-driver"),
        pytest.param(DRIVER, "550/../x", "driver version", id="path-version"),
        pytest.param(DRIVER, "", "driver version", id="empty-version"),
    ],
)
def test_bad_constructor_values(tmp_path: Path, driver: str, version: str, match: str) -> None:
    with pytest.raises(CdiError, match=match):
        CdiWriter(tmp_path, driver, tmp_path, version)


# --- validation -------------------------------------------------------------------------------


def good_spec() -> dict[str, Any]:
    return {
        "cdiVersion": "0.5.0",
        "kind": "k8s.gpu.tessera.dev/claim",
        "devices": [{"name": "a", "containerEdits": {"deviceNodes": [{"path": "/dev/x"}]}}],
        "containerEdits": {"env": ["A=b"]},
    }


def broken(edit: Any) -> dict[str, Any]:
    spec = copy.deepcopy(good_spec())
    edit(spec)
    return spec


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        pytest.param(
            broken(lambda s: s["devices"][0].pop("name")), "'name' is a required", id="no-name"
        ),
        pytest.param(broken(lambda s: s.pop("kind")), "'kind' is a required", id="no-kind"),
        pytest.param(broken(lambda s: s.update(devices={})), "devices", id="devices-not-list"),
        pytest.param(
            broken(lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].pop("path")),
            "devices/0/containerEdits/deviceNodes/0",
            id="node-without-path",
        ),
        pytest.param(
            broken(lambda s: s["containerEdits"].update(mounts=[{"hostPath": "/x"}])),
            "'containerPath' is a required",
            id="mount-without-container-path",
        ),
        pytest.param(
            broken(
                lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(major=-1 << 64)
            ),
            "major",
            id="major-out-of-range",
        ),
        pytest.param(
            broken(lambda s: s.update(kind="no-slash")), "<vendor>/<class>", id="kind-form"
        ),
        pytest.param(
            broken(lambda s: s["devices"][0].update(name="-a")), "CDI device name", id="bad-name"
        ),
        pytest.param(
            broken(lambda s: s["devices"].append(copy.deepcopy(s["devices"][0]))),
            "appears twice",
            id="duplicate-name",
        ),
        pytest.param(
            broken(lambda s: s["containerEdits"].update(env=["NOEQUALS"])), "KEY=VALUE", id="env"
        ),
        pytest.param(
            broken(lambda s: s["containerEdits"].update(env=[1])), "KEY=VALUE", id="env-type"
        ),
    ],
)
def test_validate_spec_rejects(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(CdiError, match=match):
        validate_spec(spec)


def test_validate_spec_accepts_minimal() -> None:
    validate_spec(good_spec())


def test_packaged_schema_is_the_reference_copy() -> None:
    """The package carries its own copy (tests read nothing outside the repository); it must
    stay a verbatim copy of the CDI project's schema."""
    from importlib import resources

    base = resources.files("dra_driver.kubeletplugin").joinpath("cdi_schema")
    schema = json.loads(base.joinpath("schema.json").read_text())
    defs = json.loads(base.joinpath("defs.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["properties"]["devices"]["items"]["properties"]["containerEdits"] == {
        "$ref": "defs.json#/definitions/containerEdits"
    }
    assert {"DeviceNode", "Mount", "Hook", "containerEdits"} <= set(defs["definitions"])


# --- files ------------------------------------------------------------------------------------


def test_write_file(writer: CdiWriter, cdi_root: Path) -> None:
    spec = writer.build_spec(UID, [CdiRequest("gpu-0", 0)])
    path = writer.write(UID, spec)
    assert path == cdi_root / f"k8s.{DRIVER}-claim_{UID}.json"
    assert json.loads(path.read_text()) == spec
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    writer.write(UID, writer.build_spec(UID, [CdiRequest("gpu-1", 1)]))  # replace
    assert json.loads(path.read_text())["devices"][0]["name"] == f"{UID}-gpu-1"
    # the base spec the devices also name came with the first claim; no temp files left
    assert sorted(os.listdir(cdi_root)) == sorted([path.name, writer.base_path.name])
    assert json.loads(writer.base_path.read_text()) == writer.build_base_spec()
    assert stat.S_IMODE(writer.base_path.stat().st_mode) == 0o644


def test_write_refuses_invalid_or_foreign_specs(writer: CdiWriter, cdi_root: Path) -> None:
    with pytest.raises(CdiError, match="required"):
        writer.write(UID, {"kind": writer.kind})
    with pytest.raises(CdiError, match="not this driver's"):
        writer.write(UID, good_spec() | {"kind": "example.com/gpu"})
    assert not cdi_root.exists() or not list(cdi_root.iterdir())


def test_failed_write_leaves_no_temp_file(
    writer: CdiWriter, cdi_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = writer.build_spec(UID, [CdiRequest("gpu-0", 0)])
    writer.write(UID, spec)
    before = writer.path(UID).read_bytes()

    def boom(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(CdiError, match="cannot write CDI spec"):
        writer.write(UID, writer.build_spec(UID, [CdiRequest("gpu-1", 1)]))
    monkeypatch.undo()
    assert writer.path(UID).read_bytes() == before
    assert sorted(os.listdir(cdi_root)) == sorted([writer.path(UID).name, writer.base_path.name])


def test_remove(writer: CdiWriter) -> None:
    writer.write(UID, writer.build_spec(UID, [CdiRequest("gpu-0", 0)]))
    assert writer.remove(UID) is True
    assert not writer.path(UID).exists()
    assert writer.remove(UID) is False
    assert writer.remove(UID2) is False


def test_claim_uids(writer: CdiWriter, cdi_root: Path) -> None:
    assert writer.claim_uids() == set()  # no directory yet
    for uid in (UID, UID2):
        writer.write(uid, writer.build_spec(uid, [CdiRequest("gpu-0", 0)]))
    strangers = [
        f"k8s.other.dev-claim_{UID}.json",  # another driver
        f"k8s.{DRIVER}-claim_{UID}.yaml",
        f"k8s.{DRIVER}-claim_{UID}.json.bak",
        f"k8s.{DRIVER}-claim_BAD.json",
        f".k8s.{DRIVER}-claim_{UID}.json.abc.tmp",  # an interrupted write
        "nvidia.yaml",
        f"k8s.{DRIVER}Xclaim_{UID}.json",  # the dot in the driver name is not a wildcard
    ]
    for name in strangers:
        (cdi_root / name).write_text("{}")
    (cdi_root / f"k8s.{DRIVER}-claim_0123").mkdir()
    assert writer.claim_uids() == {UID, UID2}
    writer.remove(UID)
    assert writer.claim_uids() == {UID2}
    assert (cdi_root / strangers[0]).exists()


def test_removing_a_spec_on_a_read_only_file_system(
    writer: CdiWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """unlink says EROFS before ENOENT on a read-only file system: a spec that is not there is
    removed all the same (a failed prepare's rollback must not hold its GPU for it), one that
    is there is an error naming it."""
    writer.write(UID, writer.build_spec(UID, [CdiRequest("gpu-0", 0)]))

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(CdiError, match=r"cannot remove CDI spec .*: Read-only file system"):
        writer.remove(UID)
    assert writer.remove_many([UID, "other-uid"]) == {UID: ANY}
    assert writer.remove("other-uid") is False
    monkeypatch.undo()
    assert writer.remove_many([UID, "other-uid"]) == {}
    assert not writer.path(UID).exists()


def test_a_vm_device_gets_vfio_nodes_only_from_the_hosts_dev_unless_the_dev_root_has_them(
    tmp_path: Path, version: str
) -> None:
    """A GPU handed to a VM (or a vGPU) is VFIO's container and its IOMMU group's node, never
    /dev/nvidia<minor>; the nodes are the kernel's in the host's /dev, unless the dev root has
    them (the simulator's dev tree)."""
    root = tmp_path / "driver"
    write_driver_root(load_model("dgx-h100"), root)
    w = CdiWriter(tmp_path / "cdi", DRIVER, root, version, host_driver_root=Path("/run/drv"))
    spec = w.build_spec(UID, [CdiRequest("gpu-0-vfio", 0, vfio_group=12)])  # schema-checked
    (device,) = spec["devices"]
    assert device["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/vfio/vfio", "hostPath": "/dev/vfio/vfio"},
        {"path": "/dev/vfio/12", "hostPath": "/dev/vfio/12"},
    ]
    (root / "dev" / "vfio").mkdir()
    (root / "dev" / "vfio" / "12").write_text("")
    (device,) = w.build_spec(UID, [CdiRequest("gpu-0-vfio", 0, vfio_group=12)])["devices"]
    assert device["containerEdits"]["deviceNodes"][1] == {
        "path": "/dev/vfio/12",
        "hostPath": "/run/drv/dev/vfio/12",
    }
