"""Data printed with rich is printed as it is: no emoji codes (``0000:cd:00.0`` is not
``0000💿00.0``) and no markup (``[red]`` in a name is text)."""

from __future__ import annotations

import ast
import functools
import io
import threading
from pathlib import Path

import pytest

from agent.telemetry import top
from agent.telemetry.api import telemetry_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
NODE = "node:ab:[bold]x"


def sample() -> pb.Sample:
    gpu = pb.Gpu(
        index=0,
        name="NVIDIA :cd: [red]GPU[/red]",
        pci_bus_id="0000:cd:00.0",
        healthy=True,
        holders=[pb.Holder(namespace="team:ab:", claim="[b]job", device="gpu-0")],
    )
    return pb.Sample(node=NODE, tick=1, gpus=[gpu])


def test_top_prints_names_verbatim(monkeypatch):
    monkeypatch.setattr(top.TopClient, "snapshot", lambda self: sample())
    out = io.StringIO()
    assert top.run_top("unix:///nowhere.sock", True, 1.0, out, threading.Event()) == 0
    text = out.getvalue()
    assert NODE in text and "NVIDIA :cd: [red]GPU[/red]" in text and "team:ab:/[b]job" in text
    assert "🆎" not in text and "💿" not in text


@functools.cache
def consoles() -> list[tuple[str, ast.Call]]:
    """(file:line, the call) of every rich Console the shipped code makes, in a stable order
    (a file without the word is not parsed: the generated protobuf modules are large)."""
    calls = []
    paths = sorted([*(ROOT / "agent").rglob("*.py"), *(ROOT / "dra_driver").rglob("*.py")])
    for path in paths:
        text = path.read_text()
        if "Console" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Console":
                calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", node))
    return calls


@pytest.mark.parametrize(("where", "call"), [pytest.param(w, c, id=w) for w, c in consoles()])
def test_every_rich_console_has_markup_and_emoji_off(where, call):
    options = {k.arg: k.value for k in call.keywords}
    for option in ("markup", "emoji"):
        value = options.get(option)
        assert isinstance(value, ast.Constant) and value.value is False, f"{where}: {option}"


def test_there_are_consoles_to_check():
    assert {where.split(":")[0] for where, _ in consoles()} >= {
        "agent/discovery/table.py",
        "agent/telemetry/top.py",
    }
