"""CDI specs for prepared claims: one spec file per claim, one CDI device per allocated device.

A spec (``cdiVersion`` 0.5.0, the lowest that allows device nodes with ``hostPath``) of kind
``k8s.<driver>/claim``, in ``<cdi_root>/k8s.<driver>-claim_<claimUID>.json``::

    devices:        <claimUID>-<deviceName>: /dev/nvidia<minor>
                                             + for MIG /dev/nvidia-caps/nvidia-cap<GI>, ...<CI>
    containerEdits: /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools,
                    env TESSERA_CLAIM_UID, TESSERA_DEVICES (device names, comma-separated),
                    read-only bind mounts of the driver's user-space libraries;
                    with MPS: env CUDA_MPS_PIPE_DIRECTORY=/run/tessera/mps and bind mounts of
                    the claim's daemon's pipe directory there and its shm directory at /dev/shm

Device names carry the claim UID because runtimes cache specs: a name is never reused by another
claim. File and device names are built only from validated values (a claim UID, DNS-label device
names), never from paths in input, so no name can leave ``cdi_root``.

MIG capability minors are read from the driver's ``proc/driver/nvidia/capabilities`` tree under
the driver root; a missing file is an error, since a MIG container without its capability nodes
cannot use the GPU. Libraries not found under the driver root are left out.

``build_spec`` is pure apart from reading the driver root; ``write``/``remove``/``claim_uids`` do
the I/O on ``cdi_root``. Every spec is checked against the CDI JSON schema packaged in
``dra_driver/cdi_schema`` before it is returned or written.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from agent.decode import load_json
from agent.errors import DecodeError
from agent.fsutil import atomic_write, fsync_dir, remove_temp_files
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
LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib")
"""Where driver libraries are looked for under the driver root, in order."""
LIBRARIES = (
    "libcuda.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libcudadebugger.so",
)
"""Mounted as ``<name>.<driver version>`` when present."""
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")
CAPS_DIR = "proc/driver/nvidia/capabilities"
_MINOR_RE = re.compile(r"^\s*DeviceFileMinor:\s*([0-9]+)\s*$", re.MULTILINE)


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
class CdiRequest:
    """One allocated device to expose: its pool device name and where it lives."""

    device_name: str
    """Pool device name, a DNS label: ``gpu-0``, ``gpu-0-mig-1g5gb-19-0``."""
    gpu_minor: int
    gpu_instance_id: int | None = None
    """MIG only, with ``compute_instance_id``."""
    compute_instance_id: int | None = None


def _check_claim_uid(claim_uid: str) -> str:
    if not isinstance(claim_uid, str) or not CLAIM_UID_RE.fullmatch(claim_uid):
        raise CdiError(
            f"claim UID {claim_uid!r} is not a lower-case DNS label (a Kubernetes UID);"
            " refusing to build a CDI name or file from it"
        )
    return claim_uid


def _check_device_name(name: str) -> str:
    if not isinstance(name, str) or not DNS_LABEL_RE.fullmatch(name):
        raise CdiError(f"device name {name!r} is not a DNS label (at most 63 of [a-z0-9-])")
    return name


def _node(path: str) -> dict[str, Any]:
    return {"path": path, "hostPath": path}


def read_caps_minor(path: Path) -> int:
    """The ``DeviceFileMinor`` of a driver capability ``access`` file. Raises CdiError."""
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
    return int(m.group(1))


@functools.cache
def _validator() -> Any:
    """The draft-07 validator of the packaged CDI schema (loaded on first use)."""
    base = resources.files("dra_driver").joinpath("cdi_schema")
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


class CdiWriter:
    """Builds, writes and removes the per-claim CDI specs of one driver."""

    def __init__(
        self, cdi_root: Path, driver_name: str, driver_root: Path, driver_version: str
    ) -> None:
        if not DNS_SUBDOMAIN_RE.fullmatch(driver_name) or len(driver_name) > 253:
            raise CdiError(f"driver name {driver_name!r} is not a lower-case DNS subdomain")
        if not DRIVER_VERSION_RE.fullmatch(driver_version):
            raise CdiError(f"driver version {driver_version!r} is not like 550.90.07")
        self.cdi_root = Path(cdi_root)
        self.driver_name = driver_name
        self.driver_root = Path(driver_root).absolute()
        self.driver_version = driver_version
        self.kind = f"k8s.{driver_name}/claim"
        self._file_re = re.compile(
            rf"^k8s\.{re.escape(driver_name)}-claim_({CLAIM_UID_RE.pattern[1:-1]})\.json$"
        )

    def device_id(self, claim_uid: str, device_name: str) -> str:
        """The fully qualified CDI device id: ``k8s.<driver>/claim=<claimUID>-<deviceName>``."""
        return f"{self.kind}={self._device_name(claim_uid, device_name)}"

    def path(self, claim_uid: str) -> Path:
        """The spec file of a claim: ``<cdi_root>/k8s.<driver>-claim_<claimUID>.json``."""
        return self.cdi_root / f"k8s.{self.driver_name}-claim_{_check_claim_uid(claim_uid)}.json"

    @staticmethod
    def _device_name(claim_uid: str, device_name: str) -> str:
        return f"{_check_claim_uid(claim_uid)}-{_check_device_name(device_name)}"

    def _mig_nodes(self, req: CdiRequest) -> list[dict[str, Any]]:
        gi, ci = req.gpu_instance_id, req.compute_instance_id
        if gi is None or ci is None:
            raise CdiError(
                f"device {req.device_name!r}: a MIG device needs both the GPU instance id and"
                f" the compute instance id (got {gi!r}, {ci!r})"
            )
        if gi < 0 or ci < 0:
            raise CdiError(f"device {req.device_name!r}: negative MIG instance id ({gi}, {ci})")
        gi_dir = self.driver_root / CAPS_DIR / f"gpu{req.gpu_minor}" / "mig" / f"gi{gi}"
        return [
            _node(f"/dev/nvidia-caps/nvidia-cap{read_caps_minor(p)}")
            for p in (gi_dir / "access", gi_dir / f"ci{ci}" / "access")
        ]

    def library_mounts(self) -> list[dict[str, Any]]:
        """Read-only bind mounts of the driver libraries found under the driver root."""
        mounts: list[dict[str, Any]] = []
        for lib in LIBRARIES:
            for d in LIBRARY_DIRS:
                rel = f"{d}/{lib}.{self.driver_version}"
                if (self.driver_root / rel).is_file():
                    mounts.append(
                        {
                            "hostPath": str(self.driver_root / rel),
                            "containerPath": f"/{rel}",
                            "options": list(MOUNT_OPTIONS),
                        }
                    )
                    break
        return mounts

    def build_spec(
        self, claim_uid: str, devices: Sequence[CdiRequest], mps: MpsEdits | None = None
    ) -> dict[str, Any]:
        """The CDI spec of a claim with ``devices`` (and its MPS daemon's directories). Pure
        apart from reading the driver root.

        Raises CdiError for a bad claim UID or device name, a duplicate device, no devices, or a
        MIG device whose capability files are missing.
        """
        _check_claim_uid(claim_uid)
        if not devices:
            raise CdiError(f"claim {claim_uid}: no devices to put in a CDI spec")
        cdi_devices: list[dict[str, Any]] = []
        names: list[str] = []
        for req in devices:
            name = self._device_name(claim_uid, req.device_name)
            if req.device_name in names:
                raise CdiError(f"claim {claim_uid}: device {req.device_name!r} listed twice")
            if req.gpu_minor < 0:
                raise CdiError(f"device {req.device_name!r}: negative GPU minor {req.gpu_minor}")
            nodes = [_node(f"/dev/nvidia{req.gpu_minor}")]
            if req.gpu_instance_id is not None or req.compute_instance_id is not None:
                nodes += self._mig_nodes(req)
            cdi_devices.append({"name": name, "containerEdits": {"deviceNodes": nodes}})
            names.append(req.device_name)
        edits: dict[str, Any] = {
            "env": [f"TESSERA_CLAIM_UID={claim_uid}", f"TESSERA_DEVICES={','.join(names)}"],
            "deviceNodes": [_node(p) for p in CONTROL_NODES],
        }
        mounts = self.library_mounts()
        if mps is not None:
            edits["env"].append(f"CUDA_MPS_PIPE_DIRECTORY={MPS_CONTAINER_PIPE_DIR}")
            mounts += [
                {"hostPath": mps.pipe_dir, "containerPath": MPS_CONTAINER_PIPE_DIR,
                 "options": ["rw", "nosuid", "nodev", "bind"]},
                {"hostPath": mps.shm_dir, "containerPath": "/dev/shm",
                 "options": ["rw", "nosuid", "nodev", "bind"]},
            ]  # fmt: skip
        if mounts:
            edits["mounts"] = mounts
        spec: dict[str, Any] = {
            "cdiVersion": CDI_VERSION,
            "kind": self.kind,
            "devices": cdi_devices,
            "containerEdits": edits,
        }
        validate_spec(spec)
        return spec

    def write(self, claim_uid: str, spec: dict[str, Any]) -> Path:
        """Validate ``spec`` and write it atomically as the claim's spec file (mode 0644)."""
        path = self.path(claim_uid)
        validate_spec(spec)
        if spec["kind"] != self.kind:
            raise CdiError(f"CDI spec kind {spec['kind']!r} is not this driver's {self.kind!r}")
        data = (json.dumps(spec, indent=2, sort_keys=True) + "\n").encode()
        try:
            atomic_write(path, data, mode=SPEC_FILE_MODE, dir_mode=CDI_DIR_MODE)
        except OSError as exc:
            raise CdiError(f"cannot write CDI spec {path}: {exc.strerror or exc}") from exc
        return path

    def remove(self, claim_uid: str) -> bool:
        """Delete the claim's spec file; True if there was one. Idempotent."""
        path = self.path(claim_uid)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise CdiError(f"cannot remove CDI spec {path}: {exc.strerror or exc}") from exc
        try:
            fsync_dir(path.parent)
        except OSError as exc:
            raise CdiError(f"cannot sync {path.parent}: {exc.strerror or exc}") from exc
        return True

    def evidence(self, claim_uid: str) -> tuple[tuple[str, ...], float]:
        """What the claim's spec file says was prepared: the pool device names it exposes (from
        its CDI device names ``<claimUID>-<device>``) and when it was written (unix seconds).
        Raises CdiError when it cannot be read or is not a spec of ours."""
        path = self.path(claim_uid)
        try:
            written_at = path.stat().st_mtime
            spec = load_json(path.read_bytes(), str(path), MAX_SPEC_BYTES)
        except OSError as exc:
            raise CdiError(f"cannot read CDI spec {path}: {exc.strerror or exc}") from exc
        except DecodeError as exc:
            raise CdiError(str(exc)) from exc
        devices = spec.get("devices") if isinstance(spec, dict) else None
        if not isinstance(devices, list) or spec.get("kind") != self.kind:
            raise CdiError(f"CDI spec {path} is not a {self.kind} spec with devices")
        prefix = f"{claim_uid}-"
        names = []
        for d in devices:
            name = d.get("name") if isinstance(d, dict) else None
            if isinstance(name, str) and name.startswith(prefix):
                names.append(name.removeprefix(prefix))
        return tuple(names), written_at

    def remove_temp_files(self) -> list[Path]:
        """Temporary files of our specs that a crash left behind in the CDI root (only ours:
        the directory is shared with other vendors)."""
        return remove_temp_files(self.cdi_root, f"k8s.{self.driver_name}-claim_*.json")

    def claim_uids(self) -> set[str]:
        """UIDs of the claims that have a spec file here (only file names this driver writes)."""
        try:
            names = [p.name for p in self.cdi_root.iterdir()]
        except FileNotFoundError:
            return set()
        except OSError as exc:
            raise CdiError(
                f"cannot list CDI specs in {self.cdi_root}: {exc.strerror or exc}"
            ) from exc
        return {m.group(1) for n in names if (m := self._file_re.fullmatch(n))}
