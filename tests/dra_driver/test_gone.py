"""Which prepared devices the node no longer has (dra_driver/kubeletplugin/gone.py): by UUID,
never by name or minor number."""

from __future__ import annotations

import dataclasses

from agent.discovery.inventory import NodeInventory
from dra_driver.kubeletplugin.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    ClaimEntry,
    PreparedDevice,
)
from dra_driver.kubeletplugin.gone import GPU_GONE, MIG_DISABLED, MIG_GONE, gone_devices
from tests.dra_driver.conftest import Inventory


def device(
    name: str, kind: str, gpu_uuid: str, mig_uuid: str | None = None, **kw
) -> PreparedDevice:
    return PreparedDevice(("gpu",), "node", name, (), kind, gpu_uuid, 0, mig_uuid=mig_uuid, **kw)


def entry(uid: str, *devices: PreparedDevice, state: str = PREPARE_COMPLETED) -> ClaimEntry:
    return ClaimEntry(uid, "ml", f"job-{uid}", state, devices, 0.0)


def whole(inv: NodeInventory, index: int) -> PreparedDevice:
    return device(f"gpu-{index}", "gpu", inv.gpus[index].device.uuid)


def test_every_device_there_is_none_gone(inventory: Inventory):
    inv = inventory("dgx-h100")
    assert gone_devices([entry("a", whole(inv, 0)), entry("b", whole(inv, 3))], inv) == ()


def test_a_removed_gpu_and_another_model_under_the_same_name_are_gone(inventory: Inventory):
    h100, l40s = inventory("dgx-h100"), inventory("l40s-pcie")
    claims = [entry("a", whole(h100, 1)), entry("b", whole(l40s, 0))]
    # the node is now an L40S node: gpu-1 has the same name and minor, another UUID
    (gone,) = gone_devices(claims, l40s)
    assert (gone.uid, gone.device, gone.gpu_uuid, gone.why) == (
        "a",
        "gpu-1",
        h100.gpus[1].device.uuid,
        GPU_GONE,
    )
    assert "ml/job-a (a) gpu-1 on " + h100.gpus[1].device.uuid in gone.describe()
    # GPU 1 hot-removed
    removed = dataclasses.replace(h100, gpus=tuple(g for i, g in enumerate(h100.gpus) if i != 1))
    assert [g.device for g in gone_devices([entry("a", whole(h100, 1))], removed)] == ["gpu-1"]


def test_only_completed_prepares_with_a_known_uuid_count(inventory: Inventory):
    inv = inventory("l40s-pcie")
    started = entry("s", device("gpu-1", "gpu", "GPU-elsewhere"), state=PREPARE_STARTED)
    no_uuid = entry("r", device("gpu-9", "gpu", ""))  # an unrecovered claim's: reported there
    assert gone_devices([started, no_uuid], inv) == ()


def test_a_static_mig_device_an_admin_replaced_is_gone_even_if_its_uuid_is_reused(
    inventory: Inventory,
):
    balanced, all_1g = inventory("dgx-a100"), inventory("dgx-a100", "all-1g")
    gpu = balanced.gpus[0].device
    three_g = next(m for m in gpu.mig_instances if m.profile_name.startswith("3g"))
    name = f"gpu-{gpu.minor}-mig-3g20gb-{three_g.profile_id}-{three_g.placement.start}"
    held = entry("m", device(name, "mig", gpu.uuid, three_g.uuid))
    assert gone_devices([held], balanced) == ()
    new = all_1g.gpus[0].device
    assert new.uuid == gpu.uuid  # the same GPU, another layout
    (gone,) = gone_devices([held], all_1g)
    assert (gone.device, gone.mig_uuid, gone.why) == (name, three_g.uuid, MIG_GONE)
    # a 1g instance with the same UUID (the GPU instance's ID reused) is not the 3g device
    reused = dataclasses.replace(new.mig_instances[0], uuid=three_g.uuid)
    gpus = (
        dataclasses.replace(
            all_1g.gpus[0], device=dataclasses.replace(new, mig_instances=(reused,))
        ),
    )
    assert [g.why for g in gone_devices([held], dataclasses.replace(all_1g, gpus=gpus))] == [
        MIG_GONE
    ]


def test_a_mig_device_whose_gpu_left_mig_mode_is_gone_a_dynamic_one_only_then(
    inventory: Inventory,
):
    h100 = inventory("dgx-h100")  # whole GPUs: MIG mode off
    gpu = h100.gpus[2].device
    dynamic = device(
        "gpu-2-mig-1g10gb-19-0", "mig", gpu.uuid, "MIG-made-at-prepare", placement=(19, 0, 1)
    )
    (gone,) = gone_devices([entry("d", dynamic)], h100)
    assert gone.why == MIG_DISABLED
    a100 = inventory("dgx-a100")  # MIG mode on: a dynamic device the inventory has not seen yet
    on = device(
        "gpu-2-mig-1g5gb-19-0",
        "mig",
        a100.gpus[2].device.uuid,
        "MIG-made-since",
        placement=(19, 0, 1),
    )
    assert gone_devices([entry("d", on)], a100) == ()
