"""What a crash of the agent must never leave behind, read from a simulated node between calls:
the checkpoint, the CDI specs, the MIG instances, the MPS daemons, the GPUs' compute modes and
time-slices, and the GPUs handed to virtual machines (tests/crashnode_vm.py). The crash suites
(tests/reliability/test_crash_storm.py, test_crash_matrix.py and the fast slice in
tests/integration/test_crash_cells.py) check these after every restart."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Mapping

from agent.nvml.facade import Nvml
from agent.nvml.types import MigInstance
from agent.sim.nvml import FakeNvml
from agent.sim.sharing import COMPUTE_MODE_DEFAULT, COMPUTE_MODE_EXCLUSIVE_PROCESS
from dra_driver.errors import CheckpointCorrupt, CheckpointTooNew
from dra_driver.kubeletplugin.cdi_spec import validate_spec
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED, Checkpoint, ClaimEntry, decode
from dra_driver.kubeletplugin.params import INTERVALS
from dra_driver.kubeletplugin.plan import MEMORY_SHARE, MPS, TIME_SLICING
from tests.crashnode_vm import metadata_violations, vm_violations
from tests.integration.daemon import DRIVER, Daemon
from tests.simnode import mps_daemons, node_model, sharing

CLAIM_KIND = f"k8s.{DRIVER}/claim"
SHARED = (TIME_SLICING, MEMORY_SHARE)
"""How several claims may hold one device at once."""

MigLayout = dict[int, list[tuple[int, int]]]
"""GPU index -> the (profile id, placement start) of each of its MIG instances, sorted."""


def spec_uids(d: Daemon) -> set[str]:
    """The claims that have a CDI spec."""
    return {name.split("claim_", 1)[1].removesuffix(".json") for name in d.cdi_files()}


def nvml_indexes(fake: FakeNvml) -> dict[int, int]:
    """The model's index -> NVML's index of every GPU NVML enumerates now (one bound to
    vfio-pci, or unbound, is not NVIDIA's driver's: NVML does not list it, and the indexes after
    it shift)."""
    return {gpu.index: n for n, gpu in enumerate(fake.present())}


def mig_instances(d: Daemon) -> dict[int, tuple[MigInstance, ...]]:
    """The MIG devices of every GPU NVML sees on the simulated node now, by the model's index."""
    fake = FakeNvml(node_model(d.model), d.state / "sim")
    nvml = Nvml(fake)
    nvml.init()
    try:
        return {model: nvml.mig_instances(n) for model, n in nvml_indexes(fake).items()}
    finally:
        nvml.shutdown()


def mig_layout(d: Daemon) -> MigLayout:
    """Where the MIG instances of every GPU are now."""
    return {
        index: sorted((i.profile_id, i.placement.start) for i in instances)
        for index, instances in mig_instances(d).items()
    }


def load_checkpoint(d: Daemon) -> Checkpoint:
    """The checkpoint as the agent reads it (raises CheckpointCorrupt: bad checksum, JSON or
    types); no file is an empty checkpoint."""
    path = d.state / "checkpoint.json"
    if not path.exists():
        return Checkpoint("")
    cp, _ = decode(path.read_bytes(), str(path))
    return cp


def node_violations(d: Daemon, baseline: MigLayout) -> list[str]:
    """Everything wrong with the node of the stopped or idle daemon ``d`` (no call running), one
    line each; ``baseline`` holds the MIG instances that are no claim's (a static layout).

    - the checkpoint decodes (version, checksum, types) and every claim in it is completed (an
      interrupted prepare is rolled back at start);
    - every completed claim with devices has exactly its CDI spec (valid, naming its devices, its
      MPS daemon's pipe mounted), no other spec or temporary file is in the CDI root and no
      temporary checkpoint file is left;
    - no device is held by two claims unless both share it (time-slicing at one interval, memory
      shares), and no whole GPU is held while one of its MIG devices is;
    - the MIG instances are the baseline plus the placements the claims hold, each with the UUID
      its claim recorded (a placement made twice, or left by a rollback, shows here);
    - the running MPS daemons are exactly the recorded ones, each serving its claim's devices,
      and only claims with a daemon have a daemon directory;
    - each GPU's time-slice is its time-slicing claims' interval (else the default), its compute
      mode EXCLUSIVE_PROCESS exactly while a claim shares the whole GPU through MPS;
    - each GPU's power limit is its claim's cap while a claim caps it, else the default (the
      limit the simulated GPUs start with), and a capped claim recorded that limit to set back;
    - the GPUs bound to vfio-pci and the vGPUs are exactly the recorded ones, and the KEP-5304
      device metadata is that of the completed VM claims (tests/crashnode_vm.py).
    """
    try:
        cp = load_checkpoint(d)
    except (CheckpointCorrupt, CheckpointTooNew) as exc:
        return [f"checkpoint does not decode: {exc}"]
    claims = cp.claims
    out: list[str] = []
    out += [
        f"claim {uid} is {e.state}{' (recovered)' if e.recovered else ''}, not completed"
        for uid, e in sorted(claims.items())
        if e.state != PREPARE_COMPLETED or e.recovered
    ]
    out += _cdi_violations(d, claims)
    out += _holder_violations(claims)
    out += _mig_violations(d, claims, baseline)
    out += _mps_violations(d, claims)
    out += _gpu_setting_violations(d, claims)
    out += _power_violations(d, claims)
    out += vm_violations(d, node_model(d.model), claims)
    out += metadata_violations(d, claims)
    return out


