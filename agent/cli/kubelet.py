"""``tessera kubelet``: call a DRA plugin's sockets exactly as the kubelet does (node debugging).

::

    tessera kubelet info      --socket /var/lib/kubelet/plugins_registry/DRIVER-reg.sock
    tessera kubelet prepare   --socket /var/lib/kubelet/plugins/DRIVER/dra.sock --claim NS/NAME/UID
    tessera kubelet unprepare --socket ... --claim NS/NAME/UID [--claim ...] [--api v1beta1]
    tessera kubelet health    --socket /var/lib/kubelet/plugins/DRIVER/dra.sock --count 3

Output is JSON on stdout (``health``: one JSON line per message). Exit code 0 when everything
succeeded; 1 when the plugin answered but reported a problem (a claim with an error or missing
from the answer, a refused registration, fewer health messages than asked for); gRPC and
connection failures raise TesseraError (one line on stderr, exit code 2 from the main CLI).
Every option is also a ``TESSERA_<FLAG>`` variable (``TESSERA_SOCKET``, ``TESSERA_CLAIM``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from agent.cli.framework import Command, Invocation, Uses
from agent.config import REQUIRED, positive_int, seconds, setting
from dra_driver.testkubelet.calls import APIS, KUBELET_CALL_TIMEOUT, REGISTRATION_TIMEOUT, ClaimRef

_WARNING = (
    "For debugging on a node. Careful: these are real calls, so prepare and unprepare really "
    "prepare and unprepare (CDI specs, sharing setup, checkpoint) and info really tells the "
    "plugin whether it is registered."
)
_DRA_SOCKET = (
    "The plugin's DRA socket, e.g. /var/lib/kubelet/plugins/DRIVER/dra.sock (dra-<pod uid>.sock"
    " for an agent run with --rolling-update)."
)


def claim_ref(text: str) -> ClaimRef:
    try:
        return ClaimRef.parse(text)
    except ValueError:
        raise ValueError(
            "is not NAMESPACE/NAME/UID (three non-empty parts separated by '/',"
            " e.g. default/my-claim/0b6c...)"
        ) from None


@dataclass(frozen=True, kw_only=True)
class InfoOptions:
    socket: Path = setting(
        REQUIRED,
        "The plugin's registration socket, e.g. /var/lib/kubelet/plugins_registry/DRIVER-reg.sock"
        " (DRIVER-<pod uid>-reg.sock for an agent run with --rolling-update).",
        metavar="PATH",
    )
    timeout: float = setting(
        REGISTRATION_TIMEOUT, "Call timeout in seconds.", metavar="SECONDS", parse=seconds
    )


@dataclass(frozen=True, kw_only=True)
class CallOptions:
    socket: Path = setting(REQUIRED, _DRA_SOCKET, metavar="PATH")
    claim: tuple[ClaimRef, ...] = setting(
        REQUIRED,
        "A ResourceClaim (repeat for several, or comma-separate them in the variable; the"
        " kubelet sends a pod's claims together).",
        metavar="NAMESPACE/NAME/UID",
        parse=claim_ref,
    )
    api: str = setting(
        "v1",
        "DRAPlugin API version to call (kubelet 1.34+: v1; 1.32/1.33: v1beta1).",
        choices=APIS,
    )
    timeout: float = setting(
        KUBELET_CALL_TIMEOUT,
        "Call timeout in seconds (the kubelet's).",
        metavar="SECONDS",
        parse=seconds,
    )


@dataclass(frozen=True, kw_only=True)
class HealthOptions:
    socket: Path = setting(REQUIRED, _DRA_SOCKET, metavar="PATH")
    count: int = setting(
        1,
        "Print this many messages, then stop (the first is the current state).",
        metavar="N",
        parse=positive_int,
    )
    timeout: float | None = setting(
        None,
        "Stop watching after this long. Unset: wait until --count messages arrived.",
        metavar="SECONDS",
        parse=seconds,
    )


def _dump(data: Any, out: IO[str]) -> None:
    out.write(json.dumps(data, indent=2) + "\n")
    out.flush()


def cmd_info(inv: Invocation) -> int:
    from dra_driver.testkubelet.client import register_like_kubelet  # gRPC only when called

    opts = inv.get(InfoOptions)
    result = register_like_kubelet(opts.socket, timeout=opts.timeout)
    _dump(result, inv.out)
    return 0 if result["registered"] else 1


def _call(inv: Invocation, command: str) -> int:
    from dra_driver.testkubelet.client import KubeletClient

    opts = inv.get(CallOptions)
    with KubeletClient(opts.socket, timeout=opts.timeout) as client:
        call = client.prepare if command == "prepare" else client.unprepare
        answer = call(opts.claim, api=opts.api)
    missing = sorted({c.uid for c in opts.claim} - set(answer["claims"]))
    if missing:
        # the kubelet fails the whole call when a claim is missing from the answer
        answer["missingClaims"] = missing
    _dump(answer, inv.out)
    failed = missing or any(r["error"] for r in answer["claims"].values())
    return 1 if failed else 0


def cmd_health(inv: Invocation) -> int:
    from dra_driver.testkubelet.client import KubeletClient

    opts = inv.get(HealthOptions)
    seen = 0
    with KubeletClient(opts.socket) as client:
        for devices in client.watch_health(max_messages=opts.count, timeout=opts.timeout):
            inv.out.write(json.dumps(devices) + "\n")
            inv.out.flush()
            seen += 1
    return 0 if seen >= opts.count else 1


def _rpc_command(name: str, rpc: str) -> Command:
    return Command(
        name,
        f"call {rpc} on the DRA socket, like the kubelet",
        lambda inv: _call(inv, name),
        (Uses(CallOptions),),
        description=f"Call DRAPlugin.{rpc} on the plugin's DRA socket with the given claims, "
        "exactly as the kubelet does, and print the answer as JSON. Exit code 1 when a "
        "claim has an error or is missing from the answer. " + _WARNING,
    )


COMMAND = Command(
    "kubelet",
    "call a DRA plugin's sockets exactly as the kubelet does (debugging on a node)",
    description="Talk to a DRA plugin over its unix sockets exactly as the kubelet does: "
    "insecure gRPC, the kubelet's messages and timeouts. " + _WARNING,
    metavar="KUBELET_COMMAND",
    subcommands=(
        Command(
            "info",
            "registration handshake on the registration socket, like the kubelet",
            cmd_info,
            (Uses(InfoOptions),),
            description="Perform the kubelet's registration handshake on the plugin's "
            "registration socket: GetInfo, check type DRAPlugin, the endpoint (an absolute path "
            "to an existing socket) and the supported versions (first one the kubelet knows, in "
            "the plugin's order), then NotifyRegistrationStatus with the verdict; print the "
            "result as JSON. Exit code 1 when the kubelet would refuse the plugin. " + _WARNING,
        ),
        _rpc_command("prepare", "NodePrepareResources"),
        _rpc_command("unprepare", "NodeUnprepareResources"),
        Command(
            "health",
            "watch DRAResourceHealth.NodeWatchResources on the DRA socket",
            cmd_health,
            (Uses(HealthOptions),),
            description="Watch the plugin's device health stream (DRAResourceHealth."
            "NodeWatchResources) like the kubelet does and print each message's device list as "
            "one JSON line. Exit code 1 when fewer than --count messages arrived before the "
            "stream ended or --timeout passed.",
        ),
    ),
)
