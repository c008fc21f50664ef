"""The 10,000-node model on paper, checked by simulation: for each simulated node model and
mode, the real ResourceSlices Tessera publishes (its publisher against the API-server emulator
over real HTTP) and NVIDIA's layout for the same node (``bench/nvidia_layout.py``), one node's
bytes and writes measured, then multiplied by 10,000 (``bench/scale_math.py``):

- etcd bytes: the pool as the emulator stores it (server metadata included) plus the
  managedFields the real API server adds, times the nodes, against etcd's 2 GiB default quota;
- the watch traffic of one device change (one GPU gone: the slices rewritten, their bytes,
  to the scheduler, the controller manager and the node's own watch) and of a restart (a new
  publisher with the same devices: the writes it makes, measured, not assumed);
- API writes per minute: steady state and with one device change per node per hour. One real
  ``tessera run`` (dgx-a100, dynamic MIG) is counted at the emulator (``bench/scale_daemon.py``):
  start, steady window, stop, restart; the steady writes per node are then multiplied. NVIDIA's
  kubelet plugin writes only slices (no periodic writer in cmd/gpu-kubelet-plugin): 0 steady.

The table's rows: dgx-a100 dynamic MIG at 10,000 nodes under the quota, and its ratio to
NVIDIA's layout for the same node (the floor)."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Any

from agent.cli.node_commands import advertised
from agent.config import Config
from agent.discovery.inventory import NodeInventory
from agent.sim.apiserver import ApiServer
from agent.sim.model import all_model_names, vm_model_names
from bench.common import pool_bytes, report, simulated_inventory
from bench.nvidia_layout import NVIDIA_COMMIT, nvidia_slices, slice_specs, tainted
from bench.scale_daemon import DaemonWrites, measure
from bench.scale_math import (
    ETCD_QUOTA,
    GIB,
    KUBELET_LEASE_WRITES_PER_MIN,
    NODES,
    NodeFigures,
    cluster,
    compact,
    nvidia_sync,
    protobuf_bytes,
    with_managed_fields,
)
from bench.table import Figure, below, measured, ratio_at_most
from dra_driver.advertise.publisher import Publisher
from dra_driver.advertise.slice_stores import KubeSliceStore
from dra_driver.advertise.slices import SlicePolicy
from dra_driver.advertise.taints import UnhealthyGpu, with_health
from dra_driver.cluster.kube import KubeClient
from dra_driver.device_model import DeviceModel

NAME = "scale_model"
DRIVER, NODE = "gpu.tessera.dev", "bench-node"
INTERVAL, WINDOW = 2.0, 20.0
QUICK_INTERVAL, QUICK_WINDOW = 1.0, 4.0
QUICK_MODELS, QUICK_MODES = ("dgx-a100",), ("dynamic MIG",)
FLAGS: dict[str, dict[str, str]] = {
    "static": {},
    "dynamic MIG": {"mig_mode": "dynamic"},
    "time-slicing": {"sharing": "time-slicing"},
    "memory-shares": {"sharing": "memory-shares"},
    "passthrough": {"virtualization": "passthrough"},
    "vgpu": {"virtualization": "vgpu"},
}
NVIDIA_MODE = {
    "static": "gpu",
    "dynamic MIG": "dynamic-mig",
    "time-slicing": "gpu",  # NVIDIA's sharing is claim configuration: the slices do not change
    "memory-shares": "gpu",
    "passthrough": "passthrough",
}
Obj = dict[str, Any]


def without_gpu(model: DeviceModel, minor: int) -> DeviceModel:
    """The device model with one GPU (its devices and counter set) gone."""
    return DeviceModel(
        devices=tuple(d for d in model.devices if d.gpu_minor != minor),
        counter_sets=tuple(c for c in model.counter_sets if c.name != f"gpu-{minor}-counter-set"),
    )


def _publisher(server: ApiServer, kube: KubeClient, uid: str) -> Publisher:
    log = logging.getLogger("bench.scale_model")
    log.addHandler(logging.NullHandler())
    log.propagate = False
    policy = SlicePolicy(driver_name=DRIVER, node_name=NODE, node_uid=uid)
    return Publisher(KubeSliceStore(kube, DRIVER, NODE), policy, log)


def _rewritten(server: ApiServer, before: dict[str, str]) -> list[Obj]:
    """The stored slices created or updated since ``before`` (name -> resourceVersion)."""
    return [
        o
        for o in server.objects("resourceslices")
        if before.get(o["metadata"]["name"]) != o["metadata"]["resourceVersion"]
    ]


def _versions(server: ApiServer) -> dict[str, str]:
    return {
        o["metadata"]["name"]: o["metadata"]["resourceVersion"]
        for o in server.objects("resourceslices")
    }


def tessera_node(model: DeviceModel) -> tuple[NodeFigures, int, int]:
    """Tessera's figures for one node: its publisher against the emulator over real HTTP (first
    publish, a restart with the same devices, then the last GPU gone); also the bytes it sent
    and its slice count."""
    with ApiServer() as server, tempfile.TemporaryDirectory() as tmp:
        uid = server.put_object("nodes", {"metadata": {"name": NODE}})["metadata"]["uid"]
        kube = KubeClient.from_config(server.kubeconfig(Path(tmp)))
        try:
            first = _publisher(server, kube, uid)
            first.set_devices(model)
            first.step(0.0)
            stored = server.objects("resourceslices")
            sent = pool_bytes([{**o, "metadata": _sent_meta(o)} for o in stored])
            server.clear_log()
            before = _versions(server)
            again = _publisher(server, kube, uid)  # a new process: nothing remembered
            again.set_devices(model)
            again.step(0.0)
            restart_writes = server.writes("resourceslices")
            restart = _rewritten(server, before)
            server.clear_log()
            before = _versions(server)
            gone = max(d.gpu_minor for d in model.devices)
            again.set_devices(without_gpu(model, gone))
            again.step(1.0)
            change_writes = server.writes("resourceslices")
            change = _rewritten(server, before)
            again.set_devices(model)
            again.step(2.0)
            server.clear_log()
            before = _versions(server)
            again.set_devices(with_health(model, _unhealthy(model, gone), **TAINTS))
            again.step(3.0)
            taint_writes = server.writes("resourceslices")
            taint = _rewritten(server, before)
        finally:
            kube.close()
    full = [with_managed_fields(o, "tessera") for o in stored]
    figures = NodeFigures(
        stored_bytes=pool_bytes(full),
        stored_protobuf=sum(protobuf_bytes(o) for o in full),
        change_writes=change_writes,
        change_bytes=pool_bytes([with_managed_fields(o, "tessera") for o in change]),
        restart_writes=restart_writes,
        restart_bytes=pool_bytes([with_managed_fields(o, "tessera") for o in restart]),
        taint_writes=taint_writes,
        taint_bytes=pool_bytes([with_managed_fields(o, "tessera") for o in taint]),
    )
    return figures, sent, len(stored)


TAINTS: dict[str, Any] = {"taints": True, "driver_name": DRIVER}


def _unhealthy(model: DeviceModel, minor: int) -> dict[str, UnhealthyGpu]:
    uuid = next(d.parent_uuid for d in model.devices if d.gpu_minor == minor)
    return {uuid: UnhealthyGpu(uuid, "xid-79", since=1_767_225_600.0)}


def _sent_meta(stored: Obj) -> Obj:
    """The metadata our publisher sends (the stored one less what the server set)."""
    server_set = ("uid", "resourceVersion", "creationTimestamp", "generation")
    return {k: v for k, v in stored["metadata"].items() if k not in server_set}


def _stored(objs: list[Obj]) -> list[Obj]:
    """``objs`` as the emulator stores them (named from generateName, stamped), managedFields
    added."""
    server = ApiServer()  # not started: only its store
    return [
        with_managed_fields(server.put_object("resourceslices", o), "gpu-kubelet-plugin")
        for o in objs
    ]


def _named(objs: list[Obj], specs: list[Obj]) -> list[Obj]:
    """``objs`` with their contents replaced by ``specs`` (same order)."""
    return [{**o, "spec": {**o["spec"], **s}} for o, s in zip(objs, specs, strict=True)]


def nvidia_node(inv: NodeInventory, mode: str) -> tuple[NodeFigures, int, int, int]:
    """NVIDIA's figures for the same node: its slices stored by the emulator; a restart and a
    change by its controller's rules (:func:`bench.scale_math.nvidia_sync`)."""
    built = nvidia_slices(inv, mode, NODE, "node-uid")
    stored = _stored(built)
    gone = max(g.device.minor for g in inv.gpus)
    fewer = dataclasses.replace(inv, gpus=tuple(g for g in inv.gpus if g.device.minor != gone))
    old, new = slice_specs(inv, mode), slice_specs(fewer, mode)
    change = nvidia_sync(old, new)
    after = _stored(nvidia_slices(fewer, mode, NODE, "node-uid", generation=2))
    restart = nvidia_sync(old, old)
    taint = nvidia_sync(old, tainted(old, gone))
    marked = _stored(_named(built, tainted(old, gone)))
    figures = NodeFigures(
        stored_bytes=pool_bytes(stored),
        stored_protobuf=sum(protobuf_bytes(o) for o in stored),
        change_writes=change.writes,
        change_bytes=sum(compact(after[i]) for i in change.written),
        restart_writes=restart.writes,
        restart_bytes=0,
        taint_writes=taint.writes,
        taint_bytes=sum(compact(marked[i]) for i in taint.written),
    )
    devices = sum(len(s["spec"].get("devices", [])) for s in built)
    return figures, pool_bytes(built), len(built), devices


