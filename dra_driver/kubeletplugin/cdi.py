"""CDI specs: one base spec with the driver's files, and one small spec per prepared claim.

**The base spec** (``k8s.<driver>/driver``, ``<cdi_root>/k8s.<driver>-driver.json``, written at
start and again whenever it is missing) holds what every GPU container needs, as NVIDIA
Container Toolkit's generated specs do (``nvidia-ctk cdi generate``, ``pkg/nvcdi``)::

    devices:        common: env TESSERA_DRIVER_VERSION=<version>
    containerEdits: /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools,
                    read-only bind mounts of the driver's compute and utility libraries,
                    binaries, GSP firmware, and the persistenced / fabric-manager sockets;
                    the SONAMEs made resolvable (below)

**A claim's spec** (``k8s.<driver>/claim``, ``<cdi_root>/k8s.<driver>-claim_<claimUID>.json``)::

    devices:        <claimUID>-<deviceName>: /dev/nvidia<minor>
                                             + for MIG /dev/nvidia-caps/nvidia-cap<GI>, ...<CI>
                    (a VM's device: /dev/vfio/vfio and /dev/vfio/<group>, no base spec)
    containerEdits: env TESSERA_CLAIM_UID, TESSERA_DEVICES (device names, comma-separated);
                    with MPS: env CUDA_MPS_PIPE_DIRECTORY=/run/tessera/mps and bind mounts of
                    the claim's daemon's pipe directory there and its shm directory at /dev/shm

Every prepared device is answered with two CDI device ids, its claim device and
``k8s.<driver>/driver=common``. A runtime applies a spec's top-level ``containerEdits`` once per
container however many of its devices are requested (``pkg/cdi/cache.go`` ``InjectDevices`` of
cncf-tags/container-device-interface, which containerd and CRI-O use), so a container with two
claims gets the driver's files once; the base device's own edit (an env variable) is idempotent.
CDI has no include mechanism and a device may not have empty edits (``pkg/cdi/device.go``).

**Paths.** The driver's files are found under ``driver_root`` (where the agent sees them,
:mod:`agent.driverfiles`); every ``hostPath`` names them under ``host_driver_root`` (where the
host, and so the container runtime, sees the same files); every ``containerPath`` is the path
the driver root itself has (``/usr/lib/x86_64-linux-gnu/libcuda.so.<version>``). Device nodes
are under the driver root too when it has a ``dev`` directory (else under ``/``), as NVIDIA's DRA
driver decides (``getDevRoot``).

**SONAMEs.** A program asks the loader for ``libcuda.so.1``, not for the versioned file:

- with the toolkit's hook binary on the host (``nvidia-cdi-hook``, else ``nvidia-ctk``): the
  versioned files are mounted, and the same ``createContainer`` hooks the toolkit emits make the
  links and the cache in the container: ``create-symlinks --link <target>::<link>`` (each
  SONAME link the host has, and ``libcuda.so -> libcuda.so.1``; ``internal/discover/symlinks.go``)
  and ``update-ldcache --folder <dir>`` for each library directory
  (``internal/discover/ldconfig.go``), with ``NVIDIA_CTK_DEBUG=false`` in the hooks'
  environment (``internal/discover/hooks.go``);
- without it: no hook, so every name is mounted as a file: the versioned file, its SONAME and
  (libcuda and where the host has one) its development link, each both at the driver's own
  directory and in ``/usr/local/nvidia/lib64``, which NVIDIA's CUDA images (Ubuntu and UBI)
  put on ``LD_LIBRARY_PATH`` and in ``/etc/ld.so.conf.d/nvidia.conf`` (docs/install.md).

Device names carry the claim UID because runtimes cache specs: a name is never reused by another
claim. File and device names are built only from validated values (a claim UID, DNS-label device
names), never from paths in input, so no name can leave ``cdi_root``.

MIG capability minors are read from the driver's ``proc/driver/nvidia/capabilities`` tree under
the driver root; a missing file is an error, since a MIG container without its capability nodes
cannot use the GPU. A capability's device node missing under the dev root is made (``mknod``,
the ``nvidia-caps`` major from the driver root's ``proc/devices``, the file's minor and mode), as
``nvidia-modprobe`` does: the runtime reads a ``hostPath`` node to fill in its type and numbers;
under a read-only dev root it is made in the host's ``/dev`` (``caps_fallback_root``).

``build_spec``/``build_base_spec`` read the driver root (and make missing MIG capability nodes);
``write``/``write_base``/``remove``/``claim_uids`` do the I/O on ``cdi_root``. Every spec is
checked against the CDI JSON schema packaged in ``dra_driver/kubeletplugin/cdi_schema`` before it
is returned or written.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.decode import load_json
from agent.driverfiles.discover import (
    DriverFiles,
    discover_driver_files,
    has_dev_dir,
    make_char_device,
    read_char_major,
    under,
)
from agent.errors import DecodeError
from agent.fsutil import atomic_write, holds, read_regular_file, remove_temp_files
from agent.jsonout import indented_json
from dra_driver.errors import CdiError
from dra_driver.kubeletplugin.cdi_driver_edits import DriverEdits
from dra_driver.kubeletplugin.cdi_spec import (
    BASE_DEVICE,
    CAPS_DIR,
    CDI_DIR_MODE,
    CDI_VERSION,
    CLAIM_UID_RE,
    CONTROL_NODES,
    DNS_SUBDOMAIN_RE,
    DRIVER_VERSION_RE,
    MAX_SPEC_BYTES,
    MPS_CONTAINER_PIPE_DIR,
    NVIDIA_CAPS,
    SPEC_FILE_MODE,
    CdiRequest,
    MakeNode,
    MpsEdits,
    SpecEvidence,
    check_claim_uid,
    check_device_name,
    node_paths,
    read_caps,
    spec_evidence,
    validate_spec,
)


class CdiWriter:
    """Builds, writes and removes the CDI specs of one driver: the base spec and the claims'."""

    def __init__(
        self,
        cdi_root: Path,
        driver_name: str,
        driver_root: Path,
        driver_version: str,
        *,
        host_driver_root: Path | None = None,
        hook: str | None = None,
        make_node: MakeNode = make_char_device,
        caps_fallback_root: Path = Path("/"),
    ) -> None:
        """``driver_root``: where the agent sees the driver's files; ``host_driver_root``: where
        the host sees them (None: the same); ``hook``: the host path of ``nvidia-cdi-hook`` or
        ``nvidia-ctk`` (None: the hook-free layout); ``make_node``: how a missing MIG capability
        node is made; ``caps_fallback_root``: where it is made when the dev root is read-only
        (the agent's own ``/``, whose ``/dev`` is the host's: the DaemonSet's ``dev`` volume)."""
        if not DNS_SUBDOMAIN_RE.fullmatch(driver_name) or len(driver_name) > 253:
            raise CdiError(f"driver name {driver_name!r} is not a lower-case DNS subdomain")
        if not DRIVER_VERSION_RE.fullmatch(driver_version):
            raise CdiError(f"driver version {driver_version!r} is not like 550.90.07")
        for what, p in (("host driver root", host_driver_root), ("CDI hook", hook)):
            if p is not None and not str(p).startswith("/"):
                raise CdiError(f"{what} {str(p)!r} is not an absolute path on the host")
        self.cdi_root = Path(cdi_root)
        self.driver_name = driver_name
        self.driver_root = Path(driver_root).absolute()
        self.host_driver_root = Path(host_driver_root or self.driver_root)
        self.driver_version = driver_version
        self.hook = hook
        self.make_node = make_node
        self.caps_fallback_root = caps_fallback_root
        self.kind = f"k8s.{driver_name}/claim"
        self.base_kind = f"k8s.{driver_name}/driver"
        self.base_device_id = f"{self.base_kind}={BASE_DEVICE}"
        """The CDI device id every prepared device is answered with besides its own."""
        self.base_path = self.cdi_root / f"k8s.{driver_name}-driver.json"
        self._base_current = False
        """Whether this process wrote (or found) the base spec as it builds it."""
        self._base_lock = threading.Lock()  # a batch's first claims write the base spec once
        self.files: DriverFiles = discover_driver_files(self.driver_root, driver_version)
        on_root = has_dev_dir(self.driver_root)
        self.dev_root = self.driver_root if on_root else Path("/")
        self.host_dev_root = self.host_driver_root if on_root else Path("/")
        self._host_nodes: dict[str, str] = {}
        """Device node path -> its host path (``node``)."""
        self._file_re = re.compile(
            rf"^k8s\.{re.escape(driver_name)}-claim_({CLAIM_UID_RE.pattern[1:-1]})\.json$"
        )

    # -- paths -----------------------------------------------------------------------------
    def host(self, rel: str) -> str:
        """The host's path of the driver root's ``rel`` (root-relative, absolute)."""
        return str(under(self.host_driver_root, rel))

    def node(self, path: str) -> dict[str, Any]:
        """A device node ``path`` (``/dev/...``) at the host's dev root."""
        host = self._host_nodes.get(path)
        if host is None:  # the same few nodes in every spec: pathlib's work done once each
            host = self._host_nodes.setdefault(path, str(under(self.host_dev_root, path)))
        return {"path": path, "hostPath": host}

    def device_id(self, claim_uid: str, device_name: str) -> str:
        """The fully qualified CDI device id: ``k8s.<driver>/claim=<claimUID>-<deviceName>``."""
        return f"{self.kind}={self._device_name(claim_uid, device_name)}"

    def path(self, claim_uid: str) -> Path:
        """The spec file of a claim: ``<cdi_root>/k8s.<driver>-claim_<claimUID>.json``."""
        return self.cdi_root / f"k8s.{self.driver_name}-claim_{check_claim_uid(claim_uid)}.json"

    @staticmethod
    def _device_name(claim_uid: str, device_name: str) -> str:
        return f"{check_claim_uid(claim_uid)}-{check_device_name(device_name)}"

    # -- MIG capability nodes --------------------------------------------------------------
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
        nodes = []
        for access in (gi_dir / "access", gi_dir / f"ci{ci}" / "access"):
            minor, mode = read_caps(access)
            path = f"/dev/nvidia-caps/nvidia-cap{minor}"
            nodes.append(self._caps_node(path, minor, mode))
        return nodes

    def _caps_node(self, path: str, minor: int, mode: int) -> dict[str, Any]:
        """The capability node ``path``, made (``mknod``) when missing: under the dev root, or,
        where that is a read-only mount (the container-driver component's driver root), in the
        host's ``/dev`` (``caps_fallback_root``), as ``nvidia-modprobe`` makes it there (NVIDIA's
        DRA driver gives the runtime the numbers instead, k8s-dra-driver-gpu
        cmd/gpu-kubelet-plugin/cdi.go ``GetDevNodesForMigDevice``; a node on the host also
        serves the agent's MPS daemons)."""
        roots = [(self.dev_root, self.host_dev_root)]  # (where the agent sees it, the host)
        if self.caps_fallback_root != self.dev_root:
            roots.append((self.caps_fallback_root, self.caps_fallback_root))
        found = [host for seen, host in roots if under(seen, path).exists()]
        if found:
            return {"path": path, "hostPath": str(under(found[0], path))}
        major = read_char_major(self.driver_root, NVIDIA_CAPS)
        if major is None:
            raise CdiError(
                f"MIG capability node {under(self.dev_root, path)} is missing and cannot be"
                f" made: no '{NVIDIA_CAPS}' character device in"
                f" {under(self.driver_root, '/proc/devices')} (is the nvidia-caps part of the"
                " driver loaded?)"
            )
        for i, (seen, host) in enumerate(roots):
            node = under(seen, path)
            try:
                self.make_node(node, major, minor, mode)
            except FileExistsError:
                pass  # made meanwhile (another claim on the same instance)
            except OSError as exc:
                if exc.errno == errno.EROFS and i + 1 < len(roots):
                    continue  # a read-only dev root: the host's /dev next
                raise CdiError(
                    f"cannot make MIG capability node {node} (char {major}:{minor}):"
                    f" {exc.strerror or exc}; the agent needs CAP_MKNOD and the host's /dev"
                    " writable"
                ) from exc
            return {"path": path, "hostPath": str(under(host, path))}
        raise AssertionError("unreachable: the last root makes the node or raises")

    def _vfio_node(self, path: str) -> dict[str, Any]:
        """A VFIO node: under the dev root where it is there (the simulator's), else the host's."""
        here = under(self.dev_root, path).exists()
        root = self.host_dev_root if here else self.caps_fallback_root
        return {"path": path, "hostPath": str(under(root, path))}

    def build_base_spec(self) -> dict[str, Any]:
        """The base spec: the driver's files and the control device nodes. Pure apart from
        reading the driver root (at construction)."""
        edits: dict[str, Any] = {"deviceNodes": [self.node(p) for p in CONTROL_NODES]}
        driver = DriverEdits(self.files, self.host, self.hook)
        mounts = driver.library_mounts() + driver.file_mounts()
        if mounts:
            edits["mounts"] = mounts
        hooks = driver.hooks()
        if hooks:
            edits["hooks"] = hooks
        spec: dict[str, Any] = {
            "cdiVersion": CDI_VERSION,
            "kind": self.base_kind,
            "devices": [
                {
                    "name": BASE_DEVICE,
                    "containerEdits": {"env": [f"TESSERA_DRIVER_VERSION={self.driver_version}"]},
                }
            ],
            "containerEdits": edits,
        }
        validate_spec(spec)
        return spec

    def write_base(self) -> Path:
        """Write the base spec (atomically, mode 0644) unless the file holds it already (a start
        on a full disk then writes nothing); returns its path. CdiError when it cannot be
        written: the next claim's :meth:`write` tries again."""
        spec = self.build_base_spec()
        self._atomic(self.base_path, spec)
        self._base_current = True
        return self.base_path

    def build_spec(
        self, claim_uid: str, devices: Sequence[CdiRequest], mps: MpsEdits | None = None
    ) -> dict[str, Any]:
        """The CDI spec of a claim with ``devices`` (and its MPS daemon's directories): their
        device nodes and the claim's env; the driver's files are in the base spec. Reads the
        driver root and makes missing MIG capability nodes. Checked against the CDI schema.

        Raises CdiError for a bad claim UID or device name, a duplicate device, no devices, or a
        MIG device whose capability files are missing (or whose node cannot be made).
        """
        spec = self._claim_spec(claim_uid, devices, mps)
        validate_spec(spec)
        return spec

    def _claim_spec(
        self, claim_uid: str, devices: Sequence[CdiRequest], mps: MpsEdits | None
    ) -> dict[str, Any]:
        """``build_spec`` without the schema check (see ``write_claim``)."""
        check_claim_uid(claim_uid)
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
            nodes = [self.node(f"/dev/nvidia{req.gpu_minor}")]
            if req.vfio_group is not None:  # a VM's: VFIO's container and the group's node
                nodes = [self._vfio_node(f"/dev/vfio/{n}") for n in ("vfio", req.vfio_group)]
            elif req.gpu_instance_id is not None or req.compute_instance_id is not None:
                nodes += self._mig_nodes(req)
            cdi_devices.append({"name": name, "containerEdits": {"deviceNodes": nodes}})
            names.append(req.device_name)
        edits: dict[str, Any] = {
            "env": [f"TESSERA_CLAIM_UID={claim_uid}", f"TESSERA_DEVICES={','.join(names)}"],
        }
        if mps is not None:
            edits["env"].append(f"CUDA_MPS_PIPE_DIRECTORY={MPS_CONTAINER_PIPE_DIR}")
            edits["mounts"] = [
                {"hostPath": mps.pipe_dir, "containerPath": MPS_CONTAINER_PIPE_DIR,
                 "options": ["rw", "nosuid", "nodev", "bind"]},
                {"hostPath": mps.shm_dir, "containerPath": "/dev/shm",
                 "options": ["rw", "nosuid", "nodev", "bind"]},
            ]  # fmt: skip
        spec: dict[str, Any] = {
            "cdiVersion": CDI_VERSION,
            "kind": self.kind,
            "devices": cdi_devices,
            "containerEdits": edits,
        }
        return spec

    def device_nodes(
        self, claim_uid: str, devices: Sequence[CdiRequest]
    ) -> dict[str, tuple[str, ...]]:
        """The device nodes (container paths) the claim's spec gives each device now: what
        ``build_spec`` would write (reads the driver root's MIG capability files; raises
        CdiError as ``build_spec``)."""
        if not devices:
            return {}
        spec = self.build_spec(claim_uid, devices)
        prefix = f"{claim_uid}-"
        return {
            d["name"].removeprefix(prefix): node_paths(d["containerEdits"]) for d in spec["devices"]
        }

    def _atomic(self, path: Path, spec: dict[str, Any], compare: bool = True) -> None:
        """Replace ``path`` with ``spec`` atomically (a runtime never reads half a spec), without
        fsync: a spec is derived state. A process's death keeps it (the page cache is the
        kernel's); only a power loss or a kernel crash can lose it, and that is a reboot, after
        which the checkpoint of the earlier boot is discarded and the start removes every spec
        written before the boot (``reconcile``); a completed claim's missing spec is written
        again from the checkpoint (at start, and by the kubelet's repeated prepare). On a real
        node the CDI root is ``/var/run/cdi``, a tmpfs, where an fsync does nothing anyway.
        ``compare``: a file that holds ``spec`` already is left as it is (no write: a start on a
        full disk rewrites nothing it has)."""
        data = indented_json(spec)
        if compare and holds(path, data):
            return
        try:
            atomic_write(path, data, mode=SPEC_FILE_MODE, dir_mode=CDI_DIR_MODE, sync=False)
        except OSError as exc:
            raise CdiError(f"cannot write CDI spec {path}: {exc.strerror or exc}") from exc

    def write(self, claim_uid: str, spec: dict[str, Any]) -> Path:
        """Validate ``spec`` and write it atomically as the claim's spec file (mode 0644); the
        base spec its devices also name is written first when it is missing."""
        path = self.path(claim_uid)
        validate_spec(spec)
        if spec["kind"] != self.kind:
            raise CdiError(f"CDI spec kind {spec['kind']!r} is not this driver's {self.kind!r}")
        self.ensure_base()
        self._atomic(path, spec)
        return path

    def write_claim(
        self,
        claim_uid: str,
        devices: Sequence[CdiRequest],
        mps: MpsEdits | None = None,
        *,
        fresh: bool = False,
    ) -> Path:
        """Build and write the claim's spec (``build_spec``, then ``write``) on the prepare
        path, without checking the result against the JSON schema each time: the builder makes
        every spec from the same few shapes, which the tests check against the schema (whole
        GPUs, MIG devices, MPS directories: tests/dra_driver/test_cdi.py); the claim UID and
        device names are checked as they go in. Raises CdiError as both.

        ``fresh``: a prepare's write of the spec it just made, in a batch that called
        :meth:`ensure_base` first: neither the base spec nor the file's contents are looked at
        (two system calls of the seven a spec costs, for each claim of a batch)."""
        path = self.path(claim_uid)
        spec = self._claim_spec(claim_uid, devices, mps)
        if not fresh:
            self.ensure_base()
        self._atomic(path, spec, compare=not fresh)
        return path

    def ensure_base(self) -> None:
        """Write the base spec when this process has not written it yet, or it is gone."""
        if self._base_current and self.base_path.exists():
            return
        with self._base_lock:
            if not self._base_current or not self.base_path.exists():
                self.write_base()

    def remove_many(self, claim_uids: Sequence[str]) -> dict[str, CdiError]:
        """Delete the specs of several released claims (unprepare, after the release is
        durable); returns the claims whose spec could not be removed, with the error.
        Idempotent. The directory is not synced: a process's death keeps the removal (the
        page cache is the kernel's), and a power loss means a reboot, after which the start
        removes every spec written before the boot (``reconcile``)."""
        errors: dict[str, CdiError] = {}
        for uid in claim_uids:
            try:
                self.remove(uid)
            except CdiError as exc:
                errors[uid] = exc
        return errors

    def remove(self, claim_uid: str) -> bool:
        """Delete the claim's spec file; True if there was one. Idempotent; not synced (see
        ``remove_many``)."""
        path = self.path(claim_uid)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            if not os.path.lexists(path):  # a read-only file system says so before ENOENT
                return False
            raise CdiError(f"cannot remove CDI spec {path}: {exc.strerror or exc}") from exc
        return True

    def evidence(self, claim_uid: str) -> tuple[tuple[str, ...], float]:
        """What the claim's spec file says was prepared: the pool device names it exposes (from
        its CDI device names ``<claimUID>-<device>``) and when it was written (unix seconds).
        Raises CdiError when it cannot be read or is not a spec of ours."""
        found = self.read_evidence(claim_uid)
        return found.devices, found.written_at

    def written_at(self, claim_uid: str, default: float) -> float:
        """When the claim's spec file was last written (unix seconds), even when it cannot be
        read as a spec; ``default`` when it cannot be looked at."""
        try:
            return self.path(claim_uid).lstat().st_mtime
        except (OSError, CdiError):
            return default

    def read_evidence(self, claim_uid: str) -> SpecEvidence:
        """Everything the claim's spec file says (see ``SpecEvidence``). Raises CdiError when it
        cannot be read or is not a spec of ours; fields of the wrong shape read as absent."""
        path = self.path(claim_uid)
        try:
            # the CDI root is shared with other vendors' tools: a FIFO, a link to /dev/zero or a
            # huge file named like our spec must not hang or bloat the agent (read_regular_file)
            data = read_regular_file(path, MAX_SPEC_BYTES)
            written_at = path.lstat().st_mtime
            spec = load_json(data, str(path), MAX_SPEC_BYTES)
        except OSError as exc:
            raise CdiError(f"cannot read CDI spec {path}: {exc.strerror or exc}") from exc
        except DecodeError as exc:
            raise CdiError(str(exc)) from exc
        return spec_evidence(spec, claim_uid, self.kind, str(path), written_at)

    def remove_temp_files(self) -> list[Path]:
        """Temporary files of our specs that a crash left behind in the CDI root (only ours:
        the directory is shared with other vendors)."""
        return remove_temp_files(
            self.cdi_root, f"k8s.{self.driver_name}-claim_*.json"
        ) + remove_temp_files(self.cdi_root, self.base_path.name)

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
