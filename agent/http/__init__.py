"""The agent's HTTP endpoint: /healthz, /readyz and /metrics.

Readiness is a set of named checks; /readyz answers 200 only when every check passes and lists
the failing ones otherwise. Nothing on these paths touches NVML or Kubernetes.

The DaemonSet exposes the endpoint on the node's network, so it is built to hold against clients
that connect and never finish (see docs/reliability.md, "The network endpoints"):

- **No thread per connection.** One selector thread (``http``) accepts connections and reads
  each request, head and body, without blocking: a client that connects and sends nothing, or
  half a header, costs one descriptor and no thread. Only a complete request goes to one of a
  fixed pool of ``threads`` workers (``http-worker-<n>``), which answers it and closes the
  connection (HTTP/1.0: one request per connection).
- **Timeouts.** The request head must arrive within ``header_timeout`` of the connection (TLS
  handshake included), its body within ``body_timeout`` after the head; the response must be
  taken within ``response_timeout``. A late client gets ``408`` and is closed.
- **A connection cap and a descriptor reserve.** At most ``max_connections`` connections are
  open at once, and a new one is only kept while more than ``fd_reserve`` descriptors remain
  below the soft ``RLIMIT_NOFILE``, so the kubelet's sockets and the telemetry API can always
  accept. At either limit the oldest connection that has not finished its request is closed to
  make room (a probe sends its request at once and is answered while slow clients hold the rest);
  when every open connection is being answered, the new one is closed at once.
- **Logs.** Every refused, timed-out, malformed or broken request is one JSON record through
  logging (never a traceback on stderr), at most one per kind every ``LOG_INTERVAL`` seconds with
  the number not logged (``agent.logs.Throttle``).
- **TLS** (optional): a certificate and key, and optionally a client CA (clients without a
  certificate it signed are refused at the handshake); see ``agent.tls``.
"""

from agent.http.connection import HttpLimits
from agent.http.descriptors import descriptors_left, raise_descriptor_limit
from agent.http.endpoint import Exposition, HttpEndpoint
from agent.http.probes import Check, Readiness

__all__ = [
    "Check",
    "Exposition",
    "HttpEndpoint",
    "HttpLimits",
    "Readiness",
    "descriptors_left",
    "raise_descriptor_limit",
]
