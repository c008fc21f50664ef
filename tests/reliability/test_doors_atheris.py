"""`make reliability`: atheris fuzzes the claim-file door, guided by coverage
(``tests/reliability/atheris_claims.py``), from a corpus of valid claims; no input may raise
anything but the door's own errors. Skipped where atheris is not installed (it is an optional
test dependency: wheels for CPython 3.11 to 3.13 on x86-64 Linux)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.daemon import claim_manifest
from tests.reliability.doors import RERUN
from tests.reliability.report import add
from tests.test_fuzz_decoders import VALID_CLAIM, VALID_CONFIGS

ROOT = Path(__file__).resolve().parents[2]
RUNS = 100_000

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed"),
]


def corpus(directory: Path) -> Path:
    """Valid claims to start from: allocated on the DGX H100's GPUs, with every kind of config."""
    directory.mkdir()
    seeds = [VALID_CLAIM]
    for i, config in enumerate(VALID_CONFIGS):
        claim = claim_manifest(f"c{i}", "uid-c", [("gpu", f"gpu-{i}")], "dgx-h100")
        claim["status"]["allocation"]["devices"]["config"] = [
            {"source": "FromClaim", "opaque": {"driver": "gpu.tessera.dev", "parameters": config}}
        ]
        seeds.append(claim)
    for i, seed in enumerate(seeds):
        (directory / f"seed-{i}.yaml").write_text(yaml.safe_dump(seed))
    return directory


@pytest.mark.timeout(1800)
def test_atheris_finds_no_input_the_claim_file_door_does_not_handle(tmp_path):
    found = subprocess.run(
        [sys.executable, "-m", "tests.reliability.atheris_claims", f"-runs={RUNS}",
         "-max_len=4096", "-timeout=30", f"-artifact_prefix={tmp_path}/",
         str(corpus(tmp_path / "corpus"))],
        cwd=ROOT, capture_output=True, text=True, timeout=1700,
    )  # fmt: skip
    output = found.stdout + found.stderr
    assert found.returncode == 0, output[-5000:]
    done = re.search(r"Done (\d+) runs", output)
    assert done is not None, output[-2000:]
    coverage = re.findall(r"cov: (\d+)", output)
    add(
        "bad-input",
        cases=int(done.group(1)),
        details={
            "atheris_claim_file_cases_total": int(done.group(1)),
            "atheris_coverage_edges": int(coverage[-1]) if coverage else 0,
        },
        rerun=RERUN,
    )
