"""Corrupt state files never stop a start: each is moved aside (never overwritten), reported, and
the agent starts."""

from __future__ import annotations

import pytest

from tests.integration.daemon import Daemon

CHECKPOINTS = {
    "nested-100000-deep": "[" * 100_000 + "]" * 100_000,
    "nested-70-deep": '{"version": 1, "x": ' + "[" * 70 + "]" * 70 + "}",
    "5000-digit-integer": '{"version": ' + "9" * 5000 + "}",
    "not-utf8": "\udcff\udcfe",
    "wrong-types": '{"apiVersion": "tessera.dev/v1", "kind": "Checkpoint", "version": 1,'
    ' "claims": [1], "bootID": 7, "checksum": "sha256:0"}',
    "empty": "",
}


@pytest.mark.parametrize("content", CHECKPOINTS.values(), ids=CHECKPOINTS.keys())
def test_a_corrupt_checkpoint_is_moved_aside_and_the_agent_starts(short_tmp, content):
    path = short_tmp / "checkpoint.json"
    path.write_bytes(content.encode(errors="surrogateescape"))
    d = Daemon(short_tmp, "l40s-pcie").start()
    try:
        rec = d.wait_log("checkpoint is corrupt; moved it aside and starting empty")
        (moved,) = short_tmp.glob("checkpoint.json.corrupt-*")
        assert moved.read_bytes() == content.encode(errors="surrogateescape")  # kept as it was
        assert rec["moved_to"] == str(moved) and rec["reason"]
    finally:
        d.kill()


ENERGY = {
    "claims-of-numbers": '{"kind": "TesseraEnergyState", "version": 1, "gpus": {}, "claims": [1]}',
    "gpus-a-list": '{"kind": "TesseraEnergyState", "version": 1, "gpus": [], "claims": []}',
    "gpu-a-number": '{"kind": "TesseraEnergyState", "version": 1, "gpus": {"GPU-x": 3},'
    ' "claims": []}',
    "5000-digit-integer": '{"kind": "TesseraEnergyState", "version": ' + "9" * 5000 + "}",
    "nested-deep": "[" * 50_000,
}


@pytest.mark.parametrize("content", ENERGY.values(), ids=ENERGY.keys())
def test_a_corrupt_energy_file_is_moved_aside_and_the_agent_starts(short_tmp, content):
    (short_tmp / "energy.json").write_text(content)
    d = Daemon(short_tmp, "l40s-pcie").start()
    try:
        d.wait_log("energy state file is corrupt; moved aside, counters start from zero")
        (moved,) = short_tmp.glob("energy.json.corrupt-*")
        assert moved.read_text() == content
    finally:
        d.kill()


SLICES = {
    "not-yaml": "kind: [unclosed\n",
    "alias-bomb": 'a: &a ["x","x"]\nb: [*a, *a]\n',
    "slice-without-pool": "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\n"
    "metadata: {name: s}\nspec: {driver: gpu.tessera.dev}\n",
    "two-documents": "a: 1\n---\nb: 2\n",
}


@pytest.mark.parametrize("content", SLICES.values(), ids=SLICES.keys())
def test_a_broken_standalone_slice_file_is_moved_aside_and_publishing_goes_on(short_tmp, content):
    slices = short_tmp / "resourceslices"
    slices.mkdir()
    (slices / "l40s-pcie-broken.yaml").write_text(content)
    d = Daemon(short_tmp, "l40s-pcie").start()
    try:
        d.wait_log("a standalone ResourceSlice file is broken; moved aside")
        d.wait_log("published ResourceSlices")
        (moved,) = slices.glob("l40s-pcie-broken.yaml.corrupt-*")
        assert moved.read_text() == content
        assert len(list(slices.glob("*.yaml"))) >= 1  # the agent's own slices are written
    finally:
        d.kill()
