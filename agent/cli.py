"""The ``tessera`` command. Parses flags and environment into a Config and dispatches.

Every TesseraError ends the command with one line on stderr and exit code 2; a missing NVIDIA
driver says so and suggests ``--simulate``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import IO, Any

import yaml

from agent.config import Config, add_settings, load_config
from agent.errors import ConfigError, TesseraError
from agent.node import NodeSource, discover
from agent.nvml.errors import DriverNotFoundError

EXIT_ERROR = 2
NO_DRIVER_HINT = (
    "no NVIDIA driver found on this machine (libnvidia-ml.so.1 could not be loaded); "
    "to try Tessera without a GPU add --simulate MODEL, e.g. --simulate dgx-h100 "
    "(list models: tessera sim models)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Tessera: GPU node agent and Kubernetes DRA driver.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the node agent (daemon) in the foreground")
    add_settings(run, ("node", "driver", "daemon"))

    disc = sub.add_parser("discover", help="print the node inventory (GPUs, NICs, topology)")
    add_settings(disc, ("node",))
    disc.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")

    topo = sub.add_parser("topo", help="print the GPU/NIC topology matrix or a DOT graph")
    add_settings(topo, ("node",))
    topo.add_argument("--format", choices=("matrix", "dot"), default="matrix")

    slices = sub.add_parser("slices", help="print the ResourceSlices this node would publish")
    add_settings(slices, ("node", "driver"))
    slices.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")

    top = sub.add_parser("top", help="live view of GPU telemetry and the claims holding them")
    top.add_argument(
        "--endpoint",
        help="telemetry API: unix:///path/telemetry.sock or host:port"
        " (default: <state-dir>/telemetry.sock)",
    )
    top.add_argument("--state-dir", type=Path, default=None, help="the agent's state directory")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between frames")

    from dra_driver.kubelet_cli import add_kubelet_parser

    add_kubelet_parser(sub)

    sim = sub.add_parser("sim", help="simulator controls")
    simsub = sim.add_subparsers(dest="sim_command", required=True, metavar="SIM_COMMAND")
    simsub.add_parser("models", help="list the simulated node models")
    api = simsub.add_parser(
        "apiserver",
        help="serve an in-memory Kubernetes API server (for kube mode without a cluster)",
    )
    api.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0: any free one)")
    api.add_argument(
        "--kubeconfig-out", type=Path, required=True, help="write a kubeconfig for it to this file"
    )
    from agent.sim.faults_cli import add_fault_parser

    add_fault_parser(simsub)
    return parser


@contextmanager
def node_session(config: Config) -> Iterator[NodeSource]:
    """Open the node for a one-shot command; with --simulate and no --state-dir, use a
    temporary state directory that is removed afterwards."""
    from agent.daemon import open_node

    with tempfile.TemporaryDirectory(prefix="tessera-") as tmp:
        state_dir = config.state_dir or (Path(tmp) if config.simulate else Path("/var/lib/tessera"))
        source = open_node(config, state_dir)
        with source.nvml:
            yield source


def cmd_discover(config: Config, args: argparse.Namespace, out: IO[str]) -> int:
    from agent.discovery.export import inventory_to_dict

    with node_session(config) as source:
        inv = discover(source)
    data = inventory_to_dict(inv)
    if args.output == "json":
        out.write(json.dumps(data, indent=2) + "\n")
    elif args.output == "yaml":
        out.write(yaml.safe_dump(data, sort_keys=False))
    else:
        from agent.discovery.table import render_table

        render_table(inv, out)
    return 0


def cmd_topo(config: Config, args: argparse.Namespace, out: IO[str]) -> int:
    from agent.discovery.render import render_dot, render_matrix

    with node_session(config) as source:
        inv = discover(source)
    out.write(render_dot(inv) if args.format == "dot" else render_matrix(inv))
    return 0


def cmd_slices(config: Config, args: argparse.Namespace, out: IO[str]) -> int:
    from dra_driver.devices import DevicePolicy, advertised_devices
    from dra_driver.slices import SlicePolicy, build_slices

    with node_session(config) as source:
        inv = discover(source)
    model = advertised_devices(
        inv, DevicePolicy(driver_name=config.driver_name, mig_mode=config.mig_mode)
    )
    policy = SlicePolicy(
        driver_name=config.driver_name, node_name=source.hostname, layout=config.kube_layout
    )
    objs = build_slices(model, policy, generation=1)
    if args.output == "json":
        out.write(json.dumps(objs, indent=2) + "\n")
    else:
        out.write(yaml.safe_dump_all(objs, sort_keys=False))
    return 0


def _top(config: Config, args: argparse.Namespace, out: IO[str]) -> int:
    from agent.daemon import DEFAULT_STATE_DIR
    from agent.telemetry.top import run_top, target

    stop = threading.Event()
    if not args.once:
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    endpoint = target(args.endpoint, config.state_dir or DEFAULT_STATE_DIR)
    return run_top(endpoint, args.once, args.interval, out, stop)


def _kubelet(args: argparse.Namespace, out: IO[str]) -> int:
    from dra_driver.kubelet_cli import cmd_kubelet

    return cmd_kubelet(args, out)


def cmd_sim(config: Config, args: argparse.Namespace, out: IO[str]) -> int:
    if args.sim_command == "apiserver":
        return sim_apiserver(args.port, args.kubeconfig_out, out)
    if args.sim_command == "fault":
        from agent.sim.faults_cli import cmd_sim_fault

        return cmd_sim_fault(config, args, out)
    from agent.sim.model import load_model, model_names

    for name in model_names():
        out.write(f"{name:<12} {load_model(name).description}\n")
    return 0


def sim_apiserver(port: int, kubeconfig: Path, out: IO[str]) -> int:
    """Serve the API-server emulator until SIGINT/SIGTERM."""
    from agent.sim.apiserver import ApiServer

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with ApiServer(port=port) as server:
        server.kubeconfig(kubeconfig)
        out.write(f"API server emulator on {server.url}; kubeconfig: {kubeconfig}\n")
        out.flush()
        stop.wait()
    return 0


def cmd_run(config: Config, args: argparse.Namespace, out: IO[str]) -> int:
    if config.log_format == "json":
        # gRPC's C core writes its own plain-text lines to stderr, outside Python logging: keep
        # the stream JSON-only unless the operator asks for them (GRPC_VERBOSITY=ERROR).
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from agent.daemon import build_agent
    from agent.logs import configure_logging

    log = configure_logging(config.log_format, config.log_level)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal received, shutting down", extra={"fields": {"signal": signum}})
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        agent = build_agent(config, log)
        code = agent.run(stop)
    except TesseraError as exc:  # logs are JSON from here on: the reason is a log record too
        reason = NO_DRIVER_HINT if isinstance(exc, DriverNotFoundError) else str(exc)
        log.error("agent cannot run", extra={"fields": {"error": reason}})
        return EXIT_ERROR
    if agent.unfinished:
        # Threads still busy past the shutdown deadline would hold the interpreter's exit
        # (it joins pool workers); their work is left to the next start's reconcile.
        logging.shutdown()
        os._exit(code)
    return code


COMMANDS: dict[str, Callable[[Config, argparse.Namespace, IO[str]], int]] = {
    "run": cmd_run,
    "discover": cmd_discover,
    "topo": cmd_topo,
    "slices": cmd_slices,
    "kubelet": lambda config, args, out: _kubelet(args, out),
    "top": lambda config, args, out: _top(config, args, out),
    "sim": cmd_sim,
}


class EnvError(str):
    """A bad ``TESSERA_<OPTION>`` value, reported only if the command that is run uses it."""


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Command options that are not agent settings (``-o``, ``--socket``, ``--endpoint``, …)
    take their default from ``TESSERA_<OPTION>`` (``TESSERA_OUTPUT=json``); a flag still wins.
    Agent settings are handled by agent.config with the same naming."""
    settings = {f.name for f in fields(Config)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                apply_env_defaults(sub, environ)
            continue
        if not action.option_strings or action.dest in settings | {"help"}:
            continue
        raw = environ.get("TESSERA_" + action.dest.upper())
        if not raw:
            continue
        var = f"TESSERA_{action.dest.upper()} ({'/'.join(action.option_strings)})"
        convert = action.type or str
        value: Any
        try:
            if isinstance(action, argparse._StoreTrueAction):
                value = raw.strip().lower() in ("1", "true", "yes", "on")
            elif isinstance(action, argparse._AppendAction):
                value = [convert(v) for v in raw.split(",") if v]  # type: ignore[operator]
            else:
                value = convert(raw)  # type: ignore[operator]
        except (TypeError, ValueError) as exc:
            value = EnvError(f"{var}: {raw!r}: {exc}")
        if action.choices is not None and value not in action.choices:
            value = EnvError(f"{var}: {raw!r} is not one of {', '.join(map(str, action.choices))}")
        action.default = value
        action.required = False


def main(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    env = os.environ if environ is None else environ
    parser = build_parser()
    apply_env_defaults(parser, env)
    args = parser.parse_args(argv)
    try:
        for value in vars(args).values():
            if isinstance(value, EnvError):
                raise ConfigError(str(value))
        config = load_config({k: v for k, v in vars(args).items() if k != "command"}, env)
        return COMMANDS[args.command](config, args, out)
    except BrokenPipeError:
        # the reader went away (`tessera ... | head`): stop quietly, like other Unix tools
        devnull = os.open(os.devnull, os.O_WRONLY)
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull, out.fileno())
        return 141
    except DriverNotFoundError:
        err.write(f"tessera: {NO_DRIVER_HINT}\n")
        return EXIT_ERROR
    except ConfigError as exc:
        err.write(f"tessera: configuration error: {exc}\n")
        return EXIT_ERROR
    except TesseraError as exc:
        err.write(f"tessera: error: {exc}\n")
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
