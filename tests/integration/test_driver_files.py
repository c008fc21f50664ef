"""`tessera run --simulate`: which NVML file it says it uses, and the base CDI spec it writes from
the simulated driver root, named as the host sees it."""

from __future__ import annotations

from pathlib import Path

from dra_driver.kubeletplugin.cdi_spec import validate_spec
from tests.integration.daemon import Daemon


def all_host_paths(spec: dict) -> list[str]:
    e = spec["containerEdits"]
    return [m["hostPath"] for m in e.get("mounts", [])] + [n["hostPath"] for n in e["deviceNodes"]]


def test_containerized_driver_layout_and_the_nvml_line(short_tmp: Path) -> None:
    d = Daemon(short_tmp / "state", "dgx-h100", "--sim-driver-layout", "container")
    d.start()
    try:
        nvml = d.wait_log("NVML library")
        root = short_tmp / "state/sim/driver-root"
        assert nvml["path"] is None  # the simulator answers NVML: no file is loaded
        lib = root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.90.07"
        assert f"{lib}, is not loaded" in nvml["reason"] and nvml["driver_root"] == str(root)
        files = d.wait_log("driver files for containers")
        assert files["host_driver_root"] == "/run/nvidia/driver"
        assert files["libraries"] == 10 and files["cdi_hook"].startswith("none")
        base = d.base_spec()
        validate_spec(base)
        paths = all_host_paths(base)
        assert paths and all(p.startswith("/run/nvidia/driver/") for p in paths)
        assert "hooks" not in base["containerEdits"]
    finally:
        d.kill()


def test_host_driver_root_and_hook_path_flags(short_tmp: Path) -> None:
    d = Daemon(short_tmp / "state", "l40s-pcie")
    d.start(
        env={
            "TESSERA_HOST_DRIVER_ROOT": "/host-root",
            "TESSERA_CDI_HOOK_PATH": "/opt/ctk/nvidia-ctk",
        }
    )
    try:
        base = d.base_spec()
        validate_spec(base)
        assert all(p.startswith("/host-root/") for p in all_host_paths(base))
        hooks = base["containerEdits"]["hooks"]
        assert [h["path"] for h in hooks] == ["/opt/ctk/nvidia-ctk"] * 2
        assert [h["args"][:3] for h in hooks] == [
            ["nvidia-ctk", "hook", "create-symlinks"],
            ["nvidia-ctk", "hook", "update-ldcache"],
        ]
    finally:
        d.kill()
