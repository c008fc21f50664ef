"""What the kubelet does with the plugins of one DRA driver: the emulator's plugin manager.

The kubelet watches its plugin registry directory. For a new socket there it calls
``GetInfo``, checks the answer and tells the plugin with ``NotifyRegistrationStatus``; it keeps
the plugins of a driver in the order they registered and refuses a second registration of an
endpoint that is already registered; it deregisters a plugin whose registration socket is
removed (and closes its connection). Each call goes to the most recently registered plugin
whose connection is up, else to the most recently registered one. This is kubelet 1.33's and
later's ``DRAPluginManager`` (``pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go``: ``add``,
``remove``, ``get``), written down in docs/gpu-facts.md ("The kubelet and several plugins of a
driver"); a rolling update of a DRA driver's DaemonSet relies on it.

:class:`PluginManager` does the same over real sockets: :meth:`PluginManager.sync` is one pass
of the directory watch (:meth:`PluginManager.watch` repeats it), :meth:`PluginManager.pick` the
kubelet's choice, and :meth:`PluginManager.prepare`/:meth:`PluginManager.unprepare` send a call
where the kubelet would. Whether a plugin is "connected" (the kubelet's gRPC stats handler) is
whether its DRA socket accepts a connection now. A test tool, like
:mod:`dra_driver.testkubelet.client`; the agent never uses it.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.fsutil import SocketIdentity, accepts_connections, socket_identity
from dra_driver.errors import KubeletApiError
from dra_driver.testkubelet.calls import KUBELET_CALL_TIMEOUT, REGISTRATION_TIMEOUT, ClaimRef
from dra_driver.testkubelet.client import KubeletClient, check_plugin_info

GET_PLUGIN = "GetPlugin"
"""The operation named in errors about no plugin at all (the kubelet's ``GetPlugin``)."""


@dataclass(frozen=True)
class RegisteredPlugin:
    """One registration of the driver: its registration socket (and that socket's identity
    when it registered), the DRA endpoint ``GetInfo`` named and the service version chosen."""

    registration: Path
    identity: SocketIdentity
    endpoint: Path
    version: str

    @property
    def api(self) -> str:
        """The DRA API of the chosen version (``v1``, ``v1beta1``)."""
        return self.version.split(".", 1)[0]


def connected(endpoint: Path) -> bool:
    """Whether a process accepts connections on the unix socket ``endpoint`` right now."""
    return accepts_connections(endpoint)


class PluginManager:
    """The kubelet's view of the plugins of ``driver_name`` in ``registry_dir`` (see the module
    docstring). Thread-safe: several callers may prepare and unprepare at once."""

    def __init__(
        self,
        registry_dir: Path,
        driver_name: str,
        *,
        timeout: float = KUBELET_CALL_TIMEOUT,
        registration_timeout: float = REGISTRATION_TIMEOUT,
    ) -> None:
        self.registry_dir = Path(registry_dir)
        self.driver_name = driver_name
        self.timeout = timeout
        self.registration_timeout = registration_timeout
        self.refused: list[tuple[Path, str]] = []
        """Registrations refused, with the reason told to the plugin."""
        self._plugins: list[RegisteredPlugin] = []
        self._others: set[SocketIdentity] = set()
        """Registration sockets of other drivers (asked once)."""
        self._clients: dict[Path, KubeletClient] = {}
        self._lock = threading.RLock()

    @property
    def plugins(self) -> tuple[RegisteredPlugin, ...]:
        """The driver's registrations, oldest first."""
        with self._lock:
            return tuple(self._plugins)

    # -- the directory watch ----------------------------------------------------------------

    def sync(self) -> tuple[RegisteredPlugin, ...]:
        """One pass of the kubelet's watch: deregister the plugins whose registration socket is
        gone (or was replaced), register the new sockets in the order they were made. A socket
        whose ``GetInfo`` fails (a stale one, nobody listening) is tried again next time.
        Returns the registrations, oldest first."""
        with self._lock:
            found = self._sockets()
            for plugin in list(self._plugins):
                if found.get(plugin.registration) != plugin.identity:
                    self._deregister(plugin)
            known = {p.identity for p in self._plugins} | self._others
            new = [(path, ident) for path, ident in found.items() if ident not in known]
            new.sort(key=lambda item: _made_at(item[0]))
            for path, ident in new:
                self._register(path, ident)
            return tuple(self._plugins)

    def watch(self, stop: threading.Event, interval: float = 0.1) -> None:
        """Sync every ``interval`` seconds until ``stop`` is set (run it on a thread)."""
        while not stop.is_set():
            self.sync()
            stop.wait(interval)

    def _sockets(self) -> dict[Path, SocketIdentity]:
        try:
            names = os.listdir(self.registry_dir)
        except FileNotFoundError:
            return {}
        out = {}
        for name in names:
            if name.startswith("."):  # the kubelet ignores these
                continue
            path = self.registry_dir / name
            ident = socket_identity(path)
            if ident is not None:
                out[path] = ident
        return out

    def _register(self, path: Path, ident: SocketIdentity) -> None:
        try:
            with KubeletClient(path, timeout=self.registration_timeout) as reg:
                info = reg.get_info()
                if info["name"] != self.driver_name:
                    self._others.add(ident)
                    return
                version, reason = check_plugin_info(info)
                endpoint = Path(info["endpoint"])
                if not reason and any(p.endpoint == endpoint for p in self._plugins):
                    # one plugin instance cannot hijack the endpoint of another
                    reason = (
                        f"endpoint {endpoint} already registered for DRA driver plugin"
                        f" {self.driver_name}"
                    )
                if reason:
                    self.refused.append((path, reason))
                else:
                    self._plugins.append(RegisteredPlugin(path, ident, endpoint, version))
                reg.notify_registration(not reason, reason)
        except KubeletApiError:
            return  # not answering (yet): the kubelet retries

    def _deregister(self, plugin: RegisteredPlugin) -> None:
        self._plugins.remove(plugin)
        client = self._clients.pop(plugin.endpoint, None)
        if client is not None:
            client.close()

    # -- calls ------------------------------------------------------------------------------

    def pick(self) -> RegisteredPlugin:
        """The plugin the kubelet sends the next call to: the newest registration whose DRA
        socket accepts connections, else the newest. KubeletApiError when none is registered."""
        with self._lock:
            plugins = list(self._plugins)
        for plugin in reversed(plugins):
            if connected(plugin.endpoint):
                return plugin
        if plugins:
            return plugins[-1]
        raise KubeletApiError(
            GET_PLUGIN,
            str(self.registry_dir),
            "UNAVAILABLE",
            f"DRA driver {self.driver_name} is not registered",
        )

    def client(self, plugin: RegisteredPlugin) -> KubeletClient:
        """The connection to ``plugin``'s DRA socket (one per endpoint, reused)."""
        with self._lock:
            client = self._clients.get(plugin.endpoint)
            if client is None:
                client = KubeletClient(plugin.endpoint, timeout=self.timeout)
                self._clients[plugin.endpoint] = client
            return client

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Any]:
        """``NodePrepareResources`` where the kubelet would send it (see :meth:`pick`)."""
        self.sync()
        plugin = self.pick()
        return self.client(plugin).prepare(claims, plugin.api)

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, Any]:
        """``NodeUnprepareResources`` where the kubelet would send it."""
        self.sync()
        plugin = self.pick()
        return self.client(plugin).unprepare(claims, plugin.api)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


def _made_at(path: Path) -> int:
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_mtime_ns if stat.S_ISSOCK(st.st_mode) else 0