def modes_of(model: str) -> list[str]:
    with simulated_inventory(model) as inv:
        mig = any(g.device.mig_capable and g.device.mig_profiles for g in inv.gpus)
    names = ["static", *(["dynamic MIG"] if mig else []), "time-slicing", "memory-shares"]
    return names + (["passthrough", "vgpu"] if model in vm_model_names() else [])


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB"


def run(quick: bool) -> list[Figure]:
    interval, window = (QUICK_INTERVAL, QUICK_WINDOW) if quick else (INTERVAL, WINDOW)
    daemon = measure(interval, window)
    steady = daemon.steady_per_interval()
    rows: list[tuple[str, str]] = []
    data: dict[str, Any] = {"nodes": NODES, "daemon": dataclasses.asdict(daemon), "layouts": []}
    key: dict[str, NodeFigures] = {}
    for model in QUICK_MODELS if quick else all_model_names():
        base: DeviceModel | None = None
        with simulated_inventory(model) as inv:
            for mode in QUICK_MODES if quick else modes_of(model):
                _, dm = advertised(Config.of(simulate=model, **FLAGS[mode]))
                if mode in ("time-slicing", "memory-shares") and dm == base:
                    continue  # the same devices as without sharing: nothing new to say
                base = base or dm
                tess, sent, count = tessera_node(dm)
                entry = _entry(model, mode, "tessera", tess, sent, count, len(dm.devices), steady)
                data["layouts"].append(entry)
                rows.append(_row(entry))
                key[f"{model}/{mode}/tessera"] = tess
                if mode in NVIDIA_MODE:
                    nv, nv_sent, nv_count, devices = nvidia_node(inv, NVIDIA_MODE[mode])
                    entry = _entry(model, mode, "nvidia", nv, nv_sent, nv_count, devices, 0.0)
                    data["layouts"].append(entry)
                    rows.append(_row(entry))
                    key[f"{model}/{mode}/nvidia"] = nv
    ours, theirs = key["dgx-a100/dynamic MIG/tessera"], key["dgx-a100/dynamic MIG/nvidia"]
    etcd = ours.stored_bytes * NODES
    rows += _daemon_rows(daemon, steady)
    figures = [
        measured(NAME, f"etcd bytes, {NODES:,} dgx-a100 nodes, dynamic MIG (+ managedFields)",
                 "GiB", [etcd / GIB], goal=below(ETCD_QUOTA / GIB, "GiB"),
                 note="compact JSON of the stored objects; etcd's default quota is 2 GiB"),
        measured(NAME, f"etcd bytes, {NODES:,} dgx-a100 nodes, dynamic MIG, as protobuf"
                 " (estimated)", "GiB", [ours.stored_protobuf * NODES / GIB],
                 note="bench/scale_math.py protobuf_bytes: the storage encoding, estimated"),
        measured(NAME, "dgx-a100 dynamic MIG: stored bytes per node vs NVIDIA's layout", "KiB",
                 [ours.stored_bytes / 1024], [theirs.stored_bytes / 1024],
                 floor_how="NVIDIA's layout for the same node (bench/nvidia_layout.py, "
                 f"k8s-dra-driver-gpu@{NVIDIA_COMMIT[:12]}), stored the same way",
                 goal=ratio_at_most(1.0)),
    ]  # fmt: skip
    data["nvidia_commit"] = NVIDIA_COMMIT
    report(NAME, f"The {NODES:,}-node model (bench/scale_model.py)", rows, data, figures)
    return figures


