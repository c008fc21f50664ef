"""Write and remove the KEP-5304 metadata files of prepared claims and their CDI specs (the
documents: ``documents``).

Order, for crash safety: a request's CDI spec is written before its metadata file and removed
after it, so a metadata file never exists without the spec that names it (the spec's file name
carries the claim UID, the metadata file's path only the claim's namespace and name). The start
(``sweep``) removes the specs and files of every claim the checkpoint does not hold, and the
temporary files a crash left. Every file is replaced atomically (``agent.fsutil.atomic_write``);
the Go helper writes in place (``os.WriteFile``), which a reader could see half-written.

A claim deleted and made again with the same name while the old one is still prepared would
share the old one's metadata directory (the helper keys it by namespace and name): removing the
old one leaves a file that names the new claim's UID in place.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path, PurePosixPath

from agent.fsutil import atomic_write, fsync_dir, holds, read_regular_file, remove_temp_files
from dra_driver.errors import CdiError
from dra_driver.kubeletplugin.cdi_spec import (
    CLAIM_UID_RE,
    DNS_LABEL_RE,
    DNS_SUBDOMAIN_RE,
    check_claim_uid,
    validate_spec,
)
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.device_metadata.documents import (
    HOST_FILE,
    HOST_SUBDIR,
    MetadataDevice,
    base_request,
    cdi_device_name,
    cdi_kind,
    cdi_spec,
    cdi_spec_bytes,
    container_path,
    metadata_stream,
)

FILE_MODE = 0o644
DIR_MODE = 0o755
"""The helper's ``metadataFilePerms`` and ``metadataDirPerms``."""
MAX_FILE_BYTES = 1 << 20
"""A spec or metadata file of ours is a few KiB: one larger is not read (see ``_read``)."""


def _label(what: str, value: str) -> str:
    if not isinstance(value, str) or not DNS_LABEL_RE.fullmatch(value):
        raise CdiError(
            f"{what} {value!r} is not a DNS label (at most 63 of a-z, 0-9 and '-', starting and"
            " ending alphanumeric); refusing to build a metadata path from it"
        )
    return value


def _request_ref(request: str) -> str:
    """``req`` or ``req/sub``, each a DNS label (as the API server validates them)."""
    base, slash, sub = request.partition("/")
    _label("request name", base)
    if slash:
        _label("subrequest name", sub)
    return request


