"""A kubelet-side client for DRA plugins: what a real kubelet does over the plugin's sockets.

The kubelet speaks insecure gRPC over unix sockets to two sockets of a DRA plugin:

* the registration socket (``/var/lib/kubelet/plugins_registry/<driver>-reg.sock``), service
  ``pluginregistration.Registration``: ``GetInfo`` then ``NotifyRegistrationStatus``;
* the service socket named by ``PluginInfo.endpoint``: ``DRAPlugin`` (v1 or v1beta1) with
  ``NodePrepareResources`` / ``NodeUnprepareResources``, and ``v1alpha1.DRAResourceHealth``
  with the server-streaming ``NodeWatchResources``.

:class:`KubeletClient` talks to one socket; :func:`register_like_kubelet` performs the kubelet's
registration handshake. Responses come back as plain dicts with camelCase keys, every key
always present (an empty ``error`` is ``""``, no devices is ``[]``); ``shareId`` appears on a
v1 device only when the plugin set it. Failed calls raise :class:`KubeletApiError`.

This is a debugging and test tool (``tessera kubelet ...``); the agent itself never uses it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, cast

import grpc  # type: ignore[import-untyped,unused-ignore]
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message import Message

from dra_driver.errors import KubeletApiError
from dra_driver.kubeletapi import (
    dra_v1_pb2,
    dra_v1beta1_pb2,
    health_v1alpha1_pb2,
    registration_pb2,
)
from dra_driver.testkubelet.calls import (
    APIS,
    DRA_PLUGIN_TYPE,
    KUBELET_CALL_TIMEOUT,
    KUBELET_KNOWN_VERSIONS,
    MAX_MESSAGE_BYTES,
    REGISTRATION_TIMEOUT,
    ClaimRef,
)

_DRA_MODULES: Final[dict[str, Any]] = {"v1": dra_v1_pb2, "v1beta1": dra_v1beta1_pb2}


def _check_api(api: str) -> Any:
    if api not in _DRA_MODULES:
        raise ValueError(f"unknown DRA API version {api!r}: use one of {', '.join(APIS)}")
    return _DRA_MODULES[api]


def _method(module: Any, service: str, rpc: str) -> str:
    """The full gRPC method name (``/package.Service/Rpc``) from the generated descriptor."""
    descriptor: FileDescriptor = module.DESCRIPTOR
    svc = descriptor.services_by_name[service]
    return f"/{svc.full_name}/{svc.methods_by_name[rpc].name}"


def _unimplemented(socket: str, method: str) -> str:
    service = method.strip("/").split("/")[0]
    if "DRAResourceHealth" in service:  # optional: a DRA plugin may not offer health
        return (
            f"{socket} does not serve {service}: the plugin has no health stream, or this is not"
            " its DRA socket (<plugins>/<driver>/dra.sock)"
        )
    kind = "registration socket" if "Registration" in service else "DRA socket"
    return (
        f"{socket} is not a DRA plugin's {kind}: it does not serve {service} (the registration"
        " socket is <plugins_registry>/<driver>-reg.sock, the DRA socket"
        " <plugins>/<driver>/dra.sock)"
    )


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _device_to_dict(dev: Any, api: str) -> dict[str, Any]:
    d: dict[str, Any] = {
        "requestNames": list(dev.request_names),
        "poolName": dev.pool_name,
        "deviceName": dev.device_name,
        "cdiDeviceIds": list(dev.cdi_device_ids),
    }
    if api == "v1" and dev.HasField("share_id"):
        d["shareId"] = dev.share_id
    return d


def _health_to_dict(dh: health_v1alpha1_pb2.DeviceHealth) -> dict[str, Any]:
    return {
        "poolName": dh.device.pool_name,
        "deviceName": dh.device.device_name,
        "health": health_v1alpha1_pb2.HealthStatus.Name(dh.health),
        "lastUpdatedTime": int(dh.last_updated_time),
        "healthCheckTimeoutSeconds": int(dh.health_check_timeout_seconds),
    }


class KubeletClient:
    """Speaks to a DRA plugin like the kubelet does (insecure gRPC over unix sockets).

    One client talks to one socket: the registration socket for :meth:`get_info` and
    :meth:`notify_registration`, the service socket for :meth:`prepare`, :meth:`unprepare`
    and :meth:`watch_health`. ``timeout`` bounds each unary call.
    """

    def __init__(self, socket: Path, *, timeout: float = KUBELET_CALL_TIMEOUT) -> None:
        self.socket = Path(os.path.abspath(socket))
        self.timeout = timeout
        self._channel: Any = grpc.insecure_channel(
            f"unix://{self.socket}",
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self._closed = False

    def close(self) -> None:
        """Close the channel (idempotent); open watch streams are cancelled."""
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> KubeletClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------

    def _ensure_socket(self, method: str) -> None:
        if self._closed:
            raise RuntimeError("KubeletClient is closed")
        if not os.path.exists(self.socket):
            raise KubeletApiError(
                method,
                str(self.socket),
                "UNAVAILABLE",
                f"no socket at {self.socket}: is the plugin running, and is this the right path?",
            )
        if not _is_socket(str(self.socket)):
            raise KubeletApiError(
                method, str(self.socket), "UNAVAILABLE", f"{self.socket} is not a unix socket"
            )

    def _error(self, method: str, exc: grpc.RpcError) -> KubeletApiError:
        code_obj = exc.code() if hasattr(exc, "code") else None
        code = code_obj.name if code_obj is not None else "UNKNOWN"
        details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
        if code == "UNAVAILABLE":
            details = f"cannot reach the plugin on {self.socket}: {details}"
        elif code == "UNIMPLEMENTED":
            # something answers, but not this service: e.g. the agent's telemetry socket
            details = _unimplemented(str(self.socket), method)
        return KubeletApiError(method, str(self.socket), code, details)

    def _unary(self, method: str, request: Message, response_type: type[Message]) -> Any:
        self._ensure_socket(method)
        call: Callable[..., Any] = self._channel.unary_unary(
            method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        try:
            return call(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._error(method, exc) from exc

    # -- registration socket --------------------------------------------------------------

    def get_info(self) -> dict[str, Any]:
        """``Registration.GetInfo``: ``{"type", "name", "endpoint", "supportedVersions"}``."""
        method = _method(registration_pb2, "Registration", "GetInfo")
        info = cast(
            registration_pb2.PluginInfo,
            self._unary(method, registration_pb2.InfoRequest(), registration_pb2.PluginInfo),
        )
        return {
            "type": info.type,
            "name": info.name,
            "endpoint": info.endpoint,
            "supportedVersions": list(info.supported_versions),
        }

    def notify_registration(self, registered: bool, error: str = "") -> None:
        """``Registration.NotifyRegistrationStatus``: tell the plugin whether it was accepted."""
        method = _method(registration_pb2, "Registration", "NotifyRegistrationStatus")
        self._unary(
            method,
            registration_pb2.RegistrationStatus(plugin_registered=registered, error=error),
            registration_pb2.RegistrationStatusResponse,
        )

    # -- DRA service socket ---------------------------------------------------------------

    def prepare(self, claims: Sequence[ClaimRef], api: str = "v1") -> dict[str, Any]:
        """``DRAPlugin.NodePrepareResources``.

        Returns ``{"claims": {uid: {"devices": [{"requestNames", "poolName", "deviceName",
        "cdiDeviceIds", ("shareId")}], "error": str}}}`` exactly as the plugin answered (a claim
        the plugin left out of its answer is absent here too).
        """
        mod = _check_api(api)
        method = _method(mod, "DRAPlugin", "NodePrepareResources")
        request = mod.NodePrepareResourcesRequest(claims=[self._claim(mod, c) for c in claims])
        resp = self._unary(method, request, mod.NodePrepareResourcesResponse)
        return {
            "claims": {
                uid: {
                    "devices": [_device_to_dict(d, api) for d in result.devices],
                    "error": result.error,
                }
                for uid, result in sorted(resp.claims.items())
            }
        }

    def unprepare(self, claims: Sequence[ClaimRef], api: str = "v1") -> dict[str, Any]:
        """``DRAPlugin.NodeUnprepareResources``: ``{"claims": {uid: {"error": str}}}``."""
        mod = _check_api(api)
        method = _method(mod, "DRAPlugin", "NodeUnprepareResources")
        request = mod.NodeUnprepareResourcesRequest(claims=[self._claim(mod, c) for c in claims])
        resp = self._unary(method, request, mod.NodeUnprepareResourcesResponse)
        return {
            "claims": {uid: {"error": result.error} for uid, result in sorted(resp.claims.items())}
        }

    @staticmethod
    def _claim(mod: Any, claim: ClaimRef) -> Any:
        return mod.Claim(namespace=claim.namespace, name=claim.name, uid=claim.uid)

    def watch_health(
        self, max_messages: int | None = None, timeout: float | None = None
    ) -> Iterator[list[dict[str, Any]]]:
        """``DRAResourceHealth.NodeWatchResources``: yield each message's device list.

        Each item is ``[{"poolName", "deviceName", "health": "HEALTHY"|"UNHEALTHY"|"UNKNOWN",
        "lastUpdatedTime", "healthCheckTimeoutSeconds"}]`` (every message is the complete list).
        Stops after ``max_messages`` messages, when the plugin ends the stream, or quietly when
        ``timeout`` seconds (the whole watch; None: no limit) have passed. Closing the iterator
        early cancels the stream.
        """
        if max_messages is not None and max_messages <= 0:
            return
        method = _method(health_v1alpha1_pb2, "DRAResourceHealth", "NodeWatchResources")
        self._ensure_socket(method)
        stream: Callable[..., Any] = self._channel.unary_stream(
            method,
            request_serializer=health_v1alpha1_pb2.NodeWatchResourcesRequest.SerializeToString,
            response_deserializer=health_v1alpha1_pb2.NodeWatchResourcesResponse.FromString,
        )
        call = stream(health_v1alpha1_pb2.NodeWatchResourcesRequest(), timeout=timeout)
        seen = 0
        try:
            while True:
                try:
                    msg = cast(health_v1alpha1_pb2.NodeWatchResourcesResponse, next(call))
                except StopIteration:
                    return
                except grpc.RpcError as exc:
                    if timeout is not None and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        return
                    raise self._error(method, exc) from exc
                yield [_health_to_dict(d) for d in msg.devices]
                seen += 1
                if max_messages is not None and seen >= max_messages:
                    return
        finally:
            call.cancel()


def check_plugin_info(info: dict[str, Any]) -> tuple[str, str]:
    """The kubelet's checks on PluginInfo: ``(chosen version, "")`` or ``("", reason)``."""
    if info["type"] != DRA_PLUGIN_TYPE:
        return "", f"plugin type {info['type']!r} is not {DRA_PLUGIN_TYPE!r}"
    if not info["name"]:
        return "", "plugin name (the driver name) is empty"
    endpoint = info["endpoint"]
    if not os.path.isabs(endpoint):
        return "", f"endpoint {endpoint!r} is not an absolute path"
    if not _is_socket(endpoint):
        what = "is not a unix socket" if os.path.exists(endpoint) else "does not exist"
        return "", f"endpoint {endpoint} {what}"
    for version in info["supportedVersions"]:
        if version in KUBELET_KNOWN_VERSIONS:
            return version, ""
    return "", (
        f"none of the plugin's supported versions {info['supportedVersions']} is known "
        f"(the kubelet speaks {', '.join(KUBELET_KNOWN_VERSIONS)})"
    )


def register_like_kubelet(
    registration_socket: Path, *, timeout: float = REGISTRATION_TIMEOUT
) -> dict[str, Any]:
    """The kubelet's registration handshake on a plugin's registration socket.

    ``GetInfo``; check the type is ``DRAPlugin``, the name is set, the endpoint is an absolute
    path to an existing unix socket, and pick the first entry of the plugin's
    ``supported_versions`` (in the plugin's order) that the kubelet knows; then
    ``NotifyRegistrationStatus(plugin_registered=True)``, or ``(False, error=reason)``.

    Returns ``{"info": get_info(), "chosenVersion": str ("" when refused), "registered": bool,
    "error": str}``. gRPC failures raise :class:`KubeletApiError`.
    """
    with KubeletClient(registration_socket, timeout=timeout) as client:
        info = client.get_info()
        chosen, reason = check_plugin_info(info)
        registered = not reason
        client.notify_registration(registered, reason)
    return {"info": info, "chosenVersion": chosen, "registered": registered, "error": reason}
