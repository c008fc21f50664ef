"""The simulated host tree `tessera doctor --simulate` reads: device nodes for the model's GPUs,
a containerd reading the simulator's CDI directory, the toolkit's hook; idempotent."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from agent.errors import ConfigError
from agent.sim.driverroot import caps_minor
from agent.sim.hostroot import write_host_root
from agent.sim.model import load_model


def write(model: str, root: Path, cdi: Path) -> None:
    write_host_root(load_model(model), root, cdi_dirs=[cdi], kubelet_dirs=[root.parent / "kube"])


def test_nodes_for_every_gpu_and_mig_capability(tmp_path):
    root = tmp_path / "host"
    write("dgx-a100", root, tmp_path / "cdi")
    dev = root / "dev"
    assert {p.name for p in dev.iterdir() if p.is_file()} == {
        "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", *(f"nvidia{i}" for i in range(8)),
    }  # fmt: skip
    caps = {p.name for p in (dev / "nvidia-caps").iterdir()}
    assert {"nvidia-cap1", "nvidia-cap2"} <= caps
    assert f"nvidia-cap{caps_minor(7, 14, 7)}" in caps  # the last compute instance of GPU 7
    assert (tmp_path / "kube").is_dir()
    assert not (root / "usr/bin/nvidia-cdi-hook").exists()  # looked for under the driver root


def test_containerd_reads_the_simulators_cdi_directory(tmp_path):
    write("l40s-pcie", tmp_path / "host", tmp_path / "cdi")
    with open(tmp_path / "host/etc/containerd/config.toml", "rb") as f:
        cri = tomllib.load(f)["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["enable_cdi"] is True
    assert cri["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi", str(tmp_path / "cdi")]
    assert not (tmp_path / "host/dev/nvidia-caps/nvidia-cap3").exists()  # no MIG on L40S


def test_rewriting_restores_what_was_removed_and_drops_another_models_gpus(tmp_path):
    root = tmp_path / "host"
    write("dgx-h100", root, tmp_path / "cdi")
    (root / "dev/nvidia3").unlink()
    write("dgx-h100", root, tmp_path / "cdi")
    assert (root / "dev/nvidia3").exists()
    write("l40s-pcie", root, tmp_path / "cdi")
    gpus = len(load_model("l40s-pcie").gpus)
    assert sorted(p.name for p in (root / "dev").glob("nvidia[0-9]*")) == [
        f"nvidia{i}" for i in range(gpus)
    ]


def test_never_over_the_real_root():
    with pytest.raises(ConfigError, match="refusing"):
        write_host_root(load_model("l40s-pcie"), Path("/"), cdi_dirs=[], kubelet_dirs=[])