def _entry(
    model: str,
    mode: str,
    layout: str,
    node: NodeFigures,
    sent: int,
    slices: int,
    devices: int,
    steady: float,
) -> dict[str, Any]:
    c = cluster(node, steady)
    return {
        "model": model,
        "mode": mode,
        "layout": layout,
        "devices": devices,
        "slices": slices,
        "sent_bytes": sent,
        "node": dataclasses.asdict(node),
        "cluster": dataclasses.asdict(c),
    }


def _row(e: dict[str, Any]) -> tuple[str, str]:
    n, c = e["node"], e["cluster"]
    return (
        f"{e['model']} {e['mode']} ({e['layout']})",
        f"{e['devices']} devices / {e['slices']} slices, {_mib(n['stored_bytes'])} a node;"
        f" etcd {c['etcd_bytes'] / GIB:.2f} GiB ({c['quota_share']:.0%} of quota;"
        f" as protobuf ~{c['etcd_protobuf_bytes'] / GIB:.2f} GiB);"
        f" change {n['change_writes']} writes, watch {_mib(c['change_watch_bytes'])};"
        f" restart {n['restart_writes']} writes;"
        f" a GPU tainted {n['taint_writes']} writes, watch {_mib(c['taint_watch_bytes'])};"
        f" writes/min steady {c['steady_writes_per_min']:,.0f},"
        f" churn {c['churn_writes_per_min']:,.0f}",
    )  # fmt: skip


def _daemon_rows(d: DaemonWrites, steady: float) -> list[tuple[str, str]]:
    lease = KUBELET_LEASE_WRITES_PER_MIN * NODES
    return [
        ("daemon (dgx-a100 dynamic): writes at start", str(d.start)),
        (f"daemon: writes in {d.window_s:g} s steady (report every {d.interval_s:g} s)",
         f"{d.steady} = {steady:.2f} per report (per minute at the default 60 s)"),
        ("daemon: writes at a clean stop", str(d.stop)),
        ("daemon: writes at a restart (same devices; reports aside)", str(d.restart or "none")),
        (f"{NODES:,} nodes steady", f"{steady * NODES:,.0f} writes/min"
         f" (the kubelets' own node Leases: {lease:,.0f}/min)"),
    ]  # fmt: skip
