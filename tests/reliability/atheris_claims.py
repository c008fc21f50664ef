"""Coverage-guided fuzzing of the claim-file door with atheris (libFuzzer for Python).

``python -m tests.reliability.atheris_claims -runs=N [corpus ...]`` feeds bytes, mutated to
reach new code of ``dra_driver`` and ``agent.decode``, through what a standalone claim file
goes through: decoded as the directory source decodes a file (UTF-8, YAML with limits), each
document parsed against a kubelet's request (``parse_allocation``) and planned on a simulated
DGX H100 in every sharing mode (``plan_claim``). Only ClaimError and ParamsError may come out;
anything else is a crash: atheris prints it and exits non-zero. ``make reliability`` runs it
from ``test_doors_atheris.py``; atheris is an optional test dependency (wheels for CPython
3.11 to 3.13 on x86-64 Linux).
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["dra_driver", "agent.decode"]):
    from dra_driver.errors import ClaimError, ParamsError
    from dra_driver.kubeletplugin.claim_sources import DirClaimSource
    from dra_driver.kubeletplugin.claims import ClaimKey, parse_allocation
    from dra_driver.kubeletplugin.plan import SharingPolicy, plan_claim

from tests.reliability.claim_strategies import DRIVER, device_model

MODEL = "dgx-h100"
KEY = ClaimKey("default", "c", "uid-c")
POLICIES = [
    SharingPolicy(),
    SharingPolicy(mode="time-slicing"),
    SharingPolicy(mode="memory-shares"),
]


def one_input(data: bytes) -> None:
    docs = DirClaimSource._decode(Path("fuzz.yaml"), data)
    if isinstance(docs, str):
        return  # refused as a claim file is: not UTF-8, not YAML, over the limits
    for doc in docs:
        for policy in POLICIES:
            try:
                allocation = parse_allocation(doc, KEY, DRIVER, MODEL)
                plan_claim(allocation, device_model(MODEL), policy)
            except (ClaimError, ParamsError):
                pass


def main() -> None:
    device_model(MODEL)  # built before fuzzing, not on its first input
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
