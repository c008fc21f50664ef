"""``make gpu-bundle``: gpu-check for a GPU machine with no package index and little room.

::

    python -m bench.gpu_check.bundle [--out DIR]     (default build/gpu-bundle)

A GPU machine lent for a check may have no network and room for about 64 MiB beside the source
tree; the project's ``.venv`` is about 500 MB. The bundle is a directory of at most
:data:`LIMIT_BYTES` with only the third-party packages gpu-check imports, copied from the
Python that builds it, and a launcher; the Tessera code itself comes from the checkout it sits
in (``build/gpu-bundle``), so it is always the code being checked.

What gpu-check imports (its import graph on ``--simulate``, every process: the check and its
``tessera discover``/``slices``/``doctor`` steps, ``sys.modules`` at exit): the check, discover
and slices need only ``pynvml`` (nvidia-ml-py) and ``yaml`` (PyYAML) beyond the standard library.
``tessera doctor`` also imports the Kubernetes client, grpcio, jsonschema and more (126 MB for
the client alone, its generated models); its result never counts in the check, so the bundle leaves
it out and the step says so.

Only pure Python is copied: PyYAML's compiled libyaml binding (``yaml/_yaml.*.so``) is left out
and PyYAML falls back to its pure-Python loader (gpu-check --simulate dgx-h100: 11.1 s with
libyaml, 11.0 s without, on this project's 2-core machine). So the bundle needs CPython of the
project's ``requires-python`` on any architecture, and nothing compiled for one ABI.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 50 * 1024 * 1024
DISTRIBUTIONS = ("nvidia-ml-py", "PyYAML")
"""pynvml: the NVML calls (the agent's facade and the probe); PyYAML: the simulator's models and
GPU products (gpus.yaml), the twin's reference."""
COMPILED = (".so", ".pyd", ".dylib")
MANIFEST = "bundle.json"

# The launcher: the first Python on PATH (or GPU_BUNDLE_PYTHON) of at least the version the
# project requires; one too old is named with its version. Python versions are asked with a
# statement every Python (2 included) understands.
GPU_CHECK_SCRIPT = """#!/bin/sh
# gpu-check from this bundle (make gpu-bundle; docs/troubleshooting.md, "Without a network").
# Exit codes: 0 no difference, 1 differences, 2 cannot run.
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd) || exit 2
first=
for py in ${{GPU_BUNDLE_PYTHON:-python3 python3.14 python3.13 python3.12 python3.11}}; do
    command -v "$py" >/dev/null 2>&1 || continue
    version=$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)
    [ -n "$version" ] || continue
    major=${{version%%.*}}; rest=${{version#*.}}; minor=${{rest%%.*}}
    if [ "$major" -gt {major} ] || {{ [ "$major" -eq {major} ] && [ "$minor" -ge {minor} ]; }}; then
        exec "$py" -I -S -B "$here/launch.py" "$@"
    fi
    [ -n "$first" ] || first="$py is Python $version"
done
need="this bundle needs CPython >={major}.{minor}"
need="$need (it is pure Python: any {major}.{minor} or later, any architecture)"
echo "gpu-check: cannot run: ${{first:-no Python 3 on PATH}}; $need:" \
    "set GPU_BUNDLE_PYTHON=/path/to/python{major}.{minor} or later" >&2
exit 2
"""

TESSERA_SCRIPT = """#!/bin/sh
# `tessera` from this bundle, with the Python gpu-check runs on (its steps call this).
exec "${GPU_BUNDLE_PYTHON:-python3}" -I -S -B "$(dirname -- "$0")/launch.py" --tessera-cli "$@"
"""


class BundleError(Exception):
    """The bundle cannot be built; the message says why."""


@dataclass(frozen=True)
class Bundle:
    path: Path
    bytes: int
    distributions: dict[str, str]
    left_out: tuple[str, ...]


def minimum_python(pyproject: Path) -> tuple[str, tuple[int, int]]:
    """The project's ``requires-python`` (only ``>=X.Y`` is understood) and (X, Y)."""
    requires = str(tomllib.loads(pyproject.read_text())["project"]["requires-python"])
    found = re.fullmatch(r"\s*>=\s*(\d+)\.(\d+)\s*", requires)
    if found is None:
        raise BundleError(
            f"requires-python in {pyproject} is {requires!r}; the bundle's launcher understands"
            " only '>=X.Y'"
        )
    return requires.strip(), (int(found[1]), int(found[2]))


def copy_distribution(name: str, site: Path) -> tuple[str, list[str]]:
    """Copy the pure-Python files of one installed distribution into ``site``: (its version,
    the files left out)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError as exc:
        raise BundleError(
            f"{name} is not installed in {sys.prefix}: build the bundle with the project's .venv"
        ) from exc
    left_out = []
    for file in dist.files or ():
        parts = file.parts
        if ".." in parts or "__pycache__" in parts or file.suffix == ".pyc":
            continue  # scripts outside site-packages, bytecode of this Python
        if file.suffix in COMPILED or ".so." in file.name:
            left_out.append(f"{file} (compiled for one Python ABI; {name} runs without it)")
            continue
        target = site / file
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(str(file.locate())), target)
    return dist.version, left_out


def size_of(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def self_check(staged: Path) -> None:
    """The staged bundle imports gpu-check and the CLI in an isolated Python."""
    code = (
        "import sys; sys.path[:0] = sys.argv[1:3]; "
        "import bench.gpu_check.check, agent.cli, agent.cli.node_access"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-B", "-c", code, str(staged / "site"), str(SOURCE)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise BundleError(f"the bundle cannot import gpu-check in an isolated Python: {last}")


def build(out: Path) -> Bundle:
    """Build the bundle at ``out`` (replacing an earlier bundle there, nothing else)."""
    if out.exists() and not (out / MANIFEST).is_file():
        raise BundleError(
            f"{out} exists and is not a gpu-check bundle (no {MANIFEST}): not replaced"
        )
    requires, minimum = minimum_python(SOURCE / "pyproject.toml")
    staged = out.with_name(out.name + ".new")
    shutil.rmtree(staged, ignore_errors=True)
    site = staged / "site"
    site.mkdir(parents=True)
    versions, left_out = {}, []
    for name in DISTRIBUTIONS:
        versions[name], skipped = copy_distribution(name, site)
        left_out += skipped
    shutil.copyfile(Path(__file__).with_name("bundle_launch.py"), staged / "launch.py")
    for script, text in (
        ("gpu-check", GPU_CHECK_SCRIPT.format(major=minimum[0], minor=minimum[1])),
        ("tessera", TESSERA_SCRIPT),
    ):
        (staged / script).write_text(text)
        (staged / script).chmod(0o755)
    self_check(staged)
    total = size_of(staged)
    if total > LIMIT_BYTES:
        biggest = sorted(staged.rglob("*"), key=lambda p: p.stat().st_size, reverse=True)[:3]
        raise BundleError(
            f"the bundle is {total / 2**20:.1f} MiB, over the {LIMIT_BYTES / 2**20:.0f} MiB a GPU"
            f" test machine has room for; biggest: {', '.join(str(p) for p in biggest)}"
        )
    manifest = {
        "python": {
            "requires": requires,
            "minimum": list(minimum),
            "builtWith": ".".join(str(v) for v in sys.version_info[:3]),
            "compiled": [],
        },
        "distributions": versions,
        "leftOut": left_out,
        "bytes": total,
    }
    (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staged.rename(out)
    return Bundle(out, total, versions, tuple(left_out))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make gpu-bundle",
        description="Build gpu-check's offline bundle (docs/troubleshooting.md).",
    )
    parser.add_argument("--out", type=Path, default=SOURCE / "build" / "gpu-bundle", metavar="DIR")
    args = parser.parse_args(argv)
    try:
        made = build(args.out)
    except BundleError as exc:
        sys.stderr.write(f"gpu-bundle: {exc}\n")
        return 1
    dists = ", ".join(f"{k} {v}" for k, v in made.distributions.items())
    print(f"gpu-bundle: {made.path}: {made.bytes / 2**20:.1f} MiB ({dists}; pure Python)")
    print(f"  on the GPU machine, in this checkout: make gpu-check, or {made.path}/gpu-check")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
