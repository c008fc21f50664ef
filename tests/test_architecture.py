"""The layers contract names every module: a new module cannot slip past `lint-imports`."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

import agent
import dra_driver

ROOT = Path(__file__).resolve().parents[1]


def contracts() -> dict[str, dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def layered_modules() -> set[str]:
    layers = contracts()["layers"]["layers"]
    assert isinstance(layers, list)
    return {m.strip() for layer in layers for m in layer.replace(":", "|").split("|")}


def test_every_module_of_agent_is_in_a_layer():
    children = {f"agent.{m.name}" for m in pkgutil.iter_modules(agent.__path__)}
    assert children - layered_modules() == set()


def test_the_driver_is_one_layer_and_no_layer_names_a_missing_module():
    named = layered_modules()
    assert "dra_driver" in named
    real = {f"agent.{m.name}" for m in pkgutil.iter_modules(agent.__path__)} | {"dra_driver"}
    assert named - real == set()
    assert {m.name for m in pkgutil.iter_modules(dra_driver.__path__)}  # a real package


def test_the_simulator_contract_covers_every_layer_below_the_composition_root():
    layers = contracts()["layers"]["layers"]
    assert isinstance(layers, list)
    below_sim = layers[layers.index("agent.sim") + 1 :]
    modules = {m.strip() for layer in below_sim for m in layer.replace(":", "|").split("|")}
    assert set(contracts()["simulator"]["source_modules"]) == modules  # type: ignore[arg-type]


def environment_readers(root: Path) -> list[str]:
    """Modules outside the CLI that read the process environment (os.environ, os.getenv)."""
    import ast

    found = []
    for path in sorted([*(root / "agent").rglob("*.py"), *(root / "dra_driver").rglob("*.py")]):
        if (root / "agent" / "cli") in path.parents:
            continue
        text = path.read_text()
        if "environ" not in text and "getenv" not in text:
            continue  # no such attribute without its name in the text: not parsed (most files)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                found.append(str(path.relative_to(root)))
                break
    return found


def test_nothing_below_the_cli_reads_the_environment(tmp_path):
    assert environment_readers(ROOT) == []
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "sneaky.py").write_text("import os\nlevel = os.environ.get('X')\n")
    (tmp_path / "dra_driver").mkdir()
    assert environment_readers(tmp_path) == ["agent/sneaky.py"]  # the check can fail


HEAVY = {
    "kubernetes": "the kubernetes client (0.2 s): only kube mode, doctor's API checks, explain",
    "cel": "the Rust CEL binding with its own CLI (0.3 s): only tessera explain",
    "celpy": "cel-python's parser: only tessera explain",
}


def test_standalone_start_loads_neither_the_kubernetes_client_nor_cel():
    """What every `tessera` command and a `--no-kube` agent import: the heavy libraries load only
    where a mode needs them (each import costs every start, and the kubelet waits on
    registration)."""
    import subprocess
    import sys

    probe = (
        "import sys, agent.cli, agent.daemon, agent.cli.explain;"
        f"print(sorted(m for m in {sorted(HEAVY)!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"loaded at start: {out.stdout.strip()} ({HEAVY})"


MIRRORS = {
    "errors.py": "each layer's own errors (docs/architecture.md, 'Each layer owns its errors')",
    "mig.py": "agent/sim/mig.py: the simulated driver's MIG rules behind agent/nvml/mig.py",
    "node.py": "agent/sim/node.py builds agent/node.py's NodeSource for a model",
    "sysfs.py": "agent/sim/sysfs.py writes the tree agent/discovery/sysfs.py reads",
}
"""Basenames two modules may share: one mirrors the other (the simulator's stand-in for it)."""


def clashing_basenames(root: Path) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for package in ("agent", "dra_driver"):
        for path in sorted((root / package).rglob("*.py")):
            if path.name == "__init__.py" or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            seen.setdefault(path.name, []).append(str(path.relative_to(root)))
    return {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_no_two_modules_share_a_basename_unless_one_mirrors_the_other(tmp_path):
    assert set(clashing_basenames(ROOT)) - set(MIRRORS) == set()
    for name in ("agent/a", "dra_driver/b"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "health.py").write_text("")
    assert clashing_basenames(tmp_path) == {
        "health.py": ["agent/a/health.py", "dra_driver/b/health.py"]
    }  # the check can fail


def test_the_daemon_imports_no_simulator():
    """The CLI chooses the real or the simulated node and hands the composition root what it
    needs: the daemon's own modules load none of the simulator (contract runtime-path)."""
    import subprocess
    import sys

    probe = (
        "import sys, agent.daemon;"
        "print(sorted(m for m in sys.modules if m.startswith('agent.sim')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
