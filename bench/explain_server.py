"""``python -m bench.explain_server NODES KUBECONFIG``: the API-server emulator holding NODES
simulated dgx-a100 nodes in dynamic MIG mode (their Nodes, ResourceSlices and the deploy's
DeviceClasses), in a process of its own.

The benchmark of ``tessera explain --kubeconfig`` (bench/explain.py) runs the emulator here so
that it does not share the client's interpreter (the GIL) or memory: a real API server is
another machine. Prints ``ready`` once it serves, prints its CPU seconds (user + system) so far
on each line read from stdin, and stops at end of input.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import orjson
import yaml

from agent.sim.apiserver import ApiServer
from bench.common import simulated_inventory
from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.device_model import DevicePolicy, advertised_devices

DRIVER = "gpu.tessera.dev"
ROOT = Path(__file__).resolve().parents[1]
CLASSES = ROOT / "deploy" / "daemonset" / "deviceclasses.yaml"


def template() -> list[dict[str, Any]]:
    """One dgx-a100 node's slices in dynamic MIG mode (named for node ``a100``)."""
    with simulated_inventory("dgx-a100") as inv:
        model = advertised_devices(inv, DevicePolicy(driver_name=DRIVER, mig_mode="dynamic"))
    return build_slices(model, SlicePolicy(driver_name=DRIVER, node_name="a100"), 1)


def node_name(i: int, nodes: int) -> str:
    return f"a100-{i:0{max(2, len(str(nodes - 1)))}d}"


def node_slices(first: list[dict[str, Any]], node: str) -> list[dict[str, Any]]:
    """``first`` copied to ``node``: its own slice names, pool and node name, and its own GPUs
    (every uuid and parentUUID differs, as on a real cluster)."""
    slices: list[dict[str, Any]] = orjson.loads(orjson.dumps(first))  # a deep copy, fast
    for s in slices:
        s["metadata"]["name"] = f"{node}-{s['metadata']['name']}"
        s["spec"]["nodeName"] = node
        s["spec"]["pool"]["name"] = node
        for d in s["spec"].get("devices", []):
            for name in ("uuid", "parentUUID"):
                if name in d["attributes"]:
                    d["attributes"][name]["string"] += f"-{node}"
    return slices


def load(server: ApiServer, nodes: int) -> int:
    """Put ``nodes`` nodes, their slices and the DeviceClasses; the number of devices."""
    first = template()
    devices = 0
    for i in range(nodes):
        node = node_name(i, nodes)
        server.put_object("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        for s in node_slices(first, node):
            devices += len(s["spec"].get("devices", []))
            server.put_object("resourceslices", s)
    for c in yaml.safe_load_all(CLASSES.read_text()):
        if c:
            server.put_object("deviceclasses", c)
    return devices


def main(argv: list[str]) -> int:
    nodes, kubeconfig = int(argv[0]), Path(argv[1])
    with ApiServer() as server:
        devices = load(server, nodes)
        server.kubeconfig(kubeconfig)
        print(f"ready {devices}", flush=True)
        for _ in sys.stdin:
            t = os.times()
            print(f"{t.user + t.system:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
