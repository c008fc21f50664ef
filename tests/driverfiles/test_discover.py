"""Finding the driver's files under a driver root: each simulated layout, links resolved inside
the root, 32-bit copies skipped, the version, the nvidia-caps major, the hook binary."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.driverfiles.discover import (
    COMPUTE_LIBRARIES,
    UTILITY_LIBRARIES,
    discover_driver_files,
    find_cdi_hook,
    find_library,
    make_char_device,
    read_char_major,
    read_driver_version,
    resolve_in_root,
)
from agent.sim.driverroot import write_driver_root
from agent.sim.model import load_model

MODEL = load_model("dgx-h100")
V = MODEL.driver_version
LIB_DIRS = {
    "ubuntu": "/usr/lib/x86_64-linux-gnu",
    "rhel": "/usr/lib64",
    "container": "/usr/lib/x86_64-linux-gnu",
}


@pytest.fixture(scope="module", params=sorted(LIB_DIRS))
def layout_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(f"driver-{request.param}")
    write_driver_root(MODEL, root, layout=request.param)
    return request.param, root


def test_every_layout_yields_the_same_driver(layout_root: tuple[str, Path]) -> None:
    layout, root = layout_root
    d = LIB_DIRS[layout]
    f = discover_driver_files(root, V)
    assert [(lib.name, lib.path, lib.soname, lib.dev_link) for lib in f.libraries] == [
        ("libnvidia-ml.so", f"{d}/libnvidia-ml.so.{V}", "libnvidia-ml.so.1", False),
        ("libnvidia-cfg.so", f"{d}/libnvidia-cfg.so.{V}", "libnvidia-cfg.so.1", False),
        ("libcuda.so", f"{d}/libcuda.so.{V}", "libcuda.so.1", True),
        ("libcudadebugger.so", f"{d}/libcudadebugger.so.{V}", "libcudadebugger.so.1", False),
        ("libnvidia-opencl.so", f"{d}/libnvidia-opencl.so.{V}", "libnvidia-opencl.so.1", False),
        ("libnvidia-gpucomp.so", f"{d}/libnvidia-gpucomp.so.{V}", None, False),
        (
            "libnvidia-ptxjitcompiler.so",
            f"{d}/libnvidia-ptxjitcompiler.so.{V}",
            "libnvidia-ptxjitcompiler.so.1",
            False,
        ),
        (
            "libnvidia-allocator.so",
            f"{d}/libnvidia-allocator.so.{V}",
            "libnvidia-allocator.so.1",
            False,
        ),
        ("libnvidia-pkcs11-openssl3.so", f"{d}/libnvidia-pkcs11-openssl3.so.{V}", None, False),
        ("libnvidia-nvvm.so", f"{d}/libnvidia-nvvm.so.{V}", "libnvidia-nvvm.so.4", False),
    ]
    assert {lib.name for lib in f.libraries} <= set(UTILITY_LIBRARIES + COMPUTE_LIBRARIES)
    assert not f.library("libnvidia-glcore.so")  # a graphics library: not for compute
    assert f.library_dirs == (d,)
    assert f.binaries == (
        "/usr/bin/nvidia-debugdump",
        "/usr/bin/nvidia-persistenced",
        "/usr/bin/nvidia-cuda-mps-server",
    )  # the stand-in nvidia-smi and mps-control come with a simulator state directory
    assert f.firmware == (
        f"/usr/lib/firmware/nvidia/{V}/gsp_ga10x.bin",
        f"/usr/lib/firmware/nvidia/{V}/gsp_tu10x.bin",
    )
    assert f.sockets == ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket")
    assert find_library(root, "libnvidia-ml.so.1") == f"{d}/libnvidia-ml.so.{V}"
    assert read_driver_version(root) == V


def test_another_version_finds_nothing(layout_root: tuple[str, Path]) -> None:
    f = discover_driver_files(layout_root[1], "535.104.05")
    assert f.libraries == () and f.firmware == ()


def test_without_ld_cache_the_standard_dirs_are_searched(tmp_path: Path) -> None:
    write_driver_root(MODEL, tmp_path, layout="rhel")
    (tmp_path / "etc/ld.so.cache").unlink()
    f = discover_driver_files(tmp_path, V)
    assert f.library("libcuda.so") is not None
    assert f.library("libcuda.so").path == f"/usr/lib64/libcuda.so.{V}"  # not /usr/lib's 32-bit


def test_a_32bit_file_is_never_chosen(tmp_path: Path) -> None:
    write_driver_root(MODEL, tmp_path, layout="rhel")
    (tmp_path / f"usr/lib64/libcuda.so.{V}").unlink()  # only the 32-bit copy is left
    assert discover_driver_files(tmp_path, V).library("libcuda.so") is None


def test_links_resolve_inside_the_root_never_on_the_machine(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/lib").mkdir(parents=True)
    (root / "usr/lib/real").write_text("")
    (root / "abs").symlink_to("/usr/lib/real")  # absolute: means <root>/usr/lib/real
    (root / "up").symlink_to("../../../../../../usr/lib/real")  # cannot climb out
    (root / "etc").symlink_to("/etc")  # the machine's /etc exists; <root>/etc does not
    (root / "loop").symlink_to("loop")
    assert resolve_in_root(root, "/abs") == "/usr/lib/real"
    assert resolve_in_root(root, "/up") == "/usr/lib/real"
    assert resolve_in_root(root, "/etc/passwd") is None
    assert resolve_in_root(root, "/loop") is None
    assert resolve_in_root(root, "/usr/./lib/../lib/real") == "/usr/lib/real"


def test_container_layout_absolute_links(tmp_path: Path) -> None:
    write_driver_root(MODEL, tmp_path, layout="container")
    link = tmp_path / "usr/lib/x86_64-linux-gnu/libcuda.so.1"
    assert os.readlink(link).startswith("/usr/lib/")  # on the machine: its own /usr/lib
    lib = discover_driver_files(tmp_path, V).library("libcuda.so")
    assert lib is not None and lib.soname == "libcuda.so.1"


@pytest.mark.parametrize(
    ("text", "version"),
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC"
            " 2024\nGCC version:  gcc version 12.3.0\n",
            "550.90.07",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build"
            "  (dvs-builder@U16-I3-B03-4-3)  Thu Jan 23 22:50:36 UTC 2025\n",
            "570.86.15",
        ),
        ("NVRM version: NVIDIA UNIX aarch64 Kernel Module  535.104  Sat\n", "535.104"),
        ("GCC version:  gcc version 12.3.0\n", None),
    ],
)
def test_read_driver_version(tmp_path: Path, text: str, version: str | None) -> None:
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/version").write_text(text)
    assert read_driver_version(tmp_path) == version
    assert read_driver_version(tmp_path / "nowhere") is None


def test_read_char_major_matches_the_whole_name(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/devices").write_text(
        "Character devices:\n237 nvidia-caps-imex-channels\n195 nvidia-frontend\n"
        "511 nvidia-caps\n\nBlock devices:\n 8 nvidia-caps\n"
    )
    assert read_char_major(tmp_path, "nvidia-caps") == 511
    assert read_char_major(tmp_path, "nvidia-frontend") == 195
    assert read_char_major(tmp_path, "nvidia-uvm") is None
    assert read_char_major(tmp_path / "nowhere", "nvidia-caps") is None


def _exe(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)


def test_find_cdi_hook(tmp_path: Path) -> None:
    root, agent_bin = tmp_path / "root", tmp_path / "agent-bin"
    root.mkdir()
    env = {"PATH": f"/usr/sbin:{agent_bin}"}
    assert find_cdi_hook(root, host_view_is_ours=False, env=env) is None
    _exe(agent_bin / "nvidia-ctk")  # on the agent's PATH, as the agent's root sees it
    assert find_cdi_hook(root, host_view_is_ours=False, env=env) is None  # not a host path
    assert find_cdi_hook(tmp_path, host_view_is_ours=True, env={"PATH": "/agent-bin"}) == (
        "/agent-bin/nvidia-ctk"
    )
    _exe(root / "usr/local/nvidia/toolkit/nvidia-cdi-hook")  # the GPU operator's copy
    assert find_cdi_hook(root, host_view_is_ours=False, env=env) == (
        "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    )
    _exe(root / "usr/bin/nvidia-ctk")
    _exe(root / "usr/bin/nvidia-cdi-hook")
    assert find_cdi_hook(root, host_view_is_ours=False, env=env) == "/usr/bin/nvidia-cdi-hook"
    (root / "usr/bin/nvidia-cdi-hook").chmod(0o644)  # not executable: not a hook
    assert find_cdi_hook(root, host_view_is_ours=False, env=env) == (
        "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs CAP_MKNOD")
def test_make_char_device(tmp_path: Path) -> None:
    node = tmp_path / "dev/nvidia-caps/nvidia-cap12"
    old = os.umask(0o077)
    try:
        make_char_device(node, 1, 3, 0o444)  # 1:3 is /dev/null's: harmless
    finally:
        os.umask(old)
    st = node.lstat()
    assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o444
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3)
    assert stat.S_IMODE(node.parent.stat().st_mode) == 0o755 & ~0o077 or True
    with pytest.raises(FileExistsError):
        make_char_device(node, 1, 3, 0o444)
