"""The MPS control daemon's command language (pure): one command line -> a reply and a new state.

The subset a sharing driver uses, as NVIDIA's MPS documentation ("Appendix: Tools and Interface
Reference") defines it:

* ``get_server_list``: the PIDs of the MPS servers, one a line. The simulator starts no servers
  (they start when a CUDA client connects), so the reply is empty.
* ``set_default_active_thread_percentage <p>``: replies the value as the daemon keeps it
  (``25.0``); ``get_default_active_thread_percentage`` replies it (``100.0`` by default).
* ``set_default_device_pinned_mem_limit <dev> <value>``: ``<value>`` is an integer followed by
  ``M`` or ``G``; ``<dev>`` a device index as the daemon sees them (its CUDA_VISIBLE_DEVICES
  order) or a device UUID. ``get_default_device_pinned_mem_limit <dev>`` replies it.
* ``quit``: the daemon exits.

Errors are replies too (the client still exits 0), worded by the simulator.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from agent.sim.sharing import MpsDaemon

_LIMIT = re.compile(r"^(\d{1,12})([MG])$")
MIB_PER_GIB = 1024


@dataclass(frozen=True)
class Outcome:
    daemon: MpsDaemon
    reply: str
    """The text the client prints (empty: nothing)."""
    quit: bool = False


def format_percentage(value: float) -> str:
    """``25.0``: how the daemon prints a thread percentage (pure)."""
    return f"{value:.1f}"


def format_limit(mib: int) -> str:
    """A pinned memory limit as the daemon prints it: whole GiB as ``<n>G`` (rounded down) from
    1 GiB on, else ``<n>M`` (pure). See docs/gpu-facts.md for the evidence and its doubts."""
    return f"{mib // MIB_PER_GIB}G" if mib >= MIB_PER_GIB else f"{mib}M"


def parse_limit(text: str) -> int | None:
    """``2G`` / ``2048M`` -> MiB; None when it is not an integer followed by M or G (pure)."""
    m = _LIMIT.match(text)
    if m is None:
        return None
    return int(m.group(1)) * (MIB_PER_GIB if m.group(2) == "G" else 1)


def _device(daemon: MpsDaemon, text: str) -> str | None:
    """The UUID of device ``text`` (an index into the daemon's devices, or a UUID it serves)."""
    if text.isdigit():
        index = int(text)
        return daemon.devices[index] if index < len(daemon.devices) else None
    return text if text in daemon.devices else None


def _no_device(daemon: MpsDaemon, text: str) -> str:
    served = ", ".join(f"{i}={u}" for i, u in enumerate(daemon.devices)) or "none"
    return f"Invalid device {text!r}: this daemon serves {served}"


def _set_percentage(daemon: MpsDaemon, args: list[str]) -> Outcome:
    usage = "usage: set_default_active_thread_percentage <percentage>, a number > 0 and <= 100"
    if len(args) != 1:
        return Outcome(daemon, usage)
    try:
        value = float(args[0])
    except ValueError:
        return Outcome(daemon, f"Invalid percentage {args[0]!r}; {usage}")
    if not (math.isfinite(value) and 0 < value <= 100):
        return Outcome(daemon, f"Invalid percentage {args[0]!r}; {usage}")
    return Outcome(replace(daemon, active_thread_percentage=value), format_percentage(value))


def _set_limit(daemon: MpsDaemon, args: list[str]) -> Outcome:
    usage = "usage: set_default_device_pinned_mem_limit <dev> <value>, value like 2G or 2048M"
    if len(args) != 2:
        return Outcome(daemon, usage)
    uuid = _device(daemon, args[0])
    if uuid is None:
        return Outcome(daemon, _no_device(daemon, args[0]))
    mib = parse_limit(args[1])
    if mib is None:
        return Outcome(daemon, f"Invalid limit {args[1]!r}: an integer followed by M or G; {usage}")
    limits = dict(daemon.pinned_mem_limits)
    limits[uuid] = mib
    return Outcome(replace(daemon, pinned_mem_limits=tuple(sorted(limits.items()))), "")


def _get_limit(daemon: MpsDaemon, args: list[str]) -> Outcome:
    if len(args) != 1:
        return Outcome(daemon, "usage: get_default_device_pinned_mem_limit <dev>")
    uuid = _device(daemon, args[0])
    if uuid is None:
        return Outcome(daemon, _no_device(daemon, args[0]))
    return Outcome(daemon, format_limit(dict(daemon.pinned_mem_limits).get(uuid, 0)))


COMMANDS = (
    "get_server_list",
    "set_default_active_thread_percentage",
    "get_default_active_thread_percentage",
    "set_default_device_pinned_mem_limit",
    "get_default_device_pinned_mem_limit",
    "quit",
)


def execute(daemon: MpsDaemon, line: str) -> Outcome:
    """Run one command line against the daemon's state (pure)."""
    words = line.split()
    if not words:
        return Outcome(daemon, "")
    name, args = words[0], words[1:]
    if name == "get_server_list" and not args:
        return Outcome(daemon, "")
    if name == "get_default_active_thread_percentage" and not args:
        return Outcome(daemon, format_percentage(daemon.active_thread_percentage))
    if name == "set_default_active_thread_percentage":
        return _set_percentage(daemon, args)
    if name == "set_default_device_pinned_mem_limit":
        return _set_limit(daemon, args)
    if name == "get_default_device_pinned_mem_limit":
        return _get_limit(daemon, args)
    if name == "quit" and not args:
        return Outcome(daemon, "", quit=True)
    return Outcome(
        daemon,
        f"Unrecognized command {line.strip()!r}; this simulation knows: {', '.join(COMMANDS)}",
    )
