"""`tessera explain --kubeconfig` models the scheduler of the API server's own version, read from
its `/version` over HTTP (the emulator reports the version a test gives it): a DGX A100's
dynamic-MIG slices in the 1.34 layout fit under a 1.34 server and lose their devices under a
1.35 one; a newer server is modelled as the newest version, saying so; an older one is refused."""

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli import main
from agent.cli.node_commands import published_slices
from agent.config import Config
from agent.sim.apiserver import ApiServer

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ROOT / "deploy" / "daemonset" / "deviceclasses.yaml"
NODE = "node-a100"
ONE_G = (
    'device.attributes["gpu.tessera.dev"].minor == 0'
    ' && device.attributes["gpu.tessera.dev"].profile.startsWith("1g")'
)


def gpu0_1g_claim(count: int) -> dict[str, Any]:
    """A claim of ``count`` 1g MIG devices of GPU 0 (also the CLI tests' claim)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "migs", "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "m",
                        "exactly": {
                            "deviceClassName": "mig.gpu.tessera.dev",
                            "count": count,
                            "selectors": [{"cel": {"expression": ONE_G}}],
                        },
                    }
                ]
            }
        },
    }


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[ApiServer, Path]]:
    """An API server reporting ``request.param`` (server version, slice layout) with one DGX
    A100 node whose dynamic-MIG slices are published in that layout."""
    version, layout = request.param
    with ApiServer(kube_version=version) as server:
        server.put_object("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        config = Config.of(
            simulate="dgx-a100", mig_mode="dynamic", kube_layout=layout, node_name=NODE
        )
        for s in published_slices(config):
            server.put_object("resourceslices", s)
        for c in yaml.safe_load_all(CLASSES.read_text()):
            server.put_object("deviceclasses", c)
        assert server.rejected == []
        yield server, server.kubeconfig(tmp_path / "kubeconfig")


def explain(
    kubeconfig: Path, claim_file: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    argv = ["explain", str(claim_file), "--kubeconfig", str(kubeconfig), *extra]
    code = main(argv, env or {}, out, err)
    return code, out.getvalue(), err.getvalue()


def claim_file(tmp_path: Path, count: int) -> Path:
    path = tmp_path / "claim.yaml"
    path.write_text(yaml.safe_dump(gpu0_1g_claim(count)))
    return path


@pytest.mark.parametrize(
    ("cluster", "count", "fits", "modelled", "says"),
    [
        # 1.34 checkAvailableCounters: the slice's own counter sets, enforced
        (("1.34.2", "1.34"), 7, True, "1.34", None),
        (("1.34.2", "1.34"), 8, False, "1.34", "counter gpu-0-counter-set/memory-slice"),
        # 1.35 buildPool: a slice holding sharedCounters is read for its counters only
        (("1.35.0", "1.34"), 1, False, "1.35", "devices are ignored: it holds sharedCounters"),
        (("1.35.0", "1.35"), 7, True, "1.35", None),
        # a 1.34 scheduler enforces no counters on the 1.35 layout
        (("1.34.2", "1.35"), 8, True, "1.34", None),
    ],
    indirect=["cluster"],
)
def test_the_api_servers_version_is_the_one_modelled(
    cluster: tuple[ApiServer, Path],
    tmp_path: Path,
    count: int,
    fits: bool,
    modelled: str,
    says: str | None,
) -> None:
    server, kubeconfig = cluster
    code, out, err = explain(kubeconfig, claim_file(tmp_path, count), "-o", "json")
    assert code == (0 if fits else 1), err
    answer = json.loads(out)
    assert answer["scheduler"]["kubernetesVersion"] == modelled
    (node,) = answer["nodes"]
    assert node["node"] == NODE and node["fits"] is fits
    if says:
        assert says in node["claims"][0]["explanation"]["reason"] or any(
            says in line for line in node["claims"][0]["explanation"]["ignored"]
        )
    assert ("GET", "/version", 200) in [(r.method, r.path, r.status) for r in server.requests]


@pytest.mark.parametrize("cluster", [("1.35.0", "1.34")], indirect=True)
def test_kube_version_overrides_the_api_servers(
    cluster: tuple[ApiServer, Path], tmp_path: Path
) -> None:
    _, kubeconfig = cluster
    claim = claim_file(tmp_path, 7)
    code, out, err = explain(kubeconfig, claim, env={"TESSERA_KUBE_VERSION": "1.34"})
    assert code == 0, err
    assert "modelled: Kubernetes 1.34 scheduler" in out


@pytest.mark.parametrize("cluster", [("1.36.1", "1.35")], indirect=True)
def test_a_newer_server_is_modelled_as_the_newest_saying_so(
    cluster: tuple[ApiServer, Path], tmp_path: Path
) -> None:
    _, kubeconfig = cluster
    code, out, err = explain(kubeconfig, claim_file(tmp_path, 7))
    assert code == 0, err
    assert "modelled: Kubernetes 1.35 scheduler" in out
    assert (
        "note: the API server runs Kubernetes 1.36: Kubernetes 1.36 is newer than the newest"
        " version explain models: modelled as 1.35" in out
    )


@pytest.mark.parametrize("cluster", [("1.33.4", "1.34")], indirect=True)
def test_an_older_server_is_refused_naming_its_version(
    cluster: tuple[ApiServer, Path], tmp_path: Path
) -> None:
    _, kubeconfig = cluster
    code, out, err = explain(kubeconfig, claim_file(tmp_path, 1))
    assert code == 2 and out == ""
    assert (
        "the API server runs Kubernetes 1.33, which explain does not model: it models 1.34,"
        " 1.35 (a newer one is modelled as 1.35); pass --kube-version to model one of them"
    ) in err
