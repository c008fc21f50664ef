"""Errors of the API-server emulator, answered as real ``Status`` objects.

The messages follow the real API server's wording, so a client that logs or matches them sees
what it would see against a cluster.
"""

from __future__ import annotations

from typing import Any

from agent.sim.apiserver_types import ResourceType


class ApiError(Exception):
    """An error answer: HTTP ``code``, Status ``reason`` and ``message``."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> dict[str, Any]:
        """The ``Status`` object of this error."""
        return status_object(self.code, self.reason, self.message, self.details)


def status_object(
    code: int, reason: str, message: str, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A failure ``Status`` (``kind: Status``, ``apiVersion: v1``)."""
    out: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
    }
    if details:
        out["details"] = details
    out["code"] = code
    return out


def _details(rt: ResourceType, name: str, kind: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "kind": kind or rt.plural}
    if rt.group:
        out["group"] = rt.group
    return out


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(
        404, "NotFound", f'{rt.qualified} "{name}" not found', details=_details(rt, name)
    )


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{rt.qualified} "{name}" already exists', details=_details(rt, name)
    )


def conflict(rt: ResourceType, name: str, why: str | None = None) -> ApiError:
    why = why or (
        "the object has been modified; please apply your changes to the latest version"
        " and try again"
    )
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}',
        details=_details(rt, name),
    )


def invalid(rt: ResourceType, name: str, field: str, cause: str, message: str) -> ApiError:
    """422 Invalid; ``cause`` is a FieldValue* reason, ``message`` its text."""
    details = _details(rt, name, rt.kind)
    details["causes"] = [{"reason": cause, "message": message, "field": field}]
    return ApiError(
        422,
        "Invalid",
        f'{rt.qualified_kind} "{name}" is invalid: {field}: {message}',
        details=details,
    )


def invalid_fields(rt: ResourceType, name: str, errors: list[tuple[str, str, str]]) -> ApiError:
    """422 Invalid with one cause per (field, reason, body), worded as apimachinery's
    ``errors.NewInvalid``: one error as ``field: body``, several as ``[a: x, b: y]``."""
    details = _details(rt, name, rt.kind)
    details["causes"] = [{"reason": r, "message": b, "field": f} for f, r, b in errors]
    said = [f"{f}: {b}" for f, _, b in errors]
    text = said[0] if len(said) == 1 else f"[{', '.join(said)}]"
    return ApiError(
        422, "Invalid", f'{rt.qualified_kind} "{name}" is invalid: {text}', details=details
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def gone(message: str) -> ApiError:
    """410 as the watch cache answers a too old resourceVersion."""
    return ApiError(410, "Expired", message)


def internal(message: str) -> ApiError:
    return ApiError(500, "InternalError", f"Internal error occurred: {message}")


def path_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")


def method_not_allowed(method: str, what: str) -> ApiError:
    return ApiError(
        405, "MethodNotAllowed", f"the server does not allow this method ({method}) on {what}"
    )


def _retry_after(value: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The Status details and headers of an answer asking for a wait of ``value`` (as written;
    the details carry it only when it is a number, as the server fills them in)."""
    if value is None:
        return {}, {}
    details = {"retryAfterSeconds": int(value)} if value.isdigit() and len(value) < 10 else {}
    return details, {"Retry-After": value}


def injected(kind: str, path: str, retry_after: str | None = None) -> ApiError:
    """The error answer of an injected fault kind ``"409"``, ``"429"``, ``"500"`` or ``"503"``;
    ``retry_after`` is its Retry-After header (a 429 has ``1`` unless told otherwise)."""
    if kind == "409":
        return ApiError(
            409,
            "Conflict",
            f"Operation cannot be fulfilled on {path}: the object has been modified; please"
            " apply your changes to the latest version and try again",
        )
    details, headers = _retry_after(retry_after)
    if kind == "429":
        if retry_after is None:
            details, headers = _retry_after("1")
        return ApiError(
            429,
            "TooManyRequests",
            "the server has received too many requests and has asked us to try again later",
            details=details,
            headers=headers,
        )
    if kind == "500":
        error = internal("injected fault")
        error.details, error.headers = details or None, headers
        return error
    if kind == "503":
        return ApiError(
            503,
            "ServiceUnavailable",
            "the server is currently unable to handle the request",
            details=details or None,
            headers=headers,
        )
    raise ValueError(f"not an error fault kind: {kind!r}")
