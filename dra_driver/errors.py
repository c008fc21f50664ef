"""Errors of the DRA driver (``dra_driver``)::

TesseraError
├── KubeError                the API server said no, or could not be reached
│   └── KubeConflict         409: someone else changed the object; re-read and retry
├── KubeletApiError          a kubelet-plugin gRPC call failed (gRPC status name, details)
├── ClaimError               a ResourceClaim that cannot be prepared here (per-claim error)
├── ParamsError              opaque device configuration that does not parse or validate
├── QuantityError            text that is not a Kubernetes resource quantity (``4Gi``)
├── CheckpointError          the driver checkpoint cannot be read or written
│   ├── CheckpointCorrupt    unreadable JSON, bad checksum, wrong kind or field types
│   └── CheckpointTooNew     written by a newer Tessera (upgrade or move the file aside)
└── CdiError                 a CDI spec that cannot be built, validated, written or removed
"""

from __future__ import annotations

import errno

from agent.errors import TesseraError

DISK_REASONS = {errno.ENOSPC: "disk_full", errno.EDQUOT: "disk_full", errno.EROFS: "disk_read_only"}
"""The file-system errors a metric names by themselves (``tessera_prepare_errors_total{reason}``):
the operator's fix is the disk, not the claim."""


def disk_reason(exc: BaseException) -> str | None:
    """``disk_full`` or ``disk_read_only`` when the file-system error behind ``exc`` (its chain
    of ``raise ... from``) is one of ``DISK_REASONS``; None otherwise."""
    cause: BaseException | None = exc
    for _ in range(8):  # a chain is a few links long; never loop on a cycle
        if cause is None:
            return None
        if isinstance(cause, OSError) and cause.errno in DISK_REASONS:
            return DISK_REASONS[cause.errno]
        cause = cause.__cause__
    return None


class KubeError(TesseraError):
    """An API-server request failed. ``status`` is the HTTP status (0: no response at all).

    ``retry_after`` is how many seconds the server asked us to wait before trying again (its
    ``Retry-After`` on a 429 or 5xx, already checked and bounded by ``dra_driver.cluster.kube``), or
    None when it asked nothing: whoever retries waits at least that long, and never less than
    its own backoff."""

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        method: str,
        path: str,
        *,
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.reason = reason
        self.method = method
        self.path = path
        self.retry_after = retry_after
        self.temporary = status in (0, 408, 429) or status >= 500
        super().__init__(f"{method} {path}: {status} {reason}: {message}")

    def retry_delay(self, backoff: float) -> float:
        """How long to wait before the next attempt: ``backoff``, or the server's Retry-After
        when that is longer."""
        return backoff if self.retry_after is None else max(backoff, self.retry_after)


class KubeConflict(KubeError):
    """409 Conflict: the object changed since it was read."""


class KubeMalformed(KubeError):
    """The API server (or something in between) answered with something that is not what the
    API promises: a body that is not JSON, a list that is not a list, a watch line that does not
    parse. Untrusted input: the call failed, and a retry later may succeed."""

    def __init__(self, message: str, method: str, path: str, status: int = 200) -> None:
        super().__init__(status, "MalformedResponse", message, method, path)
        self.temporary = True


class ClaimError(TesseraError):
    """A claim cannot be prepared: not found, UID mismatch, not allocated, another node, …

    ``reason`` is a short stable word for metrics (``tessera_prepare_errors_total{reason}``)."""

    def __init__(self, message: str, reason: str = "invalid_claim") -> None:
        self.reason = reason
        super().__init__(message)


class ParamsError(TesseraError):
    """Opaque configuration parameters that do not parse or validate (the message has the path,
    the offending value and what is allowed)."""


class QuantityError(TesseraError):
    """Text that is not a Kubernetes resource quantity (the message has the text, the problem
    and the allowed forms). Callers that know where the text came from wrap it with the path."""


class KubeletApiError(TesseraError):
    """A gRPC call on a kubelet plugin socket failed.

    ``method`` is the full gRPC method name, ``socket`` the unix socket path, ``code`` the gRPC
    status name (e.g. ``"UNAVAILABLE"``) and ``details`` the status message.
    """

    def __init__(self, method: str, socket: str, code: str, details: str) -> None:
        self.method = method
        self.socket = socket
        self.code = code
        self.details = details
        self.temporary = code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
        super().__init__(f"{method} on {socket}: {code}: {details}")


class CheckpointError(TesseraError):
    """The driver's checkpoint file could not be read or written (the message names the file).

    ``reason``: ``disk_full`` or ``disk_read_only`` when the disk said so (``disk_reason``),
    else None (the metric then names the class)."""

    @property
    def reason(self) -> str | None:
        return disk_reason(self)


class CheckpointCorrupt(CheckpointError):
    """The checkpoint is not valid JSON, fails its checksum, or has the wrong kind or types."""


class CheckpointTooNew(CheckpointError):
    """The checkpoint was written by a newer Tessera whose format this build cannot read.

    ``path`` is the file, ``version`` its format version, ``supported`` the newest this build reads.
    """

    def __init__(self, path: str, version: int, supported: int) -> None:
        self.path = path
        self.version = version
        self.supported = supported
        super().__init__(
            f"checkpoint {path} has format version {version}, but this Tessera reads versions up"
            f" to {supported}: upgrade Tessera or move the file aside"
        )


class CdiError(TesseraError):
    """A CDI spec could not be built, validated, written or removed (the message says why).

    ``reason`` as CheckpointError's."""

    @property
    def reason(self) -> str | None:
        return disk_reason(self)


class SharingError(TesseraError):
    """A partition or a sharing setting could not be made or undone (MIG, time-slicing, MPS).

    ``reason`` is a short stable word for metrics, like ClaimError's."""

    def __init__(self, message: str, reason: str = "sharing_error") -> None:
        self.reason = reason
        super().__init__(message)


class ToolError(SharingError):
    """An NVIDIA tool (nvidia-smi, nvidia-cuda-mps-control) failed, timed out or could not run.

    ``command`` is what was run, ``code`` its exit status (None: it did not finish)."""

    def __init__(self, message: str, command: str = "", code: int | None = None) -> None:
        self.command = command
        self.code = code
        super().__init__(message, "tool_error")
