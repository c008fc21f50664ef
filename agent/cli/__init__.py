"""The ``tessera`` command: the command tree, its options, and the handlers.

Every command's options are declared like the agent's settings (``agent.config.setting``), so each
flag is also a ``TESSERA_<FLAG>`` variable; ``agent/cli/framework.py`` builds argparse from the
declarations and loads them. Every failure ends the command with one line on stderr and exit
code 2; a missing NVIDIA driver says so and suggests ``--simulate``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import yaml

from agent.cli.foreground import failed, stop_on_signals
from agent.cli.framework import (
    EXIT_ERROR,
    NO_DRIVER_HINT,
    Command,
    Invocation,
    Parser,
    Uses,
    invoke,
)
from agent.cli.framework import build_parser as build_tree_parser
from agent.cli.node_commands import discover_node, node_session, published_slices
from agent.config import Config, host_port, seconds, setting
from agent.tls import TlsFiles

__all__ = ["EXIT_ERROR", "NO_DRIVER_HINT", "build_parser", "main"]


# -- the options of single commands ---------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DiscoverOptions:
    output: str = setting(
        "table",
        "Output format: table (for people), json or yaml (for scripts).",
        flags=("-o", "--output"),
        choices=("table", "json", "yaml"),
    )


@dataclass(frozen=True, kw_only=True)
class TopoOptions:
    format: str = setting(
        "matrix",
        "matrix: the nvidia-smi topo -m table; dot: a Graphviz graph of the node.",
        choices=("matrix", "dot"),
    )


@dataclass(frozen=True, kw_only=True)
class SlicesOptions:
    output: str = setting(
        "yaml",
        "Output format of the ResourceSlices: yaml (a multi-document stream) or json (a list).",
        flags=("-o", "--output"),
        choices=("yaml", "json"),
    )


def endpoint(raw: str) -> str:
    """A gRPC target for the telemetry API: ``unix:///abs/path``, ``unix:path`` or HOST:PORT."""
    if raw.startswith("unix:"):
        path = raw.removeprefix("unix:")
        authority = path.startswith("//") and not path.startswith("///")  # unix://host/...
        if authority or not path.strip("/"):
            raise ValueError("is not unix:///ABSOLUTE/PATH or unix:RELATIVE/PATH")
        return raw
    try:
        return host_port(raw)
    except ValueError:
        raise ValueError("is not unix:///PATH/telemetry.sock or HOST:PORT") from None


@dataclass(frozen=True, kw_only=True)
class TopOptions:
    endpoint: str | None = setting(
        None,
        "The agent's telemetry API: unix:///PATH/telemetry.sock or HOST:PORT (the agent's"
        " --telemetry-address). Unset: <state-dir>/telemetry.sock.",
        metavar="ADDRESS",
        parse=endpoint,
    )
    state_dir: Path | None = setting(
        None,
        "The running agent's --state-dir (its telemetry socket is <dir>/telemetry.sock). Unset:"
        " /var/lib/tessera.",
        metavar="DIR",
    )
    once: bool = setting(False, "Print one frame and exit (scripts, tests).")
    interval: float = setting(1.0, "Seconds between frames.", metavar="SECONDS", parse=seconds)
    tls: bool = setting(
        False,
        "Connect to a HOST:PORT endpoint with TLS (implied by --tls-ca, --tls-cert, --tls-key),"
        " checking the agent's certificate against --tls-ca or the system's CAs.",
    )
    tls_ca: Path | None = setting(
        None,
        "PEM bundle of the CA that signed the agent's --telemetry-tls-cert.",
        metavar="FILE",
    )
    tls_cert: Path | None = setting(
        None,
        "PEM client certificate, for an agent that asks for one (--telemetry-tls-client-ca);"
        " needs --tls-key.",
        metavar="FILE",
    )
    tls_key: Path | None = setting(
        None, "PEM private key (unencrypted) of --tls-cert.", metavar="FILE"
    )
    tls_server_name: str | None = setting(
        None,
        "The name the agent's certificate must carry, when it is not the endpoint's host.",
        metavar="NAME",
    )

    def tls_files(self) -> TlsFiles | None:
        """The client's TLS files; None: plain gRPC."""
        given = (self.tls_ca, self.tls_cert, self.tls_key)
        if not self.tls and all(f is None for f in given) and self.tls_server_name is None:
            return None
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca, option="--tls", ca_suffix="-ca")


# -- handlers ---------------------------------------------------------------------------------


def cmd_discover(inv: Invocation) -> int:
    from agent.discovery.export import inventory_to_dict

    with node_session(inv.get(Config)) as source:
        node = discover_node(inv.get(Config), source)
    data = inventory_to_dict(node)
    output = inv.get(DiscoverOptions).output
    if output == "json":
        inv.out.write(json.dumps(data, indent=2) + "\n")
    elif output == "yaml":
        inv.out.write(yaml.safe_dump(data, sort_keys=False))
    else:
        from agent.discovery.table import render_table

        render_table(node, inv.out)
    return 0


def cmd_topo(inv: Invocation) -> int:
    from agent.discovery.render import render_dot, render_matrix

    with node_session(inv.get(Config)) as source:
        node = discover_node(inv.get(Config), source)
    dot = inv.get(TopoOptions).format == "dot"
    inv.out.write(render_dot(node) if dot else render_matrix(node))
    return 0