def _power_violations(d: Daemon, claims: Mapping[str, ClaimEntry]) -> list[str]:
    caps = {
        dev.gpu_uuid: (uid, dev)
        for uid, e in claims.items()
        for dev in e.devices
        if dev.power_limit_mw is not None
    }
    fake = FakeNvml(node_model(d.model), d.state / "sim")
    fake.nvmlInit()
    out = []
    try:
        seen = nvml_indexes(fake)
        for gpu in node_model(d.model).gpus:
            if gpu.index not in seen:
                continue  # a VM's (vfio-pci): the host cannot read it (vm_violations)
            h = fake.nvmlDeviceGetHandleByIndex(seen[gpu.index])
            now = fake.nvmlDeviceGetPowerManagementLimit(h)
            default = fake.nvmlDeviceGetPowerManagementDefaultLimit(h)
            uid, dev = caps.get(gpu.uuid, (None, None))
            want = default if dev is None else dev.power_limit_mw
            if now != want:
                whose = f"claim {uid}'s cap" if uid else "the default: no claim caps it"
                out.append(f"GPU {gpu.index}: power limit {now} mW, expected {want} ({whose})")
            if dev is not None and dev.power_restore_mw != default:
                out.append(
                    f"claim {uid}: GPU {gpu.index} records {dev.power_restore_mw} mW to set back,"
                    f" not the {default} mW it had"
                )
    finally:
        fake.nvmlShutdown()
    return out


def _cdi_violations(d: Daemon, claims: Mapping[str, ClaimEntry]) -> list[str]:
    out = []
    want = {uid for uid, e in claims.items() if e.state == PREPARE_COMPLETED and e.devices}
    have = spec_uids(d)
    if have != want:
        out.append(f"CDI specs {sorted(have)} != completed claims {sorted(want)}")
    expected_files = {f"k8s.{DRIVER}-driver.json", *(f"k8s.{DRIVER}-claim_{u}.json" for u in have)}
    others = sorted(p.name for p in d.cdi_dir.iterdir()) if d.cdi_dir.exists() else []
    metadata = f"{DRIVER}_metadata_"  # KEP-5304's specs: metadata_violations
    extra = [n for n in others if n not in expected_files and not n.startswith(metadata)]
    if extra:
        out.append(f"other files in the CDI root: {extra}")
    temps = sorted(p.name for p in d.state.glob(".checkpoint.json.*.tmp"))
    if temps:
        out.append(f"temporary checkpoint files left: {temps}")
    for uid in sorted(have & want):
        path = d.cdi_dir / f"k8s.{DRIVER}-claim_{uid}.json"
        try:
            spec = json.loads(path.read_text())
            validate_spec(spec)
        except Exception as exc:  # any unreadable or invalid spec is the finding
            out.append(f"CDI spec of {uid} is not a valid spec: {exc}")
            continue
        entry = claims[uid]
        if spec.get("kind") != CLAIM_KIND:
            out.append(f"CDI spec of {uid} has kind {spec.get('kind')!r}")
        names = sorted(dev["name"] for dev in spec.get("devices", []))
        ids = sorted(
            i.split("=", 1)[1]
            for dev in entry.devices
            for i in dev.cdi_device_ids
            if i.startswith(CLAIM_KIND + "=")
        )
        if names != ids:
            out.append(f"CDI spec of {uid} has devices {names}, its record {ids}")
        if entry.mps is not None:
            mounts = [m.get("hostPath") for m in spec.get("containerEdits", {}).get("mounts", [])]
            if entry.mps.pipe_dir not in mounts:
                out.append(f"CDI spec of {uid} does not mount its MPS pipe {entry.mps.pipe_dir}")
    return out


def _holder_violations(claims: Mapping[str, ClaimEntry]) -> list[str]:
    out = []
    holders: dict[tuple[str, str], list[tuple[str, str | None, str | None]]] = defaultdict(list)
    for uid, e in sorted(claims.items()):
        for dev in e.devices:
            holders[(dev.pool, dev.device)].append((uid, dev.sharing, dev.interval))
        for uid2, count in Counter(dev.device for dev in e.devices).items():
            if count > 1:
                out.append(f"claim {uid} lists {uid2} {count} times")
    for (_, device), held in sorted(holders.items()):
        if len(held) < 2:
            continue
        ways = {(sharing, interval) for _, sharing, interval in held}
        if len(ways) != 1 or next(iter(ways))[0] not in SHARED:
            out.append(f"{device} held twice: {held}")
    whole = {
        dev.gpu_uuid: uid for uid, e in claims.items() for dev in e.devices if dev.kind == "gpu"
    }
    for uid, e in sorted(claims.items()):
        for dev in e.devices:
            if dev.kind == "mig" and dev.gpu_uuid in whole:
                out.append(f"{dev.device} of {uid} is on the GPU {whole[dev.gpu_uuid]} holds whole")
    return out


