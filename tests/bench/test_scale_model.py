"""One node's figures of the 10,000-node model (bench/scale_model.py): Tessera's publisher
against the API-server emulator over real HTTP, NVIDIA's layout by its controller's rules. What
is asserted is behaviour the cluster relies on (a restart writes nothing; a GPU gone rewrites
the pool), not sizes, which change as the slices do."""

from __future__ import annotations

from agent.cli.node_commands import advertised
from agent.config import Config
from bench.common import simulated_inventory
from bench.scale_model import modes_of, nvidia_node, tessera_node


def test_a_restart_writes_nothing_and_a_gpu_gone_rewrites_the_pool() -> None:
    _, model = advertised(Config.of(simulate="l40s-pcie"))
    node, sent, slices = tessera_node(model)
    assert (node.restart_writes, node.restart_bytes) == (0, 0)
    assert slices == 1 and node.change_writes == 1  # one slice of whole GPUs, rewritten
    assert 0 < node.change_bytes < node.stored_bytes  # a GPU fewer
    assert sent < node.stored_bytes  # the server adds uid, timestamps, managedFields
    assert 0 < node.stored_protobuf < node.stored_bytes


def test_nvidia_rewrites_every_slice_when_a_gpu_goes_in_dynamic_mig() -> None:
    with simulated_inventory("dgx-h100") as inv:
        node, _, slices, devices = nvidia_node(inv, "dynamic-mig")
        whole, _, whole_slices, _ = nvidia_node(inv, "gpu")
    assert slices == 1 + len(inv.gpus)  # counters, then a slice per GPU
    assert node.change_writes == slices  # count changes: generation bumped, last deleted
    assert node.restart_writes == 0  # an unchanged slice is not written
    assert node.taint_writes == 1  # one GPU's slice changed: the generation is kept
    assert devices > len(inv.gpus) and whole_slices == 1 and whole.change_writes == 1


def test_the_modes_are_those_the_model_can_run() -> None:
    assert modes_of("l40s-pcie") == ["static", "time-slicing", "memory-shares"]
    assert "dynamic MIG" in modes_of("dgx-a100")
    assert modes_of("vgpu-t4")[-2:] == ["passthrough", "vgpu"]
