"""Naming devices as the real tools do: ``nvidia-smi -i`` ids and ``CUDA_VISIBLE_DEVICES``."""

from __future__ import annotations

from dataclasses import dataclass

from agent.sim.nvml import FakeNvml, mig_uuid
from agent.sim.nvml_core import sysfs_to_nvml_bus_id


@dataclass(frozen=True)
class Target:
    """A device named on a command line: a whole GPU, or a MIG device of GPU ``index``."""

    index: int
    uuid: str
    bus_id: str
    """NVML's form, ``00000000:1B:00.0`` (the parent's for a MIG device)."""
    mig: bool = False


def gpu_target(fake: FakeNvml, index: int) -> Target:
    gpu = fake.model.gpus[index]
    return Target(index, gpu.uuid, sysfs_to_nvml_bus_id(gpu.bus))


def mig_targets(fake: FakeNvml) -> list[Target]:
    """Every MIG device of the node, by GPU then (GI id, CI id)."""
    out = []
    state = fake.state
    for gpu in fake.model.gpus:
        parent = gpu_target(fake, gpu.index)
        for gi, ci in state.gpus[gpu.index].mig_devices():
            out.append(Target(gpu.index, mig_uuid(gpu.uuid, gi.id, ci.id), parent.bus_id, True))
    return out


def _bus_key(text: str) -> tuple[int, int, int, int] | None:
    """``domain:bus:device.function`` (domain optional, hex, any case) as numbers."""
    parts = text.lower().split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3 or "." not in parts[2]:
        return None
    device, function = parts[2].split(".", 1)
    try:
        return (int(parts[0], 16), int(parts[1], 16), int(device, 16), int(function, 16))
    except ValueError:
        return None


def find_target(fake: FakeNvml, ident: str) -> Target | None:
    """What ``nvidia-smi -i`` accepts: the 0-based index, the UUID (``GPU-…``; ``MIG-…`` names
    a MIG device), the PCI bus id or the board serial number. None when nothing matches."""
    ident = ident.strip()
    gpus = [gpu_target(fake, g.index) for g in fake.model.gpus]
    if ident.isdigit() and int(ident) < len(gpus):
        return gpus[int(ident)]  # board serials are digits too, but far longer
    if ident.startswith("MIG-"):
        return next((t for t in mig_targets(fake) if t.uuid == ident), None)
    if ident.startswith("GPU-"):
        return next((t for t in gpus if t.uuid == ident), None)
    key = _bus_key(ident)
    if key is not None:
        return next((t for t in gpus if _bus_key(t.bus_id) == key), None)
    return next((t for t, g in zip(gpus, fake.model.gpus, strict=True) if g.serial == ident), None)


def visible_devices(fake: FakeNvml, value: str | None) -> tuple[list[Target], list[str]]:
    """The devices ``CUDA_VISIBLE_DEVICES`` makes visible, and warnings about the value.

    Unset: every GPU. Entries are indices, GPU UUIDs or MIG device UUIDs, or a unique prefix of
    one (starting with ``GPU-`` / ``MIG-``), as CUDA accepts them; as in CUDA, an entry that names
    no device hides it and every entry after it.
    """
    gpus = [gpu_target(fake, g.index) for g in fake.model.gpus]
    if value is None:
        return gpus, []
    migs = mig_targets(fake)
    found: list[Target] = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        if entry.isdigit():
            matches = [gpus[int(entry)]] if int(entry) < len(gpus) else []
        else:
            pool = migs if entry.startswith("MIG-") else gpus
            matches = [t for t in pool if t.uuid.startswith(entry)]
        if len(matches) != 1:
            why = "matches no device" if not matches else "matches several devices"
            return found, [
                f"CUDA_VISIBLE_DEVICES entry {entry!r} {why}; it and the entries after it are"
                " ignored, as CUDA ignores them"
            ]
        if matches[0] not in found:
            found.append(matches[0])
    return found, [] if found else ["CUDA_VISIBLE_DEVICES makes no device visible"]