def cmd_slices(inv: Invocation) -> int:
    objs = published_slices(inv.get(Config))
    if inv.get(SlicesOptions).output == "json":
        inv.out.write(json.dumps(objs, indent=2) + "\n")
    else:
        inv.out.write(yaml.safe_dump_all(objs, sort_keys=False))
    return 0


def cmd_top(inv: Invocation) -> int:
    from agent.daemon import DEFAULT_STATE_DIR
    from agent.telemetry.top import run_top, target

    opts = inv.get(TopOptions)
    stop = threading.Event()
    if not opts.once:
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    endpoint = target(opts.endpoint, opts.state_dir or DEFAULT_STATE_DIR)
    return run_top(
        endpoint,
        opts.once,
        opts.interval,
        inv.out,
        stop,
        tls=opts.tls_files(),
        server_name=opts.tls_server_name,
    )


def cmd_run(inv: Invocation) -> int:
    config = inv.get(Config)
    # Modes are set explicitly where Tessera creates files and directories; a umask of 000 in the
    # agent's environment must not make what libraries create world-writable either.
    os.umask(os.umask(0o022) | 0o022)
    if config.daemon.log_format == "json":
        # gRPC's C core writes its own plain-text lines to stderr, outside Python logging: keep
        # the stream JSON-only unless the operator asks for them (GRPC_VERBOSITY=ERROR).
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from agent.daemon.allocator import limit_arenas

    arenas = limit_arenas(config.daemon.malloc_arenas)  # before any thread starts

    from agent.cli.node_access import node_access
    from agent.daemon import build_agent
    from agent.http import raise_descriptor_limit
    from agent.logs import configure_logging

    log = configure_logging(config.daemon.log_format, config.daemon.log_level)
    raised = raise_descriptor_limit()  # --fd-reserve is kept below this limit
    if raised is not None:
        log.info(
            "raised the open-file limit to the hard limit",
            extra={"fields": {"soft_was": raised[0], "soft": raised[1]}},
        )
    stop = stop_on_signals(log)
    try:
        agent = build_agent(config, log, node_access(config), dict(os.environ))
        log.info(  # once the state directory is ours: an agent refused it says only that
            "malloc arenas",
            extra={"fields": {"limit": arenas.applied, "left_as_is": arenas.why_not}},
        )
        code = agent.run(stop)
    except Exception as exc:
        return failed(inv, log, "agent", exc)
    if agent.unfinished:
        # Threads still busy past the shutdown deadline would hold the interpreter's exit
        # (it joins pool workers); their work is left to the next start's reconcile.
        logging.shutdown()
        os._exit(code)
    return code


# -- the tree ---------------------------------------------------------------------------------

NODE = ("node",)
TREE = Command(
    "tessera",
    "Tessera: GPU node agent and Kubernetes DRA driver.",
    subcommands=(
        Command(
            "run",
            "run the node agent (daemon) in the foreground",
            cmd_run,
            (Uses(Config, ("node", "driver", "daemon")),),
        ),
        Command(
            "discover",
            "print the node inventory (GPUs, NICs, topology)",
            cmd_discover,
            (Uses(Config, NODE), Uses(DiscoverOptions)),
        ),
        Command(
            "topo",
            "print the GPU/NIC topology matrix or a DOT graph",
            cmd_topo,
            (Uses(Config, NODE), Uses(TopoOptions)),
        ),
        Command(
            "slices",
            "print the ResourceSlices this node would publish",
            cmd_slices,
            (Uses(Config, ("node", "driver")), Uses(SlicesOptions)),
        ),
        Command(
            "top",
            "live view of GPU telemetry and the claims holding them",
            cmd_top,
            (Uses(TopOptions),),
            description="A live view of a running agent's telemetry API: utilization, memory,"
            " power, energy, temperatures and the claims holding each device.",
        ),
        Command(
            "explain",
            "would a ResourceClaim fit, on which node, and why not (the scheduler's allocator)",
            module="agent.cli.explain",
        ),
        Command(
            "doctor",
            "check that this node is ready for the agent (driver, devices, CDI, kubelet, API"
            " server)",
            module="agent.cli.doctor",
        ),
        Command(
            "kubelet",
            "call a DRA plugin's sockets exactly as the kubelet does (debugging on a node)",
            module="agent.cli.kubelet",
        ),
        Command(
            "usage",
            "GPU-hours, energy and cost this node has counted per claim or namespace",
            module="agent.cli.usage",
        ),
        Command(
            "budgets",
            "run the budget controller (GPU-hour, energy and cost budgets; a Deployment)",
            module="agent.cli.budgets",
        ),
        Command(
            "uninstall",
            "remove the driver's CDI specs from this node once no agent runs and no claim is"
            " prepared",
            module="agent.cli.uninstall",
        ),
        Command("sim", "simulator controls", module="agent.cli.sim"),
    ),
)


def version() -> str:
    from importlib import metadata  # here: 30 to 50 ms that only --version needs

    try:
        return metadata.version("tessera")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser(
    out: IO[str] | None = None, err: IO[str] | None = None, argv: Sequence[str] | None = None
) -> Parser:
    """The command line's parser; with ``argv``, only for the commands it names."""
    return build_tree_parser(TREE, version, out, err, argv)


def main(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    env = os.environ if environ is None else environ
    try:
        words = sys.argv[1:] if argv is None else argv
        return invoke(build_parser(out, err, words), argv, env, out, err)
    except BrokenPipeError:
        # the reader went away (`tessera ... | head`): stop quietly, like other Unix tools
        devnull = os.open(os.devnull, os.O_WRONLY)
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull, out.fileno())
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
