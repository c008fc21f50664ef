"""What a CDI spec of this driver is, before any file is written: its names and their limits,
the shapes a claim's spec is built from (:class:`CdiRequest`, :class:`MpsEdits`), what a spec on
disk proves (:class:`SpecEvidence`), the MIG capability files, and the check against the packaged
CDI JSON schema. :mod:`dra_driver.kubeletplugin.cdi`'s ``CdiWriter`` builds and writes the specs
(its docstring says what they hold and why)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from dra_driver.errors import CdiError

CDI_VERSION = "0.5.0"
MAX_SPEC_BYTES = 4 * 1024 * 1024
"""A spec of ours is a few KiB; one larger than this is not ours."""
SPEC_FILE_MODE = 0o644
"""Container runtimes read the specs."""
CDI_DIR_MODE = 0o755
"""The CDI root, when this driver creates it (/var/run/cdi is shared with other vendors)."""

CLAIM_UID_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DRIVER_VERSION_RE = re.compile(r"^[0-9]+(\.[0-9]+)*$")
CDI_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
"""A CDI device name: alphanumeric at both ends, ``_ . : -`` inside."""
_KIND_PART = r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?"
CDI_KIND_RE = re.compile(rf"^{_KIND_PART}/{_KIND_PART}$")
"""``<vendor>/<class>``."""

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")
"""The driver's files: NVIDIA Container Toolkit's options (``internal/discover/mounts.go``)."""
SOCKET_OPTIONS = ("nosuid", "nodev", "rbind", "rprivate", "noexec")
"""The driver's sockets: the toolkit's ``ipcMountOptions`` (``internal/discover/ipc.go``)."""
HOOK_LIFECYCLE = "createContainer"
"""The toolkit's hooks run in the container's mount namespace before pivot_root."""
HOOK_ENV = ("NVIDIA_CTK_DEBUG=false",)
NVIDIA_LIB64 = "/usr/local/nvidia/lib64"
"""On ``LD_LIBRARY_PATH`` (and in ``ld.so.conf.d/nvidia.conf``) of NVIDIA's CUDA images: where
the hook-free layout mounts every library name too."""
BASE_DEVICE = "common"
NVIDIA_CAPS = "nvidia-caps"
CAPS_DIR = "proc/driver/nvidia/capabilities"
_MINOR_RE = re.compile(r"^\s*DeviceFileMinor:\s*([0-9]+)\s*$", re.MULTILINE)
_MODE_RE = re.compile(r"^\s*DeviceFileMode:\s*([0-9]+)\s*$", re.MULTILINE)


MPS_CONTAINER_PIPE_DIR = "/run/tessera/mps"
"""Where a claim's containers see its MPS daemon's pipe directory (CUDA_MPS_PIPE_DIRECTORY)."""


@dataclass(frozen=True)
class MpsEdits:
    """The host directories of a claim's MPS daemon that its containers need."""

    pipe_dir: str
    """Mounted at ``MPS_CONTAINER_PIPE_DIR`` (the control socket)."""
    shm_dir: str
    """Mounted at ``/dev/shm`` (the shared memory of the MPS server and its clients)."""

    def __post_init__(self) -> None:
        for path in (self.pipe_dir, self.shm_dir):
            if not path.startswith("/") or "\x00" in path or ".." in path.split("/"):
                raise CdiError(f"MPS directory {path!r} is not a plain absolute path")


