"""A gRPC server's answer to a request that does not decode: ``INVALID_ARGUMENT``, not a traceback.

grpc's own handling of a request whose bytes are not the method's message (corrupt wire format,
a string field that is not UTF-8) logs ``Exception deserializing message!`` at ERROR with the
whole traceback, for every such request, and answers ``INTERNAL``. Whoever can reach the socket
can cause that at will, so :class:`MalformedRequests`, a server interceptor, decodes the request
itself: a request that does not decode is answered ``INVALID_ARGUMENT`` naming the message type
and what is wrong, and reported through ``report(method, error)`` (the server's rate-limited
log), never as a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

Report = Callable[[str, str], None]
"""``report(method, error)`` for each request that does not decode."""


class _Malformed:
    """What a request that does not decode becomes: the method's behaviour aborts on it."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class MalformedRequests(grpc.ServerInterceptor):
    """Answers requests that do not decode with ``INVALID_ARGUMENT`` (see the module docstring).
    Only unary-request methods are guarded (every service of the agent has only those)."""

    def __init__(self, report: Report) -> None:
        self.report = report

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = str(handler_call_details.method)
        decode = handler.request_deserializer

        def safe_decode(data: bytes) -> Any:
            try:
                return decode(data)
            except DecodeError as exc:
                return _Malformed(str(exc) or type(exc).__name__)

        def guard(behaviour: Callable[[Any, grpc.ServicerContext], Any]) -> Any:
            def run(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    self.report(method, request.error)
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{method}: the request does not decode: {request.error}",
                    )
                return behaviour(request, context)

            return run

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                guard(handler.unary_unary),
                request_deserializer=safe_decode,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                guard(handler.unary_stream),
                request_deserializer=safe_decode,
                response_serializer=handler.response_serializer,
            )
        return handler