def _mig_violations(d: Daemon, claims: Mapping[str, ClaimEntry], baseline: MigLayout) -> list[str]:
    out = []
    held: dict[int, list[tuple[int, int]]] = defaultdict(list)
    recorded: dict[tuple[int, int, int], str | None] = {}
    for e in claims.values():
        for dev in e.devices:
            if dev.placement is not None:
                held[dev.gpu_minor].append((dev.placement[0], dev.placement[1]))
                recorded[(dev.gpu_minor, dev.placement[0], dev.placement[1])] = dev.mig_uuid
    for index, instances in sorted(mig_instances(d).items()):
        have = sorted((i.profile_id, i.placement.start) for i in instances)
        want = sorted([*baseline.get(index, []), *held.get(index, [])])
        if have != want:
            out.append(f"GPU {index}: MIG instances {have} != expected {want}")
        for i in instances:
            key = (index, i.profile_id, i.placement.start)
            if key in recorded and recorded[key] != i.uuid:
                out.append(
                    f"GPU {index}: placement {key[1:]} is {i.uuid}, its claim recorded"
                    f" {recorded[key]}"
                )
    return out


def _mps_violations(d: Daemon, claims: Mapping[str, ClaimEntry]) -> list[str]:
    out = []
    running = {x.pid: x for x in mps_daemons(d.state / "sim", d.model)}
    recorded = {e.mps.pid: (uid, e) for uid, e in claims.items() if e.mps is not None}
    if sorted(running) != sorted(recorded):
        out.append(f"MPS daemons running {sorted(running)} != recorded {sorted(recorded)}")
    for pid, (uid, e) in sorted(recorded.items()):
        assert e.mps is not None
        serves = {
            dev.mig_uuid or dev.gpu_uuid for dev in e.devices if dev.sharing in (MPS, MEMORY_SHARE)
        }
        if set(e.mps.devices) != serves:
            out.append(f"the MPS record of {uid} serves {sorted(e.mps.devices)}, its devices"
                       f" are {sorted(serves)}")  # fmt: skip
        if pid in running and set(running[pid].devices) != set(e.mps.devices):
            out.append(f"the MPS daemon {pid} of {uid} serves {running[pid].devices}")
    mps_root = d.state / "mps"
    dirs = {p.name for p in mps_root.iterdir() if p.is_dir()} if mps_root.exists() else set()
    owners = {uid for uid, e in claims.items() if e.mps is not None}
    if dirs != owners:
        out.append(f"MPS directories {sorted(dirs)} != claims with a daemon {sorted(owners)}")
    return out


def _gpu_setting_violations(d: Daemon, claims: Mapping[str, ClaimEntry]) -> list[str]:
    out = []
    sliced: dict[str, set[str]] = defaultdict(set)
    exclusive: set[str] = set()
    for e in claims.values():
        for dev in e.devices:
            if dev.sharing == TIME_SLICING and dev.interval is not None:
                sliced[dev.gpu_uuid].add(dev.interval)
            if dev.kind == "gpu" and dev.sharing == MPS:
                exclusive.add(dev.gpu_uuid)
    for gpu in sharing(d.state / "sim", d.model).gpus:
        intervals = sliced.get(gpu.uuid, set())
        if len(intervals) > 1:
            out.append(f"GPU {gpu.index} time-sliced at several intervals: {sorted(intervals)}")
        want = INTERVALS.index(next(iter(intervals))) if intervals else 0
        if gpu.timeslice != want:
            out.append(f"GPU {gpu.index}: time-slice {gpu.timeslice}, its claims want {want}")
        mode = COMPUTE_MODE_EXCLUSIVE_PROCESS if gpu.uuid in exclusive else COMPUTE_MODE_DEFAULT
        if gpu.compute_mode != mode:
            out.append(f"GPU {gpu.index}: compute mode {gpu.compute_mode}, expected {mode}")
    return out


def leftovers(d: Daemon, baseline: MigLayout) -> list[str]:
    """After every claim was unprepared: nothing may be left (no claim, CDI claim spec, MIG
    instance beyond ``baseline``, MPS daemon or directory, time-slice, compute mode, GPU off
    nvidia, vGPU, device metadata)."""
    out = node_violations(d, baseline)
    try:
        claims = load_checkpoint(d).claims
    except (CheckpointCorrupt, CheckpointTooNew):
        return out
    if claims:
        out.append(f"claims left in the checkpoint: {sorted(claims)}")
    return out
