"""The simulated driver root: version file, MIG capability files, libraries in each layout,
idempotence."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from agent.errors import ConfigError
from agent.sim.driverroot import caps_minor, write_driver_root
from agent.sim.model import load_model

CAPS = "proc/driver/nvidia/capabilities"
LIBS = "usr/lib/x86_64-linux-gnu"


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file (content, inode mtime), socket and link (target) under root, by relative
    path (links to directories are not followed)."""
    out: dict[str, tuple[bytes, int]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if (Path(dirpath) / d).is_symlink()]:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = (b"-> " + os.readlink(p).encode(), 0)
            elif stat.S_ISSOCK(p.lstat().st_mode):
                out[rel] = (b"socket", p.lstat().st_mtime_ns)
            else:
                out[rel] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


def minor_of(path: Path) -> int:
    lines = dict(line.split(": ") for line in path.read_text().splitlines())
    return int(lines["DeviceFileMinor"])


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("driver-h100")
    write_driver_root(load_model("dgx-h100"), root)
    return root


def test_version_file(h100: Path) -> None:
    text = (h100 / "proc/driver/nvidia/version").read_text()
    version = load_model("dgx-h100").driver_version
    assert text.startswith(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  ")
    assert "GCC version:" in text


def test_caps_files_for_every_instance(h100: Path) -> None:
    gpus = len(load_model("dgx-h100").gpus)
    for g in range(gpus):
        mig = h100 / CAPS / f"gpu{g}" / "mig"
        assert sorted(p.name for p in mig.iterdir()) == sorted(f"gi{i}" for i in range(15))
        for gi in range(15):
            assert sorted(p.name for p in (mig / f"gi{gi}").iterdir()) == sorted(
                ["access", *(f"ci{c}" for c in range(8))]
            )
    assert not (h100 / CAPS / f"gpu{gpus}").exists()


def test_caps_file_contents(h100: Path) -> None:
    text = (h100 / CAPS / "gpu1/mig/gi2/access").read_text()
    assert text == "DeviceFileMinor: 156\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    assert minor_of(h100 / CAPS / "gpu0/mig/gi0/access") == 3
    assert minor_of(h100 / CAPS / "gpu0/mig/gi0/ci0/access") == 4
    assert minor_of(h100 / CAPS / "gpu0/mig/gi1/access") == 12
    assert minor_of(h100 / CAPS / "gpu1/mig/gi2/ci3/access") == caps_minor(1, 2, 3) == 160
    assert minor_of(h100 / CAPS / "mig/config") == 1
    assert minor_of(h100 / CAPS / "mig/monitor") == 2
    assert "DeviceFileMode: 256" in (h100 / CAPS / "mig/config").read_text()
    assert "DeviceFileMode: 292" in (h100 / CAPS / "mig/monitor").read_text()


def test_caps_minors_unique_per_node(h100: Path) -> None:
    minors = [minor_of(p) for p in (h100 / CAPS).rglob("*") if p.is_file()]
    assert len(minors) == 2 + 8 * 15 * 9
    assert len(set(minors)) == len(minors)


def test_libraries_and_links(h100: Path) -> None:
    version = load_model("dgx-h100").driver_version
    libs = h100 / LIBS
    for lib, soname in (
        ("libcuda.so", "libcuda.so.1"),
        ("libnvidia-ml.so", "libnvidia-ml.so.1"),
        ("libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"),
        ("libnvidia-nvvm.so", "libnvidia-nvvm.so.4"),
    ):
        real = libs / f"{lib}.{version}"
        assert real.is_file() and not real.is_symlink()
        assert real.read_bytes() == b""
        assert os.readlink(libs / soname) == f"{lib}.{version}"
    assert os.readlink(libs / "libcuda.so") == "libcuda.so.1"
    assert (libs / f"libnvidia-gpucomp.so.{version}").is_file()  # its own SONAME: no link
    assert not (libs / "libnvidia-gpucomp.so.1").exists()
    assert os.readlink(h100 / "lib") == "usr/lib"


@pytest.mark.parametrize(
    ("layout", "lib_dir", "cache_dir", "absolute"),
    [
        ("ubuntu", "usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", False),
        ("rhel", "usr/lib64", "/lib64", False),
        ("container", "usr/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", True),
    ],
)
def test_layouts(tmp_path: Path, layout: str, lib_dir: str, cache_dir: str, absolute: bool):
    from agent.driverfiles.ldcache import parse

    model = load_model("dgx-h100")
    v = model.driver_version
    write_driver_root(model, tmp_path, layout=layout)
    link = os.readlink(tmp_path / lib_dir / "libcuda.so.1")
    assert link == (f"/{lib_dir}/libcuda.so.{v}" if absolute else f"libcuda.so.{v}")
    cache = {(e.soname, e.arch): e.path for e in parse((tmp_path / "etc/ld.so.cache").read_bytes())}
    assert cache[("libcuda.so.1", "x86_64")] == f"{cache_dir}/libcuda.so.1"
    assert cache[("libnvidia-ml.so.1", "x86_64")] == f"{cache_dir}/libnvidia-ml.so.1"
    fw = tmp_path / "usr/lib/firmware/nvidia" / v
    assert sorted(p.name for p in fw.iterdir()) == ["gsp_ga10x.bin", "gsp_tu10x.bin"]
    assert stat.S_ISSOCK((tmp_path / "run/nvidia-persistenced/socket").lstat().st_mode)
    assert stat.S_ISSOCK((tmp_path / "run/nvidia-fabricmanager/socket").lstat().st_mode)  # NVSwitch
    assert "236 nvidia-caps\n" in (tmp_path / "proc/devices").read_text()
    assert sorted(p.name for p in (tmp_path / "dev/nvidia-caps").iterdir()) == [
        "nvidia-cap1",
        "nvidia-cap2",
    ]
    assert (tmp_path / "dev/nvidia7").is_file() and (tmp_path / "dev/nvidiactl").is_file()
    if layout == "rhel":  # the 32-bit compat copy, and its i386 cache entry
        assert (tmp_path / f"usr/lib/libcuda.so.{v}").read_bytes()[:5] == b"\x7fELF\x01"
        assert cache[("libcuda.so.1", None)] == "/usr/lib/libcuda.so.1"


def test_no_fabric_manager_without_nvswitches(tmp_path: Path) -> None:
    write_driver_root(load_model("l40s-pcie"), tmp_path)
    assert not (tmp_path / "run/nvidia-fabricmanager").exists()
    assert (tmp_path / "run/nvidia-persistenced/socket").exists()


def test_no_mig_files_for_non_mig_gpus(tmp_path: Path) -> None:
    write_driver_root(load_model("l40s-pcie"), tmp_path)
    assert sorted(p.name for p in (tmp_path / CAPS).iterdir()) == ["mig"]
    assert (tmp_path / CAPS / "mig/config").is_file()


def test_mixed_node_only_mig_capable_gpus(tmp_path: Path) -> None:
    model = load_model("mixed")
    write_driver_root(model, tmp_path)
    capable = {f"gpu{g.index}" for g in model.gpus if g.spec.mig_capable}
    assert capable and len(capable) < len(model.gpus)
    assert {p.name for p in (tmp_path / CAPS).iterdir()} == {"mig", *capable}


def test_idempotent(tmp_path: Path) -> None:
    model = load_model("dgx-a100")
    write_driver_root(model, tmp_path)
    before = snapshot(tmp_path)
    write_driver_root(model, tmp_path)
    assert snapshot(tmp_path) == before  # same contents, and no file was rewritten
    assert not [p for p in tmp_path.rglob(".*")]


@pytest.mark.parametrize(
    ("first", "second"), [("ubuntu", "ubuntu"), ("ubuntu", "rhel"), ("rhel", "container")]
)
def test_rewrite_with_another_model_removes_what_it_lacks(
    tmp_path: Path, first: str, second: str
) -> None:
    root, fresh = tmp_path / "root", tmp_path / "fresh"
    write_driver_root(load_model("hgx-h200"), root, layout=first)  # another driver version
    assert (root / "usr/lib/firmware/nvidia/560.35.03").is_dir()
    made = root / "dev/nvidia-caps/nvidia-cap12"  # a MIG capability node made since
    made.write_text("")
    write_driver_root(load_model("l40s-pcie"), root, layout=second)
    write_driver_root(load_model("l40s-pcie"), fresh, layout=second)
    rewritten = {k: v[0] for k, v in snapshot(root).items() if k != "dev/nvidia-caps/nvidia-cap12"}
    assert rewritten == {k: v[0] for k, v in snapshot(fresh).items()}
    assert made.exists()  # as on a real node, an agent restart does not remove nodes


def test_refuses_real_root() -> None:
    with pytest.raises(ConfigError, match="real /"):
        write_driver_root(load_model("l40s-pcie"), Path("/"))


def test_unwritable_root_is_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot write the simulated driver root"):
        write_driver_root(load_model("l40s-pcie"), blocker)


# -- the sharing tools ---------------------------------------------------------------------------

TOOLS = ("usr/bin/nvidia-smi", "usr/bin/nvidia-cuda-mps-control")


def test_tools_are_installed_for_the_simulator_state(tmp_path: Path):
    state = tmp_path / "state"
    write_driver_root(load_model("dgx-h100"), tmp_path / "root", state_dir=state)
    for rel in TOOLS:
        tool = tmp_path / "root" / rel
        assert tool.stat().st_mode & 0o777 == 0o755
        text = tool.read_text()
        assert text.startswith(f"#!{sys.executable}\n")
        assert repr(str(state)) in text and "'dgx-h100'" in text
    assert "dict(os.environ)" in (tmp_path / "root" / TOOLS[1]).read_text()


def test_tools_are_installed_idempotently_and_removed_without_a_state(tmp_path: Path):
    model = load_model("l40s-pcie")
    write_driver_root(model, tmp_path, state_dir=tmp_path / "s")
    before = snapshot(tmp_path)
    write_driver_root(model, tmp_path, state_dir=tmp_path / "s")
    assert snapshot(tmp_path) == before
    (tmp_path / TOOLS[0]).chmod(0o644)
    write_driver_root(model, tmp_path, state_dir=tmp_path / "s")
    assert (tmp_path / TOOLS[0]).stat().st_mode & 0o777 == 0o755
    write_driver_root(model, tmp_path, state_dir=tmp_path / "other")
    assert repr(str(tmp_path / "other")) in (tmp_path / TOOLS[0]).read_text()
    write_driver_root(model, tmp_path)
    assert sorted(p.name for p in (tmp_path / "usr/bin").iterdir()) == [
        "nvidia-cuda-mps-server",  # placeholders only
        "nvidia-debugdump",
        "nvidia-persistenced",
    ]
    assert not [p for p in tmp_path.rglob(".*")]


def test_a_model_file_is_named_by_its_absolute_path(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_driver_root(
        load_model("l40s-pcie"), tmp_path / "r", state_dir=Path("s"), model_ref="m/node.yaml"
    )
    text = (tmp_path / "r" / TOOLS[0]).read_text()
    assert repr(str(tmp_path / "m/node.yaml")) in text and repr(str(tmp_path / "s")) in text


def test_the_simulated_node_installs_its_tools(tmp_path: Path):
    from agent.sim.node import simulated_node

    node = simulated_node("l40s-pcie", tmp_path)
    assert node.driver_root is not None
    text = (node.driver_root / TOOLS[0]).read_text()
    assert repr(str(tmp_path / "sim")) in text and "'l40s-pcie'" in text
