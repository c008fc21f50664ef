"""Hostile paths, busy ports and unreadable files: every command says what is wrong in one line
on stderr, naming the path or port (and the flag or variable that gave it), and exits with 2 -
never a traceback.

Commands that only read run in this process (``agent.cli.main``); ``run`` and ``sim apiserver``
install signal handlers and logging, so they run as real processes, as a user starts them."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cli import main

TESSERA = os.path.join(os.path.dirname(sys.executable), "tessera")
ROOT = os.geteuid() == 0
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "daemonset"
EXAMPLE, CLASSES = DEPLOY / "examples" / "single-gpu.yaml", DEPLOY / "deviceclasses.yaml"


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A TCP port on 127.0.0.1 that another process (here: this one) already listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def hostile(short_tmp: Path) -> dict[str, str]:
    """Paths that are wrong in every way a user manages."""
    (short_tmp / "file").write_text("not a directory\n")
    (short_tmp / "dir").mkdir()
    (short_tmp / "dir.yaml").mkdir()  # a directory where a file is expected
    (short_tmp / "binary.yaml").write_bytes(b"\xff\xfe\x00\x81 not text")
    (short_tmp / "broken.yaml").write_text("gpus: [\n")
    (short_tmp / "text").write_text("just some words\n")
    locked = short_tmp / "locked.yaml"
    locked.write_text("name: x\n")
    locked.chmod(0)
    (short_tmp / "state" / "sim").mkdir(parents=True)
    (short_tmp / "state" / "sim" / "nvml-state.json").write_text("{}")  # a simulated node's
    return {
        "FILE": str(short_tmp / "file"),
        "UNDER_FILE": str(short_tmp / "file" / "x"),  # a file where a directory is expected
        "DIR": str(short_tmp / "dir"),
        "DIR_YAML": str(short_tmp / "dir.yaml"),
        "BINARY": str(short_tmp / "binary.yaml"),
        "BROKEN": str(short_tmp / "broken.yaml"),
        "TEXT": str(short_tmp / "text"),
        "LOCKED": str(locked),
        "TOO_LONG": str(short_tmp / ("d" * 300) / "x"),  # a directory that cannot be created
        "STATE": str(short_tmp / "state"),
        "FRESH": str(short_tmp / "fresh"),
    }


def fill(argv: list[str], values: dict[str, str]) -> list[str]:
    """The arguments with the capitalized placeholders replaced (longest names first)."""
    out = []
    for arg in argv:
        for key, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
            arg = arg.replace(key, value)
        out.append(arg)
    return out


def assert_one_line(code: int, out: str, err: str, needle: str) -> None:
    assert "Traceback" not in err, err
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.startswith("tessera: "), err
    assert needle in err, err
    assert out == ""


# (argv, what the line must name); values in capitals come from the fixtures
IN_PROCESS = [
    (["discover", "--simulate", "dgx-h100", "--state-dir", "FILE"], "FILE"),
    (["discover", "--simulate", "dgx-h100", "--state-dir", "UNDER_FILE"], "UNDER_FILE"),
    (["discover", "--simulate", "dgx-h100", "--state-dir", "TOO_LONG"], "TOO_LONG"),
    (["topo", "--simulate", "l40s-pcie", "--sysfs-root", "FILE"], "FILE"),
    (["slices", "--simulate", "BINARY"], "BINARY"),
    (["slices", "--simulate", "DIR_YAML"], "DIR_YAML"),
    (["discover", "--simulate", "BROKEN"], "BROKEN"),
    (
        [
            "explain",
            str(EXAMPLE),
            "--class",
            str(CLASSES),
            "--simulate",
            "dgx-a100",
            "--state-dir",
            "UNDER_FILE",
        ],
        "UNDER_FILE",
    ),
    (["top", "--once", "--state-dir", "FILE"], "FILE"),
    (["top", "--once", "--endpoint", "unix://TEXT"], "TEXT"),
    (["top", "--once", "--endpoint", "unix://relative"], "unix://relative"),
    (["kubelet", "info", "--socket", "FILE"], "FILE"),
    (["kubelet", "info", "--socket", "DIR"], "DIR"),
    (["kubelet", "prepare", "--socket", "TOO_LONG", "--claim", "a/b/c"], "TOO_LONG"),
    (["kubelet", "unprepare", "--socket", "UNDER_FILE", "--claim", "a/b/c"], "UNDER_FILE"),
    (["kubelet", "health", "--socket", "TEXT"], "TEXT"),
    (["sim", "fault", "--state-dir", "FILE", "driver-reload"], "FILE"),
    (["sim", "fault", "--state-dir", "TOO_LONG", "gpu-lost", "--gpu", "0"], "TOO_LONG"),
    (["sim", "fault", "--state-dir", "STATE", "--simulate", "BINARY", "driver-reload"], "BINARY"),
]


@pytest.mark.parametrize(("argv", "needle"), IN_PROCESS, ids=[" ".join(a) for a, _ in IN_PROCESS])
def test_read_only_commands_fail_in_one_line(argv, needle, hostile):
    out, err = io.StringIO(), io.StringIO()
    code = main(fill(argv, hostile), {}, out, err)
    assert_one_line(code, out.getvalue(), err.getvalue(), fill([needle], hostile)[0])


@pytest.mark.skipif(ROOT, reason="root reads files whatever their mode")
def test_an_unreadable_model_file_is_one_line(hostile):
    out, err = io.StringIO(), io.StringIO()
    code = main(["discover", "--simulate", hostile["LOCKED"]], {}, out, err)
    assert_one_line(code, out.getvalue(), err.getvalue(), "Permission denied")


def spawn(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    env["PATH"] = os.environ["PATH"]  # and no TESSERA_* from the developer's shell
    return subprocess.run([TESSERA, *argv], capture_output=True, text=True, env=env, timeout=60)


AGENT = ["run", "--simulate", "l40s-pcie", "--metrics-address", "127.0.0.1:0", "--log-level",
         "error", "--no-kube", "--state-dir", "FRESH"]  # fmt: skip
PROCESSES = [
    (["run", "--simulate", "l40s-pcie", "--state-dir", "UNDER_FILE"],
     "--state-dir: cannot create UNDER_FILE: Not a directory"),
    (["run", "--simulate", "l40s-pcie", "--state-dir", "FILE"],
     "--state-dir: FILE is not a directory"),
    (["run", "--simulate", "l40s-pcie", "--state-dir", "TOO_LONG"], "File name too long"),
    (["run", "--simulate", "l40s-pcie", "--state-dir", "FRESH", "--kubeconfig", "TEXT"],
     "TEXT is not a kubeconfig"),
    ([*AGENT, "--kubelet-plugins-dir", "FILE"],
     "FILE/gpu.tessera.dev: Not a directory (from --kubelet-plugins-dir)"),
    ([*AGENT, "--cdi-root", "FILE"], "FILE"),
    ([*AGENT, "--metrics-address", "127.0.0.1:PORT"], "127.0.0.1:PORT"),
    ([*AGENT, "--telemetry-address", "127.0.0.1:PORT"],
     "--telemetry-address: cannot listen on 127.0.0.1:PORT: the address is in use"),
    (["sim", "apiserver", "--port", "PORT", "--kubeconfig-out", "DIR"],
     "port PORT (from --port): Address already in use"),
    (["sim", "apiserver", "--kubeconfig-out", "UNDER_FILE"],
     "FILE: not a directory (a file is in the way) (from --kubeconfig-out)"),
]  # fmt: skip


def _id(argv: list[str]) -> str:
    return " ".join(["run ...", *argv[len(AGENT) :]] if argv[: len(AGENT)] == AGENT else argv)


@pytest.mark.parametrize(("argv", "needle"), PROCESSES, ids=[_id(a) for a, _ in PROCESSES])
def test_commands_that_serve_fail_in_one_line(argv, needle, hostile, busy_port):
    """`run` logs JSON to the end, so its one line is a log record; the others print it."""
    values = {**hostile, "PORT": str(busy_port)}
    p = spawn(fill(argv, values))
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 2, p.stderr
    *before, line = p.stderr.splitlines()
    if argv[0] == "run":
        # every line is JSON, even when gRPC's C core fails a bind (its own log lines are off)
        assert all(isinstance(json.loads(b), dict) for b in before), p.stderr
        record = json.loads(line)
        assert (record["level"], record["msg"]) == ("error", "agent cannot run"), record
        line = record["error"]
    else:
        assert before == [] and line.startswith("tessera: "), p.stderr
    assert fill([needle], values)[0] in line, line


def test_a_path_from_a_variable_is_named_by_the_variable(hostile):
    p = spawn(["run", "--simulate", "l40s-pcie"], TESSERA_STATE_DIR=hostile["UNDER_FILE"])
    assert p.returncode == 2, p.stderr
    error = json.loads(p.stderr.splitlines()[-1])["error"]  # the variable, not the flag
    assert error == f"TESSERA_STATE_DIR: cannot create {hostile['UNDER_FILE']}: Not a directory"
