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
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import IO, Any

from dra_driver.kubelet_client import (
    APIS,
    KUBELET_CALL_TIMEOUT,
    REGISTRATION_TIMEOUT,
    ClaimRef,
    KubeletClient,
    register_like_kubelet,
)

_WARNING = (
    "For debugging on a node. Careful: these are real calls, so prepare and unprepare really "
    "prepare and unprepare (CDI specs, sharing setup, checkpoint) and info really tells the "
    "plugin whether it is registered."
)


def _claim(text: str) -> ClaimRef:
    try:
        return ClaimRef.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def add_kubelet_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``kubelet`` with its sub-subcommands ``info``, ``prepare``, ``unprepare``, ``health``."""
    kubelet = sub.add_parser(
        "kubelet",
        help="call a DRA plugin's sockets exactly as the kubelet does (debugging on a node)",
        description="Talk to a DRA plugin over its unix sockets exactly as the kubelet does: "
        "insecure gRPC, the kubelet's messages and timeouts. " + _WARNING,
    )
    ksub = kubelet.add_subparsers(dest="kubelet_command", required=True, metavar="KUBELET_COMMAND")

    info = ksub.add_parser(
        "info",
        help="registration handshake on the registration socket, like the kubelet",
        description="Perform the kubelet's registration handshake on the plugin's registration "
        "socket: GetInfo, check type DRAPlugin, the endpoint (an absolute path to an existing "
        "socket) and the supported versions (first one the kubelet knows, in the plugin's "
        "order), then NotifyRegistrationStatus with the verdict; print the result as JSON. "
        "Exit code 1 when the kubelet would refuse the plugin. " + _WARNING,
    )
    _add_socket(
        info,
        "the plugin's registration socket, e.g. /var/lib/kubelet/plugins_registry/DRIVER-reg.sock",
    )
    _add_timeout(info, REGISTRATION_TIMEOUT, "")

    for name, rpc in (("prepare", "NodePrepareResources"), ("unprepare", "NodeUnprepareResources")):
        p = ksub.add_parser(
            name,
            help=f"call {rpc} on the DRA socket, like the kubelet",
            description=f"Call DRAPlugin.{rpc} on the plugin's DRA socket with the given claims, "
            f"exactly as the kubelet does, and print the answer as JSON. Exit code 1 when a "
            f"claim has an error or is missing from the answer. " + _WARNING,
        )
        _add_socket(p, "the plugin's DRA socket, e.g. /var/lib/kubelet/plugins/DRIVER/dra.sock")
        p.add_argument(
            "--claim",
            dest="claims",
            metavar="NAMESPACE/NAME/UID",
            type=_claim,
            action="append",
            required=True,
            help="a ResourceClaim (repeat for several; the kubelet sends a pod's claims together)",
        )
        p.add_argument(
            "--api",
            choices=APIS,
            default="v1",
            help="DRAPlugin API version to call (kubelet 1.34+: v1; 1.32/1.33: v1beta1)",
        )
        _add_timeout(p, KUBELET_CALL_TIMEOUT, ", the kubelet's")

    health = ksub.add_parser(
        "health",
        help="watch DRAResourceHealth.NodeWatchResources on the DRA socket",
        description="Watch the plugin's device health stream (DRAResourceHealth."
        "NodeWatchResources) like the kubelet does and print each message's device list as "
        "one JSON line. Exit code 1 when fewer than --count messages arrived before the "
        "stream ended or --timeout passed.",
    )
    _add_socket(health, "the plugin's DRA socket, e.g. /var/lib/kubelet/plugins/DRIVER/dra.sock")
    health.add_argument(
        "--count",
        type=_positive_int,
        default=1,
        metavar="N",
        help="print this many messages, then stop (default: 1; the first is the current state)",
    )
    health.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="stop watching after this long (default: wait until --count messages arrived)",
    )


def _add_socket(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--socket", type=Path, required=True, metavar="PATH", help=what)


def _add_timeout(parser: argparse.ArgumentParser, default: float, note: str) -> None:
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=default,
        metavar="SECONDS",
        help=f"call timeout in seconds (default: {default:g}{note})",
    )


def _dump(data: Any, out: IO[str]) -> None:
    out.write(json.dumps(data, indent=2) + "\n")
    out.flush()


def cmd_kubelet(args: argparse.Namespace, out: IO[str]) -> int:
    """Run ``tessera kubelet SUBCOMMAND``; returns the exit code (0 ok, 1 plugin reported a
    problem). gRPC and connection failures raise KubeletApiError."""
    command: str = args.kubelet_command
    if command == "info":
        result = register_like_kubelet(args.socket, timeout=args.timeout)
        _dump(result, out)
        return 0 if result["registered"] else 1
    if command in ("prepare", "unprepare"):
        claims: list[ClaimRef] = args.claims
        with KubeletClient(args.socket, timeout=args.timeout) as client:
            call = client.prepare if command == "prepare" else client.unprepare
            answer = call(claims, api=args.api)
        missing = sorted({c.uid for c in claims} - set(answer["claims"]))
        if missing:
            # the kubelet fails the whole call when a claim is missing from the answer
            answer["missingClaims"] = missing
        _dump(answer, out)
        failed = missing or any(r["error"] for r in answer["claims"].values())
        return 1 if failed else 0
    if command == "health":
        seen = 0
        with KubeletClient(args.socket) as client:
            for devices in client.watch_health(max_messages=args.count, timeout=args.timeout):
                out.write(json.dumps(devices) + "\n")
                out.flush()
                seen += 1
        return 0 if seen >= args.count else 1
    raise ValueError(f"unknown kubelet command {command!r}")
