"""The simulated driver root: version file, MIG capability files, libraries, idempotence."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from agent.errors import ConfigError
from agent.sim.driverroot import caps_minor, write_driver_root
from agent.sim.model import load_model

CAPS = "proc/driver/nvidia/capabilities"
LIBS = "usr/lib/x86_64-linux-gnu"


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file (content, inode mtime) and link (target) under root, by relative path."""
    out: dict[str, tuple[str, int]] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("-> " + os.readlink(p), 0)
            else:
                out[rel] = (p.read_text(), p.stat().st_mtime_ns)
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
    for lib in ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so"):
        real = libs / f"{lib}.{version}"
        assert real.is_file() and not real.is_symlink()
        assert real.read_bytes() == b""
        assert os.readlink(libs / f"{lib}.1") == f"{lib}.{version}"
    assert len(list(libs.iterdir())) == 6


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


def test_rewrite_with_another_model_removes_what_it_lacks(tmp_path: Path) -> None:
    write_driver_root(load_model("hgx-h200"), tmp_path)  # MIG GPUs, another driver version
    assert (tmp_path / LIBS / "libcuda.so.560.35.03").exists()
    write_driver_root(load_model("l40s-pcie"), tmp_path)
    fresh = tmp_path / "fresh"
    write_driver_root(load_model("l40s-pcie"), fresh)
    rewritten = {k: v[0] for k, v in snapshot(tmp_path).items() if not k.startswith("fresh/")}
    assert rewritten == {k: v[0] for k, v in snapshot(fresh).items()}


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
    assert not (tmp_path / "usr/bin").exists()
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
