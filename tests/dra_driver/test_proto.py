"""The generated gRPC modules are current, and the wire contract is the kubelet's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dra_driver.kubeletapi import (
    dra_v1_pb2,
    dra_v1beta1_pb2,
    health_v1alpha1_pb2,
    registration_pb2,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("package", "source"),
    [("dra_driver/kubeletapi", "proto/kubelet"), ("agent/telemetry/api", "proto/telemetry")],
    ids=["kubelet", "telemetry"],
)
def test_generated_modules_are_current(tmp_path, package, source):
    args = [f"{package}/{p.name}" for p in sorted((ROOT / source).glob("*.proto"))]
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{package}={source}",
         f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
         *args],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    fresh = sorted((tmp_path / package).iterdir())
    assert fresh, "protoc produced nothing"
    for f in fresh:
        committed = ROOT / package / f.name
        assert committed.exists(), f"{f.name} missing: run `make proto`"
        assert committed.read_text() == f.read_text(), f"{f.name} is stale: run `make proto`"


def methods(module):
    return {
        f"/{s.full_name}/{m.name}": (
            m.input_type.full_name,
            m.output_type.full_name,
            m.server_streaming,
        )
        for s in module.DESCRIPTOR.services_by_name.values()
        for m in s.methods
    }


def fields(module, message):
    d = module.DESCRIPTOR.message_types_by_name[message]
    return {f.name: (f.number, f.type, f.is_repeated) for f in d.fields}


def test_registration_contract():
    assert methods(registration_pb2) == {
        "/pluginregistration.Registration/GetInfo": (
            "pluginregistration.InfoRequest", "pluginregistration.PluginInfo", False),
        "/pluginregistration.Registration/NotifyRegistrationStatus": (
            "pluginregistration.RegistrationStatus",
            "pluginregistration.RegistrationStatusResponse", False),
    }  # fmt: skip
    f = fields(registration_pb2, "PluginInfo")
    assert {k: v[0] for k, v in f.items()} == {
        "type": 1, "name": 2, "endpoint": 3, "supported_versions": 4,
    }  # fmt: skip
    assert {k: v[0] for k, v in fields(registration_pb2, "RegistrationStatus").items()} == {
        "plugin_registered": 1, "error": 2,
    }  # fmt: skip


@pytest.mark.parametrize("module", [dra_v1_pb2, dra_v1beta1_pb2], ids=["v1", "v1beta1"])
def test_dra_contract(module):
    pkg = module.DESCRIPTOR.package
    assert pkg in ("k8s.io.kubelet.pkg.apis.dra.v1", "k8s.io.kubelet.pkg.apis.dra.v1beta1")
    assert set(methods(module)) == {
        f"/{pkg}.DRAPlugin/NodePrepareResources",
        f"/{pkg}.DRAPlugin/NodeUnprepareResources",
    }
    assert {k: v[0] for k, v in fields(module, "Claim").items()} == {
        "namespace": 1, "uid": 2, "name": 3,
    }  # fmt: skip
    dev = {k: v[0] for k, v in fields(module, "Device").items()}
    expected = {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4}
    if module is dra_v1_pb2:
        expected["share_id"] = 5
    assert dev == expected
    assert {k: v[0] for k, v in fields(module, "NodePrepareResourceResponse").items()} == {
        "devices": 1, "error": 2,
    }  # fmt: skip
    assert {k: v[0] for k, v in fields(module, "NodeUnprepareResourceResponse").items()} == {
        "error": 1,
    }  # fmt: skip
    resp = module.DESCRIPTOR.message_types_by_name["NodePrepareResourcesResponse"]
    assert resp.fields_by_name["claims"].message_type.GetOptions().map_entry


def test_health_contract():
    assert methods(health_v1alpha1_pb2) == {
        "/v1alpha1.DRAResourceHealth/NodeWatchResources": (
            "v1alpha1.NodeWatchResourcesRequest", "v1alpha1.NodeWatchResourcesResponse", True),
    }  # fmt: skip
    assert dict(health_v1alpha1_pb2.HealthStatus.items()) == {
        "UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2,
    }  # fmt: skip
    assert {k: v[0] for k, v in fields(health_v1alpha1_pb2, "DeviceHealth").items()} == {
        "device": 1, "health": 2, "last_updated_time": 3, "health_check_timeout_seconds": 4,
    }  # fmt: skip


def test_bytes_match_the_kubelet_encoding():
    """A hand-encoded v1 Claim (what a kubelet sends) decodes to the right fields."""
    wire = b"\x0a\x07default" + b"\x12\x03uid" + b"\x1a\x04name"
    claim = dra_v1_pb2.Claim.FromString(wire)
    assert (claim.namespace, claim.uid, claim.name) == ("default", "uid", "name")
