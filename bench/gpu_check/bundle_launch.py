"""The gpu-check bundle's launcher (``make gpu-bundle`` copies it into the bundle as
``launch.py``; docs/troubleshooting.md, "Without a network").

The bundle's ``gpu-check`` script runs it as ``python -I -S launch.py [ARGS]``: an isolated
Python (no ``PYTHON*`` variables, no site-packages), so only the bundle's ``site/`` directory and
the Tessera source tree are on ``sys.path``. It checks the Python, then runs
``bench.gpu_check.check.main`` with the bundle's own ``tessera`` for the steps; ``--tessera-cli
ARGS`` runs the ``tessera`` command instead (the bundle's ``tessera`` script).

Exit codes are gpu-check's: 0 no difference, 1 differences, 2 cannot run (here also: a Python
this bundle does not fit, no source tree, a module the bundle lacks).

Only the standard library, and no syntax newer than Python 3.7, so that an old Python run on it
directly reaches the version check and says what it needs instead of failing to parse this file.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
CANNOT_RUN = 2
NOT_BUNDLED = "not in the gpu-check bundle"
"""Printed when a ``tessera`` command needs a module the bundle leaves out (the doctor step
recognizes it and is skipped)."""


def python_problem(
    version: Sequence[int], implementation: str, minimum: Sequence[int]
) -> str | None:
    """Why this Python cannot run the bundle, or None."""
    if implementation == "cpython" and tuple(version[:2]) >= tuple(minimum[:2]):
        return None
    shown = ".".join(str(part) for part in version[:3])
    need = ".".join(str(part) for part in minimum[:2])
    return f"Python {shown} ({implementation}); this bundle needs CPython >={need}"


def source_problem(source: str) -> str | None:
    """Why ``source`` is not a Tessera source tree, or None."""
    for part in ("agent/cli/__init__.py", "dra_driver/__init__.py", "bench/gpu_check/check.py"):
        if not os.path.isfile(os.path.join(source, part)):
            return (
                f"no Tessera source tree at {source} (it lacks {part}): the bundle belongs in"
                " build/gpu-bundle of a checkout, or GPU_BUNDLE_SOURCE names the checkout"
            )
    return None


def _gpu_check(argv: list[str]) -> int:
    from bench.gpu_check.check import main

    given = any(a == "--tessera" or a.startswith("--tessera=") for a in argv)
    return main(argv if given else [*argv, "--tessera", os.path.join(HERE, "tessera")])


def _tessera(argv: list[str]) -> int:
    try:
        from agent.cli import main
    except ModuleNotFoundError as exc:
        sys.stderr.write(f"tessera: {NOT_BUNDLED}: the CLI needs {exc.name}\n")
        return CANNOT_RUN
    try:
        return main(argv)
    except ModuleNotFoundError as exc:
        # e.g. `tessera doctor` imports the Kubernetes client, left out of the bundle (its
        # size); the bundle carries what gpu-check and its counted steps import
        sys.stderr.write(
            f"tessera: {' '.join(argv[:1])}: {NOT_BUNDLED}: it needs {exc.name}"
            " (run it from the project's .venv)\n"
        )
        return CANNOT_RUN


def main(argv: list[str]) -> int:
    with open(os.path.join(HERE, "bundle.json")) as f:
        manifest = json.load(f)
    version = (sys.version_info.major, sys.version_info.minor, sys.version_info.micro)
    problem = python_problem(version, sys.implementation.name, manifest["python"]["minimum"])
    if problem is not None:
        sys.stderr.write(f"gpu-check: cannot run: {sys.executable} is {problem}\n")
        return CANNOT_RUN
    source = os.path.abspath(
        os.environ.get("GPU_BUNDLE_SOURCE") or os.path.dirname(os.path.dirname(HERE))
    )
    problem = source_problem(source)
    if problem is not None:
        sys.stderr.write(f"gpu-check: cannot run: {problem}\n")
        return CANNOT_RUN
    sys.path[:0] = [os.path.join(HERE, "site"), source]
    # the bundle's `tessera` script runs the steps with this same Python
    os.environ["GPU_BUNDLE_PYTHON"] = sys.executable
    os.environ["GPU_BUNDLE_SOURCE"] = source
    if argv[:1] == ["--tessera-cli"]:
        return _tessera(argv[1:])
    return _gpu_check(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
