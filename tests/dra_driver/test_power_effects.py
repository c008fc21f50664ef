"""A claim's power cap on a simulated node (dra_driver.kubeletplugin.effects over NVML): the
GPU's limit recorded before the cap is set, set back at undo, at a rollback after a crash on
either side of the cap, and set again at start when the GPU lost it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from dra_driver.errors import SharingError
from dra_driver.kubeletplugin.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    ClaimEntry,
    PreparedDevice,
)
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.plan import ClaimPlan, SharingPolicy
from tests.dra_driver.test_sharing_effects import (
    Crash,
    Node,
    Saved,
    checkpoint,
    make_node,
    plan,
    record,
)

CAP_MW = 350_000
DEFAULT_MW = 700_000  # an H100 SXM boots with its 700 W board limit


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = make_node(tmp_path, "dgx-h100", SharingPolicy())
    yield n
    n.source.nvml.shutdown()


def fake(node: Node) -> FakeNvml:
    """A second view of the simulated driver (another process would see the same)."""
    f = FakeNvml(load_model("dgx-h100"), node.sim_dir)
    f.nvmlInit()
    return f


def limit(node: Node, index: int) -> int:
    f = fake(node)
    return int(f.nvmlDeviceGetPowerManagementLimit(f.nvmlDeviceGetHandleByIndex(index)))


def capped(node: Node, uid: str, *devices: str, watts: str = "350W") -> tuple[ClaimKey, ClaimPlan]:
    cfg: dict[str, Any] = {
        "apiVersion": "gpu.tessera.dev/v1alpha1",
        "kind": "GpuConfig",
        "powerLimit": watts,
    }
    return plan(node, uid, *devices, cfg=cfg)


def records(p: ClaimPlan) -> tuple[PreparedDevice, ...]:
    return tuple(dataclasses.replace(record(d), power_limit_mw=d.power_limit_mw) for d in p.devices)


def entry(key: ClaimKey, devices: tuple[PreparedDevice, ...], state: str) -> ClaimEntry:
    return ClaimEntry(key.uid, key.namespace, key.name, state, devices, 0.0)


def test_the_cap_is_set_and_the_limit_found_before_is_set_back(node: Node) -> None:
    key, p = capped(node, "a", "gpu-0", "gpu-1")
    saved = Saved()
    applied = node.effects.apply(key, p, records(p), saved)
    assert (limit(node, 0), limit(node, 1), limit(node, 2)) == (CAP_MW, CAP_MW, DEFAULT_MW)
    assert [(d.power_limit_mw, d.power_restore_mw) for d in applied.devices] == [
        (CAP_MW, DEFAULT_MW), (CAP_MW, DEFAULT_MW)
    ]  # fmt: skip
    assert saved.devices == applied.devices  # recorded (a PrepareStarted commit) as well
    done = entry(key, applied.devices, PREPARE_COMPLETED)
    node.effects.undo(done, checkpoint(done))
    assert (limit(node, 0), limit(node, 1)) == (DEFAULT_MW, DEFAULT_MW)


def test_an_operators_own_limit_is_the_one_set_back(node: Node) -> None:
    f = fake(node)
    f.nvmlDeviceSetPowerManagementLimit(f.nvmlDeviceGetHandleByIndex(3), 500_000)
    key, p = capped(node, "a", "gpu-3", watts="300W")
    applied = node.effects.apply(key, p, records(p), Saved())
    assert limit(node, 3) == 300_000
    done = entry(key, applied.devices, PREPARE_COMPLETED)
    node.effects.undo(done, checkpoint(done))
    assert limit(node, 3) == 500_000  # not the default: what the GPU had before the claim


def test_a_crash_between_recording_and_capping_is_undone_from_the_record(node: Node) -> None:
    key, p = capped(node, "a", "gpu-0")
    saved = Saved()
    node.crash_at.add("after-power-recorded")
    with pytest.raises(Crash):
        node.effects.apply(key, p, records(p), saved)
    assert limit(node, 0) == DEFAULT_MW  # not capped yet
    assert saved.devices[0].power_restore_mw == DEFAULT_MW  # but the limit to set back is durable
    started = entry(key, saved.devices, PREPARE_STARTED)
    node.restart().effects.undo(started, checkpoint(started))  # the start's rollback
    assert limit(node, 0) == DEFAULT_MW


def test_a_crash_after_the_cap_before_completion_is_rolled_back(node: Node) -> None:
    key, p = capped(node, "a", "gpu-0")
    saved = Saved()
    node.crash_at.add("after-power-limit")
    with pytest.raises(Crash):
        node.effects.apply(key, p, records(p), saved)
    assert limit(node, 0) == CAP_MW
    started = entry(key, saved.devices, PREPARE_STARTED)
    node.restart().effects.undo(started, checkpoint(started))
    assert limit(node, 0) == DEFAULT_MW


def test_a_crash_before_anything_was_recorded_leaves_nothing_to_set_back(node: Node) -> None:
    key, p = capped(node, "a", "gpu-0")
    started = entry(key, records(p), PREPARE_STARTED)  # the claim's start, nothing more
    f = fake(node)
    f.nvmlDeviceSetPowerManagementLimit(f.nvmlDeviceGetHandleByIndex(0), 600_000)  # not ours
    node.restart().effects.undo(started, checkpoint(started))
    assert limit(node, 0) == 600_000  # never changed by the claim: not touched


def test_restore_caps_again_a_gpu_that_lost_its_cap(node: Node) -> None:
    key, p = capped(node, "a", "gpu-2")
    done = entry(key, node.effects.apply(key, p, records(p), Saved()).devices, PREPARE_COMPLETED)
    fake(node).reload_driver()  # a driver reload while the agent was down: limits are gone
    assert limit(node, 2) == DEFAULT_MW
    assert node.restart().effects.restore(done) == done
    assert limit(node, 2) == CAP_MW


def test_a_rebuilt_claim_sets_back_the_default_limit(node: Node) -> None:
    """A claim rebuilt after a lost checkpoint has no record of the limit before its cap: it
    gets the one the GPU boots with."""
    key, p = capped(node, "a", "gpu-2")
    node.effects.apply(key, p, records(p), Saved())
    rebuilt = entry(key, records(p), PREPARE_COMPLETED)  # the cap, no limit to set back
    restored = node.restart().effects.restore(rebuilt)
    assert restored.devices[0].power_restore_mw == DEFAULT_MW
    assert limit(node, 2) == CAP_MW
    node.effects.undo(restored, checkpoint(restored))
    assert limit(node, 2) == DEFAULT_MW


def test_a_failed_set_back_fails_the_undo_and_a_retry_succeeds(node: Node) -> None:
    key, p = capped(node, "a", "gpu-5")
    done = entry(key, node.effects.apply(key, p, records(p), Saved()).devices, PREPARE_COMPLETED)
    fake(node).fail_call("nvmlDeviceSetPowerManagementLimit", gpu=5, code=pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(SharingError) as e:
        node.effects.undo(done, checkpoint(done))
    assert e.value.reason == "power_limit_error"
    assert "gpu-5: cannot set the power limit to 700W (restore)" in str(e.value)
    assert limit(node, 5) == CAP_MW  # still capped: the claim keeps its record and its GPU
    node.effects.undo(done, checkpoint(done))  # the kubelet's retry
    assert limit(node, 5) == DEFAULT_MW


def test_a_cap_nvml_refuses_fails_the_prepare_naming_the_gpu(node: Node) -> None:
    key, p = capped(node, "a", "gpu-6")
    fake(node).fail_call(
        "nvmlDeviceSetPowerManagementLimit", gpu=6, code=pynvml.NVML_ERROR_NO_PERMISSION
    )
    saved = Saved()
    with pytest.raises(SharingError) as e:
        node.effects.apply(key, p, records(p), saved)
    assert "gpu-6: cannot set the power limit to 350W (cap)" in str(e.value)
    started = entry(key, saved.devices, PREPARE_STARTED)  # the caller rolls it back
    node.effects.undo(started, checkpoint(started))
    assert limit(node, 6) == DEFAULT_MW


def test_claims_with_a_cap_change_the_node(node: Node) -> None:
    key, p = capped(node, "a", "gpu-0")
    assert node.effects.changes_node(p)
    done = entry(key, node.effects.apply(key, p, records(p), Saved()).devices, PREPARE_COMPLETED)
    assert node.effects.changes_node_of(done)
    node.effects.undo(done, checkpoint(done))