@dataclass(frozen=True)
class SpecEvidence:
    """What a claim's spec file on disk says was prepared (``CdiWriter.read_evidence``)."""

    uid: str
    devices: tuple[str, ...]
    """The pool device names it exposes (from its CDI device names ``<claimUID>-<device>``)."""
    written_at: float
    """The file's modification time (unix seconds)."""
    device_nodes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(pool device name, its device nodes' container paths): ``/dev/nvidia<minor>`` and, for a
    MIG device, its GPU and compute instances' ``/dev/nvidia-caps/nvidia-cap<N>``."""
    env: tuple[tuple[str, str], ...] = ()
    """The claim-wide env: ``TESSERA_CLAIM_UID``, ``TESSERA_DEVICES``, with MPS
    ``CUDA_MPS_PIPE_DIRECTORY``."""
    mounts: tuple[tuple[str, str], ...] = ()
    """(container path, host path) of the claim-wide mounts (an MPS daemon's directories)."""

    @property
    def mps_pipe_dir(self) -> str | None:
        """The host directory of the claim's MPS daemon's pipe, when the spec mounts one."""
        if ("CUDA_MPS_PIPE_DIRECTORY", MPS_CONTAINER_PIPE_DIR) not in self.env:
            return None
        return dict(self.mounts).get(MPS_CONTAINER_PIPE_DIR)


def spec_evidence(
    spec: Any, claim_uid: str, kind: str, where: str, written_at: float
) -> SpecEvidence:
    """What a claim's decoded spec says was prepared (``CdiWriter.read_evidence`` reads the
    file); CdiError when it is not a ``kind`` spec with devices, fields of the wrong shape read
    as absent."""
    devices = spec.get("devices") if isinstance(spec, dict) else None
    if not isinstance(devices, list) or spec.get("kind") != kind:
        raise CdiError(f"CDI spec {where} is not a {kind} spec with devices")
    prefix = f"{claim_uid}-"
    names = []
    nodes: list[tuple[str, tuple[str, ...]]] = []
    for d in devices:
        name = d.get("name") if isinstance(d, dict) else None
        if isinstance(name, str) and name.startswith(prefix):
            names.append(name.removeprefix(prefix))
            nodes.append((names[-1], node_paths(d.get("containerEdits"))))
    edits = spec.get("containerEdits")
    edits = edits if isinstance(edits, dict) else {}
    env = tuple(
        tuple(e.split("=", 1)) for e in edits.get("env") or [] if isinstance(e, str) and "=" in e
    )
    mounts = tuple(
        (str(m.get("containerPath")), str(m.get("hostPath")))
        for m in edits.get("mounts") or []
        if isinstance(m, dict)
    )
    return SpecEvidence(
        uid=claim_uid,
        devices=tuple(names),
        written_at=written_at,
        device_nodes=tuple(nodes),
        env=tuple((k, v) for k, v in env),
        mounts=mounts,
    )


def node_paths(edits: Any) -> tuple[str, ...]:
    nodes = edits.get("deviceNodes") if isinstance(edits, dict) else None
    if not isinstance(nodes, list):
        return ()
    return tuple(str(n["path"]) for n in nodes if isinstance(n, dict) and "path" in n)


@dataclass(frozen=True)
class CdiRequest:
    """One allocated device to expose: its pool device name and where it lives."""

    device_name: str
    """Pool device name, a DNS label: ``gpu-0``, ``gpu-0-mig-1g5gb-19-0``."""
    gpu_minor: int
    gpu_instance_id: int | None = None
    """MIG only, with ``compute_instance_id``."""
    compute_instance_id: int | None = None
    vfio_group: int | None = None
    """A device for a virtual machine (vfio, vgpu): its IOMMU group. Its nodes are then
    ``/dev/vfio/vfio`` and ``/dev/vfio/<group>`` alone (no NVIDIA node: the host driver no
    longer has the GPU, or a vGPU is a function of its own)."""


def check_claim_uid(claim_uid: str) -> str:
    if not isinstance(claim_uid, str) or not CLAIM_UID_RE.fullmatch(claim_uid):
        raise CdiError(
            f"claim UID {claim_uid!r} is not a lower-case DNS label (a Kubernetes UID);"
            " refusing to build a CDI name or file from it"
        )
    return claim_uid


def check_device_name(name: str) -> str:
    if not isinstance(name, str) or not DNS_LABEL_RE.fullmatch(name):
        raise CdiError(f"device name {name!r} is not a DNS label (at most 63 of [a-z0-9-])")
    return name


def read_caps_minor(path: Path) -> int:
    """The ``DeviceFileMinor`` of a driver capability ``access`` file. Raises CdiError."""
    return read_caps(path)[0]


def read_caps(path: Path) -> tuple[int, int]:
    """The ``DeviceFileMinor`` and ``DeviceFileMode`` (0444 when absent) of a driver capability
    ``access`` file. Raises CdiError."""
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise CdiError(
            f"MIG capability file {path} does not exist: the MIG device cannot be exposed"
            " without its /dev/nvidia-caps node"
        ) from exc
    except OSError as exc:
        raise CdiError(f"cannot read MIG capability file {path}: {exc.strerror or exc}") from exc
    m = _MINOR_RE.search(text)
    if not m:
        raise CdiError(f"MIG capability file {path} has no 'DeviceFileMinor: <N>' line")
    mode = _MODE_RE.search(text)
    return int(m.group(1)), int(mode.group(1)) if mode else 0o444


@functools.cache
def _validator() -> Any:
    """The draft-07 validator of the packaged CDI schema (loaded on first use)."""
    base = resources.files("dra_driver.kubeletplugin").joinpath("cdi_schema")
    schema = json.loads(base.joinpath("schema.json").read_text())
    defs = json.loads(base.joinpath("defs.json").read_text())
    registry: Registry[Any] = Registry().with_resource(
        "defs.json", Resource.from_contents(defs, default_specification=DRAFT7)
    )
    return jsonschema.Draft7Validator(schema, registry=registry)


def validate_spec(spec: dict[str, Any]) -> None:
    """Check ``spec`` against the CDI JSON schema, then the name rules runtimes enforce.

    The extra checks: ``kind`` is ``<vendor>/<class>``, device names are valid CDI names and
    unique, env entries are ``KEY=VALUE`` strings. Raises CdiError with what is wrong and where.
    """
    errors = sorted(_validator().iter_errors(spec), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.absolute_path) or "<root>"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise CdiError(f"CDI spec does not match the schema at {where}: {first.message}{more}")
    if not CDI_KIND_RE.fullmatch(spec["kind"]):
        raise CdiError(f"CDI spec kind {spec['kind']!r} is not <vendor>/<class>")
    seen: set[str] = set()
    for i, dev in enumerate(spec["devices"]):
        name = dev["name"]
        if not CDI_NAME_RE.fullmatch(name):
            raise CdiError(f"CDI spec devices/{i}: name {name!r} is not a valid CDI device name")
        if name in seen:
            raise CdiError(f"CDI spec devices/{i}: device name {name!r} appears twice")
        seen.add(name)
    edits = [("containerEdits", spec.get("containerEdits") or {})]
    edits += [
        (f"devices/{i}/containerEdits", d["containerEdits"]) for i, d in enumerate(spec["devices"])
    ]
    for where, e in edits:
        for env in e.get("env", []):
            if not isinstance(env, str) or "=" not in env or env.startswith("="):
                raise CdiError(f"CDI spec {where}/env: {env!r} is not KEY=VALUE")


MakeNode = Callable[[Path, int, int, int], None]
"""``(path, major, minor, mode)``: make a character device node (``make_char_device``)."""


def mount(host: str, container: str, options: Sequence[str] = MOUNT_OPTIONS) -> dict[str, Any]:
    return {"hostPath": host, "containerPath": container, "options": list(options)}


def hook_argv0(hook: str) -> list[str]:
    """The hook's fixed arguments: ``nvidia-cdi-hook <name>`` or ``nvidia-ctk hook <name>``
    (the toolkit's ``getFixedArgsForCDIHookCLI``)."""
    base = PurePosixPath(hook).name
    return [base, "hook"] if base == "nvidia-ctk" else [base]
