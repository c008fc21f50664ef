"""The Dockerfile's structure, since images cannot be built on these machines: every path it
copies exists, the image runs `tessera run`, it has no NVIDIA files, and the package data the
agent reads at run time is in what it copies.

A small line parser instead of a library (dockerfile-parse): this Dockerfile uses plain
instructions only (no heredocs, no ARG substitution in paths, no parser directives), and the
parser is what is tested here too (a test below feeds it the forms it must understand)."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    """Upper case: FROM, COPY, RUN, ..."""
    args: str
    """Everything after the keyword, continuation lines joined."""

    def words(self) -> list[str]:
        """Exec (JSON array) form as the array, else the arguments split on whitespace."""
        if self.args.startswith("["):
            value = json.loads(self.args)
            assert isinstance(value, list) and all(isinstance(w, str) for w in value)
            return value
        return self.args.split()


def parse(text: str) -> list[Instruction]:
    """Instructions in order: comments and blank lines dropped, a trailing backslash joins the
    next line (comment lines inside a continued instruction are skipped, as Docker does)."""
    out: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, "the last instruction ends with a continuation"
    return out


INSTRUCTIONS = parse(DOCKERFILE.read_text())


def stages() -> list[list[Instruction]]:
    out: list[list[Instruction]] = []
    for ins in INSTRUCTIONS:
        if ins.keyword == "FROM":
            out.append([])
        out[-1].append(ins)
    return out


def copies() -> list[tuple[list[str], str, bool]]:
    """(sources, destination, from another stage) of every COPY/ADD."""
    out = []
    for ins in INSTRUCTIONS:
        if ins.keyword not in ("COPY", "ADD"):
            continue
        words = ins.words()
        flags = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        out.append((paths[:-1], paths[-1], any(f.startswith("--from=") for f in flags)))
    return out


def test_the_parser_reads_the_forms_it_must():
    got = parse(
        '# c\nFROM a AS b\nRUN x \\\n  # inside\n  y\nENTRYPOINT ["tessera"]\nCOPY --from=b /i /j\n'
    )
    assert [(i.keyword, i.words()) for i in got] == [
        ("FROM", ["a", "AS", "b"]),
        ("RUN", ["x", "y"]),
        ("ENTRYPOINT", ["tessera"]),
        ("COPY", ["--from=b", "/i", "/j"]),
    ]


def test_every_copied_path_exists_in_the_repository():
    local = [(srcs, dst) for srcs, dst, other_stage in copies() if not other_stage]
    assert local
    ignored = (
        (ROOT / ".dockerignore").read_text().split() if (ROOT / ".dockerignore").exists() else []
    )
    for srcs, _dst in local:
        for src in srcs:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert not any(fnmatch.fnmatch(src, pat) for pat in ignored), f"{src} is dockerignored"


def test_the_image_runs_tessera_run():
    final = stages()[-1]
    entry = [i for i in final if i.keyword == "ENTRYPOINT"][-1].words()
    cmd = [i for i in final if i.keyword == "CMD"][-1].words()
    assert entry + cmd == ["tessera", "run"]
    # the console script the entrypoint names is what pyproject installs
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tessera"] == "agent.cli:main"


NVIDIA_FILE = re.compile(r"libnvidia|libcuda|nvidia-smi|\.so(\.|\b)", re.IGNORECASE)
NVIDIA_IMAGE = re.compile(r"nvidia|cuda|nvcr\.io", re.IGNORECASE)
NVIDIA_PACKAGE = re.compile(r"\b(nvidia[-\w]*|cuda[-\w]*|libnvidia[-\w]*|libcuda[-\w]*)", re.I)
PYTHON_BINDINGS = "nvidia-ml-py"
"""NVML's Python bindings (ctypes; they load the host's libnvidia-ml.so.1): no NVIDIA file."""


def test_no_nvidia_files_are_in_the_image():
    for ins in INSTRUCTIONS:
        if ins.keyword == "FROM":
            image = ins.words()[0]
            assert not NVIDIA_IMAGE.search(image), f"base image {image}"
        if ins.keyword in ("COPY", "ADD"):
            assert not NVIDIA_FILE.search(ins.args), ins.args
        if ins.keyword == "RUN":
            assert not NVIDIA_PACKAGE.search(ins.args), f"RUN {ins.args}"
    # what `pip install .` brings: the project's dependencies, none an NVIDIA binary wheel
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = re.split(r"[<>=!~ \[;]", dep, maxsplit=1)[0].lower()
        if NVIDIA_PACKAGE.fullmatch(name):
            assert name == PYTHON_BINDINGS, f"{name}: an NVIDIA package in the image"


def test_the_package_data_the_agent_reads_is_copied():
    """pip installs package-data from the copied trees: each pattern matches files under a
    copied directory (the simulator's models and GPU table, the CDI schema)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    copied = {Path(s).parts[0] for srcs, _d, other in copies() if not other for s in srcs}
    assert {"pyproject.toml", "README.md"} <= copied  # the build reads both (readme =)
    for package, patterns in tool["package-data"].items():
        directory = Path(*package.split("."))
        assert directory.parts[0] in copied, f"{package} is not copied"
        for pattern in patterns:
            assert list((ROOT / directory).glob(pattern)), f"{package}: {pattern} matches nothing"
    for include in tool["packages"]["find"]["include"]:
        assert include.rstrip("*") in copied, f"package {include} is not copied"


@pytest.mark.parametrize("stage", range(len(stages())))
def test_every_stage_starts_from_the_python_slim_image(stage):
    image = stages()[stage][0].words()[0]
    assert re.fullmatch(r"python:3\.\d+-slim", image), image