class DeviceMetadataWriter:
    """The KEP-5304 files of one driver: metadata under ``plugin_dir`` (the driver's kubelet
    plugin data directory, ``<kubelet plugins dir>/<driver>``, the same path on the host), CDI
    specs in ``cdi_dir``."""

    def __init__(self, plugin_dir: Path, cdi_dir: Path, driver: str) -> None:
        if not DNS_SUBDOMAIN_RE.fullmatch(driver) or len(driver) > 253:
            raise CdiError(f"driver name {driver!r} is not a lower-case DNS subdomain")
        self.root = Path(plugin_dir).absolute() / HOST_SUBDIR
        self.cdi_dir = Path(cdi_dir)
        self.driver = driver
        self._spec_re = re.compile(
            rf"^{re.escape(driver)}_metadata_({CLAIM_UID_RE.pattern[1:-1]})_"
            rf"({DNS_LABEL_RE.pattern[1:-1]})\.json$"
        )

    # -- names -------------------------------------------------------------------------------
    def device_id(self, claim_uid: str, request: str) -> str:
        """``<driver>/metadata=<claimUID>_<request>`` (``request``: the base request)."""
        return f"{cdi_kind(self.driver)}={cdi_device_name(claim_uid, request)}"

    def spec_path(self, claim_uid: str, request: str) -> Path:
        return self.cdi_dir / f"{self.driver}_metadata_{claim_uid}_{request}.json"

    def host_path(self, namespace: str, name: str, request: str) -> Path:
        return self.root / f"{namespace}_{name}" / request / HOST_FILE

    # -- prepare -----------------------------------------------------------------------------
    def write(
        self,
        claim: ClaimKey,
        pod_claim_name: str | None,
        requests: Mapping[str, Sequence[MetadataDevice]],
    ) -> list[str]:
        """Write each request's CDI spec, then its metadata file; the CDI device ids to hand
        the kubelet, one per base request in the order of ``requests`` (request as allocated,
        ``req`` or ``req/sub`` -> its devices, in the order the kubelet is answered). Raises
        CdiError naming the file or the value that is wrong."""
        check_claim_uid(claim.uid)
        _label("claim namespace", claim.namespace)
        if not DNS_SUBDOMAIN_RE.fullmatch(claim.name) or len(claim.name) > 253:
            raise CdiError(f"claim name {claim.name!r} is not a DNS subdomain")
        if pod_claim_name:
            _label(
                "pod claim name (annotation resource.kubernetes.io/pod-claim-name)", pod_claim_name
            )
        ids: list[str] = []
        for request, devices in requests.items():
            base = base_request(_request_ref(request))
            host = self.host_path(claim.namespace, claim.name, base)
            in_container = container_path(self.driver, claim.name, pod_claim_name, base)
            spec = cdi_spec(self.driver, claim.uid, base, str(host), in_container)
            validate_spec(spec)
            try:
                data = metadata_stream(self.driver, claim, pod_claim_name, request, devices)
            except ValueError as exc:
                raise CdiError(f"claim {claim}: request {request!r}: {exc}") from exc
            self._write(self.spec_path(claim.uid, base), cdi_spec_bytes(spec), "CDI spec")
            self._write(host, data, "device metadata")
            device_id = self.device_id(claim.uid, base)
            if device_id not in ids:
                ids.append(device_id)
        return ids

    @staticmethod
    def _write(path: Path, data: bytes, what: str) -> None:
        if holds(path, data):
            return
        try:
            atomic_write(path, data, mode=FILE_MODE, dir_mode=DIR_MODE)
        except OSError as exc:
            raise CdiError(f"cannot write {what} {path}: {exc.strerror or exc}") from exc

    # -- unprepare and the start -------------------------------------------------------------
    def claim_uids(self) -> set[str]:
        """The claims that have a metadata CDI spec here (only names this driver writes)."""
        return {uid for uid, _, _ in self._specs()}

    def remove(self, claim_uid: str) -> bool:
        """Remove the claim's metadata files, then their CDI specs; True if there was any.
        Idempotent. Raises CdiError naming the file that cannot be removed."""
        check_claim_uid(claim_uid)
        specs = [(req, p) for uid, req, p in self._specs() if uid == claim_uid]
        for _, spec in specs:
            host = self._mounted_file(spec)
            if host is not None and self._uid_of(host) in (claim_uid, None):
                self._unlink(host, "device metadata")
                self._prune(host.parent)
        for _, spec in specs:
            self._unlink(spec, "CDI spec")
        if specs:
            self._sync(self.cdi_dir)
        return bool(specs)

    def remove_many(self, claim_uids: Sequence[str]) -> dict[str, CdiError]:
        """``remove`` each claim; those whose files could not be removed, with the error."""
        errors: dict[str, CdiError] = {}
        for uid in claim_uids:
            try:
                self.remove(uid)
            except CdiError as exc:
                errors[uid] = exc
        return errors

    def sweep(self, keep: Collection[str]) -> list[str]:
        """At start: remove the files of every claim not in ``keep`` (UIDs the checkpoint
        holds), metadata files naming no kept claim, and temporary files a crash left; the
        UIDs whose files were removed."""
        removed = sorted(self.claim_uids() - set(keep))
        for uid in removed:
            self.remove(uid)
        remove_temp_files(self.cdi_dir, f"{self.driver}_metadata_*.json")
        for claim_dir in self._dirs(self.root):
            for request_dir in self._dirs(claim_dir):
                remove_temp_files(request_dir, HOST_FILE)
                host = request_dir / HOST_FILE
                if host.exists() and self._uid_of(host) not in keep:
                    self._unlink(host, "device metadata")
                self._prune(request_dir)
        return removed

    # -- helpers -----------------------------------------------------------------------------
    def _specs(self) -> list[tuple[str, str, Path]]:
        try:
            names = sorted(p.name for p in self.cdi_dir.iterdir())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CdiError(f"cannot list {self.cdi_dir}: {exc.strerror or exc}") from exc
        return [
            (m.group(1), m.group(2), self.cdi_dir / n)
            for n in names
            if (m := self._spec_re.fullmatch(n))
        ]

    @staticmethod
    def _dirs(path: Path) -> list[Path]:
        try:
            return sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CdiError(f"cannot list {path}: {exc.strerror or exc}") from exc

    @staticmethod
    def _read(path: Path) -> object:
        """The first JSON value of a file of ours; None when it is unreadable or not JSON. A
        FIFO or a huge file under a name of ours is not read (``read_regular_file``)."""
        try:
            text = read_regular_file(path, MAX_FILE_BYTES).decode()
            return json.JSONDecoder().raw_decode(text)[0]
        except (OSError, ValueError):
            return None

    def _mounted_file(self, spec: Path) -> Path | None:
        """The metadata file a spec of ours mounts, when it lies under ``root`` (a spec edited
        to name another file never makes us remove that file)."""
        doc = self._read(spec)
        try:
            mount = doc["devices"][0]["containerEdits"]["mounts"][0]  # type: ignore[index]
            host = PurePosixPath(mount["hostPath"])
        except (KeyError, IndexError, TypeError):
            return None
        if ".." in host.parts or not host.is_relative_to(self.root):
            return None
        return Path(host)

    def _uid_of(self, host: Path) -> str | None:
        """The claim UID a metadata file names; None when it cannot be read."""
        doc = self._read(host)
        try:
            uid = doc["metadata"]["uid"]  # type: ignore[index]
        except (KeyError, TypeError):
            return None
        return uid if isinstance(uid, str) else None

    @staticmethod
    def _unlink(path: Path, what: str) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            if not os.path.lexists(path):
                return
            raise CdiError(f"cannot remove {what} {path}: {exc.strerror or exc}") from exc

    def _prune(self, request_dir: Path) -> None:
        """Remove the request's directory and its claim's once empty."""
        for d in (request_dir, request_dir.parent):
            if d == self.root or not d.is_relative_to(self.root):
                return
            try:
                d.rmdir()
            except FileNotFoundError:
                continue
            except OSError:  # not empty (another request, another file): kept
                return

    @staticmethod
    def _sync(directory: Path) -> None:
        try:
            fsync_dir(directory)
        except OSError as exc:
            raise CdiError(f"cannot sync {directory}: {exc.strerror or exc}") from exc
