"""Hot-plug on the simulated node: GPUs leaving and returning, the udev events they cause, and an
administrator's MIG change.

``remove_gpu`` / ``add_gpu`` change what a real node changes when a GPU is hot-removed or added:
the simulator's state (NVML stops or starts enumerating it, see ``NvmlCore.present``), the sysfs
tree (its PCI function directory and ``bus/pci/devices`` link go or come back) and udev: the
kernel's uevents for the function are appended to ``<sim dir>/udev-events.jsonl`` (unbind then
remove on the way out, add then bind on the way in: docs/gpu-facts.md), which
:class:`SimUdevSource` (an :class:`agent.hotplug.EventSource`) tails for the agent.

``rebind_gpu`` is an operator's driver re-bind of one function (unbind then bind, no change to
NVML's enumeration): what lets a GPU with a sticky fatal XID be probed again.

``set_mig_layout`` is ``nvidia-smi mig`` on one GPU: instances destroyed and the layout's created,
refused where the real tool refuses; it emits no udev event (a MIG change is not a PCI event), so
only the agent's periodic re-read sees it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent.errors import ConfigError
from agent.fsutil import ensure_dir
from agent.hotplug import PciEvent, accept
from agent.sim import layouts
from agent.sim.model import NVIDIA_VENDOR
from agent.sim.nvml import FakeNvml
from agent.sim.sysfs import write_sysfs

EVENT_LOG = "udev-events.jsonl"
POLL_S = 0.05
"""How often :class:`SimUdevSource` looks at the event log while it waits."""
MIG_LAYOUTS = tuple(n for n in layouts.layout_names() if n != "none")
"""The layouts ``sim fault mig-layout`` creates (``none`` is turning MIG off, not a layout)."""


def removed_buses(fake: FakeNvml) -> frozenset[str]:
    """The sysfs bus ids of the simulated node's hot-removed GPUs."""
    return frozenset(fake.model.gpus[i].bus for i in fake.removed())


def _uevent(fake: FakeNvml, index: int, action: str) -> dict[str, str]:
    """The uevent properties the kernel sends for a GPU's PCI function (what udev passes on)."""
    slot = fake.model.gpus[index]
    device = slot.spec.pci_device_id >> 16
    return {
        "ACTION": action,
        "SUBSYSTEM": "pci",
        "DEVPATH": "/devices/" + "/".join((*slot.parent, slot.bus)),
        "PCI_ID": f"{NVIDIA_VENDOR:04X}:{device:04X}",
        "PCI_SLOT_NAME": slot.bus,
        "PCI_CLASS": "30200",
        **({"DRIVER": "nvidia"} if action in ("bind", "unbind") else {}),
    }


def emit_events(sim_dir: Path, events: Sequence[dict[str, str]]) -> None:
    """Append udev events to the event log (one JSON object a line, one write)."""
    ensure_dir(sim_dir)
    data = "".join(json.dumps(e, sort_keys=True) + "\n" for e in events).encode()
    fd = os.open(sim_dir / EVENT_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _rewrite_sysfs(fake: FakeNvml, sysfs_root: Path | None) -> None:
    root = sysfs_root if sysfs_root is not None else fake.state_dir / "sys"
    if root.is_dir():
        write_sysfs(fake.model, root, removed_buses(fake), fake.vm_state)


def remove_gpu(fake: FakeNvml, index: int, sysfs_root: Path | None = None) -> bool:
    """Hot-remove GPU ``index`` (the model's index); False when it was already removed.
    ``sysfs_root``: the simulated sysfs tree (default ``<sim dir>/sys``, rewritten if it
    exists)."""
    if not fake.set_removed(index, True):
        return False
    _rewrite_sysfs(fake, sysfs_root)
    emit_events(fake.state_dir, [_uevent(fake, index, "unbind"), _uevent(fake, index, "remove")])
    return True


def add_gpu(fake: FakeNvml, index: int, sysfs_root: Path | None = None) -> bool:
    """Hot-add GPU ``index`` back; False when it was on the bus already."""
    if not fake.set_removed(index, False):
        return False
    _rewrite_sysfs(fake, sysfs_root)
    emit_events(fake.state_dir, [_uevent(fake, index, "add"), _uevent(fake, index, "bind")])
    return True


def rebind_gpu(fake: FakeNvml, index: int) -> bool:
    """An operator re-binds GPU ``index`` to the driver (``echo BUS > .../nvidia/unbind`` then
    ``.../bind``, the usual way to reset a GPU that still answers but took a fatal XID): a lost
    GPU answers again and udev sees unbind then bind. False when the GPU is not on the bus."""
    if index in fake.removed():
        return False
    fake.recover_gpu(index)
    emit_events(fake.state_dir, [_uevent(fake, index, "unbind"), _uevent(fake, index, "bind")])
    return True


def set_mig_layout(fake: FakeNvml, index: int, name: str) -> None:
    """Apply MIG layout ``name`` to GPU ``index`` as ``nvidia-smi mig -dci -dgi -cgi ... -C``
    would. ConfigError for an unknown GPU or layout (naming the allowed ones); MigError where
    nvidia-smi refuses: the GPU is not on the bus, has no MIG, has MIG mode off, or processes
    run on it, or the layout does not fit."""
    if name not in MIG_LAYOUTS:
        raise ConfigError(f"unknown MIG layout {name!r}; allowed: {', '.join(MIG_LAYOUTS)}")
    fake.apply_gpu_mig_layout(index, name)


class SimUdevSource:
    """The simulated node's udev: the events ``remove_gpu``/``add_gpu`` append to the event log,
    from the end it had when the source was opened (like a netlink monitor, it sees only what
    comes after). ``wait`` is how it pauses between looks (default: until closed or the time
    passes)."""

    def __init__(
        self,
        sim_dir: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], Any] | None = None,
    ) -> None:
        self._path = sim_dir / EVENT_LOG
        self._clock = clock
        self._closed = threading.Event()
        self._wait = wait or self._closed.wait
        self._offset = self._path.stat().st_size if self._path.exists() else 0
        self._partial = b""

    def _read(self) -> list[PciEvent]:
        try:
            with self._path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        events: list[PciEvent] = []
        for line in lines:
            try:
                raw = json.loads(line)
            except ValueError:
                continue
            if not isinstance(raw, dict):
                continue
            props = {str(k): str(v) for k, v in raw.items()}
            event = accept(props.get("ACTION"), props, props.get("PCI_SLOT_NAME", ""))
            if event is not None:
                events.append(event)
        return events

    def poll(self, timeout_s: float) -> Sequence[PciEvent]:
        deadline = self._clock() + timeout_s
        while True:
            events = self._read()
            left = deadline - self._clock()
            if events or left <= 0 or self._closed.is_set():
                return events
            self._wait(min(POLL_S, left))

    def close(self) -> None:
        self._closed.set()
