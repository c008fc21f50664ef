"""The driver's files in the base CDI spec: host paths everywhere a spec names a file, the
toolkit's hooks or the hook-free layout, and a container's loader finding libcuda.so.1 and
libnvidia-ml.so.1 through them in Ubuntu- and UBI-based CUDA images, from each driver layout.

A test node is a host file system ``host/`` with the simulated driver root where the layout's
host has it (``/``, or ``/run/nvidia/driver`` for the containerized driver); the agent sees that
same directory as its driver root. So every ``hostPath`` must exist under ``host/`` and none may
name the agent's path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from agent.driverfiles.discover import under
from agent.sim.driverroot import (
    CAPS_MAJOR,
    LAYOUTS,
    caps_minor,
    make_device_node,
    write_driver_root,
)
from agent.sim.model import load_model
from dra_driver.errors import CdiError
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.cdi_spec import NVIDIA_LIB64, CdiRequest, validate_spec
from tests.dra_driver.container_loader import Image, ubi_cuda_image, ubuntu_cuda_image

DRIVER = "gpu.tessera.dev"
UID = "7f3c2a1e-9b8d-4c6f-a5e4-3d2c1b0a9f8e"
MODEL = load_model("dgx-h100")
V = MODEL.driver_version
HOOK = "/usr/bin/nvidia-cdi-hook"
UBUNTU_LIBS = "/usr/lib/x86_64-linux-gnu"
IMAGES = {"ubuntu": ubuntu_cuda_image, "ubi": ubi_cuda_image}


def make_node(tmp: Path, layout: str, *, hook: str | None = None, host_root: str | None = None):
    """(host file system, CDI writer) of a node whose driver is in ``layout``."""
    host = tmp / "host"
    root_on_host = host_root or LAYOUTS[layout].host_root
    agent_view = under(host, root_on_host)
    write_driver_root(MODEL, agent_view, layout=layout)
    if hook is not None:
        exe = under(host, hook)
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    writer = CdiWriter(
        tmp / "cdi",
        DRIVER,
        agent_view,
        V,
        host_driver_root=Path(root_on_host),
        hook=hook,
        make_node=make_device_node,
    )
    return host, writer


def host_paths(spec: dict[str, Any]) -> list[str]:
    """Every host path a spec names: mounts, device nodes, hook binaries."""
    edits = [spec.get("containerEdits", {})] + [d["containerEdits"] for d in spec["devices"]]
    out: list[str] = []
    for e in edits:
        out += [m["hostPath"] for m in e.get("mounts", [])]
        out += [n["hostPath"] for n in e.get("deviceNodes", [])]
        out += [h["path"] for h in e.get("hooks", [])]
    return out


MIG = CdiRequest("gpu-2-mig-1g10gb-19-0", 2, gpu_instance_id=9, compute_instance_id=0)


@pytest.mark.parametrize("hook", [HOOK, None], ids=["hook", "hook-free"])
@pytest.mark.parametrize(
    ("layout", "host_root"),
    [("ubuntu", None), ("rhel", None), ("container", None), ("ubuntu", "/srv/gpu-driver")],
)
def test_every_path_in_a_spec_is_the_hosts(
    tmp_path: Path, layout: str, host_root: str | None, hook: str | None
) -> None:
    host, w = make_node(tmp_path, layout, hook=hook, host_root=host_root)
    root_on_host = host_root or LAYOUTS[layout].host_root
    base = w.build_base_spec()
    claim = w.build_spec(UID, [CdiRequest("gpu-0", 0), MIG])
    for spec in (base, claim):
        validate_spec(spec)
        assert str(tmp_path) not in repr(spec)  # never the agent's view of a file
    paths = host_paths(base) + host_paths(claim)
    assert len(paths) >= 25  # 10 libraries (x6 without a hook), 7 files, 3+3 nodes, 2 hooks
    for p in paths:
        assert p.startswith("/")
        if p != hook:
            assert p.startswith(root_on_host), p
        assert os.path.lexists(under(host, p)), f"{p} is not on the host"
    assert f"{root_on_host.rstrip('/')}{UBUNTU_LIBS if layout != 'rhel' else '/usr/lib64'}" in (
        "".join(paths)
    )


def test_hook_spec_is_the_toolkits(tmp_path: Path) -> None:
    _, w = make_node(tmp_path, "ubuntu", hook=HOOK)
    edits = w.build_base_spec()["containerEdits"]
    libs = [m for m in edits["mounts"] if "/lib" in m["containerPath"] and ".so" in m["hostPath"]]
    assert [m["containerPath"] for m in libs] == [
        f"{UBUNTU_LIBS}/{name}.{V}"
        for name in (
            "libnvidia-ml.so",
            "libnvidia-cfg.so",
            "libcuda.so",
            "libcudadebugger.so",
            "libnvidia-opencl.so",
            "libnvidia-gpucomp.so",
            "libnvidia-ptxjitcompiler.so",
            "libnvidia-allocator.so",
            "libnvidia-pkcs11-openssl3.so",
            "libnvidia-nvvm.so",
        )
    ]  # the versioned files only: the hooks make the other names
    env = ["NVIDIA_CTK_DEBUG=false"]
    links = [
        f"libnvidia-ml.so.{V}::{UBUNTU_LIBS}/libnvidia-ml.so.1",
        f"libnvidia-cfg.so.{V}::{UBUNTU_LIBS}/libnvidia-cfg.so.1",
        f"libcuda.so.1::{UBUNTU_LIBS}/libcuda.so",
        f"libcuda.so.{V}::{UBUNTU_LIBS}/libcuda.so.1",
        f"libcudadebugger.so.{V}::{UBUNTU_LIBS}/libcudadebugger.so.1",
        f"libnvidia-opencl.so.{V}::{UBUNTU_LIBS}/libnvidia-opencl.so.1",
        f"libnvidia-ptxjitcompiler.so.{V}::{UBUNTU_LIBS}/libnvidia-ptxjitcompiler.so.1",
        f"libnvidia-allocator.so.{V}::{UBUNTU_LIBS}/libnvidia-allocator.so.1",
        f"libnvidia-nvvm.so.{V}::{UBUNTU_LIBS}/libnvidia-nvvm.so.4",
    ]
    args = ["nvidia-cdi-hook", "create-symlinks"]
    for link in links:
        args += ["--link", link]
    assert edits["hooks"] == [
        {"hookName": "createContainer", "path": HOOK, "args": args, "env": env},
        {
            "hookName": "createContainer",
            "path": HOOK,
            "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", UBUNTU_LIBS],
            "env": env,
        },
    ]


def test_nvidia_ctk_runs_the_hooks_as_a_subcommand(tmp_path: Path) -> None:
    _, w = make_node(tmp_path, "rhel", hook="/usr/local/nvidia/toolkit/nvidia-ctk")
    hooks = w.build_base_spec()["containerEdits"]["hooks"]
    assert [h["args"][:3] for h in hooks] == [
        ["nvidia-ctk", "hook", "create-symlinks"],
        ["nvidia-ctk", "hook", "update-ldcache"],
    ]
    assert hooks[1]["args"][3:] == ["--folder", "/usr/lib64"]


def test_hook_free_spec_mounts_every_name(tmp_path: Path) -> None:
    _, w = make_node(tmp_path, "ubuntu")
    edits = w.build_base_spec()["containerEdits"]
    assert "hooks" not in edits
    cuda = f"/usr/lib/x86_64-linux-gnu/libcuda.so.{V}"
    assert [m["containerPath"] for m in edits["mounts"] if m["hostPath"] == cuda] == [
        f"{UBUNTU_LIBS}/libcuda.so.{V}",
        f"{UBUNTU_LIBS}/libcuda.so.1",
        f"{UBUNTU_LIBS}/libcuda.so",
        f"{NVIDIA_LIB64}/libcuda.so.{V}",
        f"{NVIDIA_LIB64}/libcuda.so.1",
        f"{NVIDIA_LIB64}/libcuda.so",
    ]
    gpucomp = [m["containerPath"] for m in edits["mounts"] if "gpucomp" in m["hostPath"]]
    assert gpucomp == [
        f"{UBUNTU_LIBS}/libnvidia-gpucomp.so.{V}",
        f"{NVIDIA_LIB64}/libnvidia-gpucomp.so.{V}",
    ]
    others = {m["containerPath"]: m for m in edits["mounts"] if ".so" not in m["hostPath"]}
    assert sorted(others) == [
        f"/lib/firmware/nvidia/{V}/gsp_ga10x.bin",
        f"/lib/firmware/nvidia/{V}/gsp_tu10x.bin",
        "/run/nvidia-fabricmanager/socket",
        "/run/nvidia-persistenced/socket",
        "/usr/bin/nvidia-cuda-mps-server",
        "/usr/bin/nvidia-debugdump",
        "/usr/bin/nvidia-persistenced",
    ]
    assert others["/lib/firmware/nvidia/" + V + "/gsp_ga10x.bin"]["hostPath"] == (
        f"/usr/lib/firmware/nvidia/{V}/gsp_ga10x.bin"
    )
    assert others["/run/nvidia-persistenced/socket"]["options"] == [
        "nosuid", "nodev", "rbind", "rprivate", "noexec"
    ]  # fmt: skip


@pytest.mark.parametrize("hook", [HOOK, None], ids=["hook", "hook-free"])
@pytest.mark.parametrize("layout", ["ubuntu", "rhel", "container"])
@pytest.mark.parametrize("image", sorted(IMAGES))
def test_a_cuda_image_finds_the_driver(
    tmp_path: Path, image: str, layout: str, hook: str | None
) -> None:
    host, w = make_node(tmp_path, layout, hook=hook)
    img: Image = IMAGES[image](tmp_path / "image")
    assert img.resolve("libcuda.so.1") is None  # the image carries no driver
    img.apply(w.build_base_spec(), host)
    for name in ("libcuda.so", "libnvidia-ml.so", "libnvidia-nvvm.so"):
        lib = w.files.library(name)
        assert lib is not None and lib.soname is not None
        assert img.host_file(lib.soname) == w.host(lib.path), (image, layout, lib.soname)
    # libnvidia-gpucomp is asked for by its versioned name (its SONAME)
    assert img.host_file(f"libnvidia-gpucomp.so.{V}") is not None


@pytest.mark.parametrize(
    ("image", "layout", "found"),
    [
        ("ubuntu", "ubuntu", True),  # /usr/lib/x86_64-linux-gnu is a default directory
        ("ubi", "rhel", True),  # and /usr/lib64 is UBI's
        ("ubi", "ubuntu", False),  # the limit of the hook-free layout: see docs/install.md
        ("ubuntu", "rhel", False),
    ],
)
def test_hook_free_without_the_cuda_images_ld_library_path(
    tmp_path: Path, image: str, layout: str, found: bool
) -> None:
    host, w = make_node(tmp_path, layout)
    img = IMAGES[image](tmp_path / "image")
    img.apply(w.build_base_spec(), host)
    assert (img.host_file("libcuda.so.1", env=False) is not None) is found


def test_with_the_hook_any_image_finds_it_without_ld_library_path(tmp_path: Path) -> None:
    host, w = make_node(tmp_path, "ubuntu", hook=HOOK)
    img = ubi_cuda_image(tmp_path / "image")
    img.apply(w.build_base_spec(), host)
    assert img.host_file("libcuda.so.1", env=False) == f"{UBUNTU_LIBS}/libcuda.so.{V}"


# -- MIG capability nodes ------------------------------------------------------------------------


def test_a_missing_mig_capability_node_is_made(tmp_path: Path) -> None:
    _, w = make_node(tmp_path, "container")
    gi, ci = caps_minor(2, 9), caps_minor(2, 9, 0)
    dev = w.driver_root / "dev/nvidia-caps"
    assert not (dev / f"nvidia-cap{gi}").exists()
    spec = w.build_spec(UID, [MIG])
    nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert nodes[1:] == [
        {
            "path": f"/dev/nvidia-caps/nvidia-cap{m}",
            "hostPath": f"/run/nvidia/driver/dev/nvidia-caps/nvidia-cap{m}",
        }
        for m in (gi, ci)
    ]
    for m in (gi, ci):  # in the simulated dev tree, never the machine's /dev
        node = dev / f"nvidia-cap{m}"
        assert node.read_text() == f"simulated character device {CAPS_MAJOR}:{m}\n"
        assert node.stat().st_mode & 0o777 == 0o444  # DeviceFileMode 292
    before = (dev / f"nvidia-cap{gi}").stat().st_mtime_ns
    w.build_spec(UID, [MIG])  # there now: left alone
    assert (dev / f"nvidia-cap{gi}").stat().st_mtime_ns == before


def test_no_nvidia_caps_major_is_an_error_naming_proc_devices(tmp_path: Path) -> None:
    _, w = make_node(tmp_path, "ubuntu")
    (w.driver_root / "proc/devices").write_text("Character devices:\n195 nvidia-frontend\n")
    with pytest.raises(CdiError, match=r"no 'nvidia-caps' character device in .*proc/devices"):
        w.build_spec(UID, [MIG])


def test_a_node_that_cannot_be_made_is_an_error_saying_why(tmp_path: Path) -> None:
    _, w = make_node(tmp_path, "ubuntu")

    def refuse(path: Path, major: int, minor: int, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    w.make_node = refuse
    with pytest.raises(CdiError, match=r"Operation not permitted.*CAP_MKNOD"):
        w.build_spec(UID, [MIG])
