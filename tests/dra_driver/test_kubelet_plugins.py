"""The kubelet emulator's plugin manager: several registrations of one driver, as the kubelet
handles them (registration order, the newest connected plugin gets the calls, fallback when it
goes away). Fake plugins are real gRPC servers on unix sockets in the test's directory."""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra_driver.errors import KubeletApiError
from dra_driver.kubeletapi import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.plugin_manager import PluginManager

DRIVER = "gpu.tessera.dev"
CLAIM = [ClaimRef("default", "c", "uid-c")]


@dataclass
class Fake:
    """One plugin instance: who it is, what the kubelet told it, which calls it got."""

    name: str
    registry: Path
    plugins: Path
    driver: str = DRIVER
    endpoint: Path | None = None
    notifications: list[tuple[bool, str]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    servers: list[grpc.Server] = field(default_factory=list)
    executors: list[ThreadPoolExecutor] = field(default_factory=list)

    @property
    def reg_socket(self) -> Path:
        return self.registry / f"{self.driver}-{self.name}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        return self.endpoint or self.plugins / f"dra-{self.name}.sock"

    def start(self) -> Fake:
        fake = self

        class Registration(registration_pb2_grpc.RegistrationServicer):
            def GetInfo(self, request: Any, context: Any) -> Any:
                return registration_pb2.PluginInfo(
                    type="DRAPlugin",
                    name=fake.driver,
                    endpoint=str(fake.dra_socket),
                    supported_versions=["v1.DRAPlugin"],
                )

            def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
                fake.notifications.append((request.plugin_registered, request.error))
                return registration_pb2.RegistrationStatusResponse()

        class Dra(dra_v1_pb2_grpc.DRAPluginServicer):
            def NodePrepareResources(self, request: Any, context: Any) -> Any:
                fake.calls.append("prepare")
                resp = dra_v1_pb2.NodePrepareResourcesResponse()
                for c in request.claims:
                    resp.claims[c.uid].error = f"served by {fake.name}"
                return resp

            def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
                fake.calls.append("unprepare")
                resp = dra_v1_pb2.NodeUnprepareResourcesResponse()
                for c in request.claims:
                    resp.claims[c.uid].error = f"served by {fake.name}"
                return resp

        if self.endpoint is None:  # several fakes may share one endpoint
            self.servers.append(
                _serve(
                    self.dra_socket,
                    self._executor(),
                    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server,
                    Dra(),
                )
            )
        self.servers.append(
            _serve(
                self.reg_socket,
                self._executor(),
                registration_pb2_grpc.add_RegistrationServicer_to_server,
                Registration(),
            )
        )
        return self

    def _executor(self) -> ThreadPoolExecutor:
        self.executors.append(ThreadPoolExecutor(max_workers=2))
        return self.executors[-1]

    def stop_dra(self) -> None:
        """The process is gone but left its sockets (a crash): nothing accepts on them."""
        self.servers[0].stop(None).wait()
        _leave_stale(self.dra_socket)

    def stop(self) -> None:
        for server in self.servers:
            server.stop(None).wait()
        for executor in self.executors:  # grpc's stop leaves them
            executor.shutdown(wait=False)
        self.reg_socket.unlink(missing_ok=True)


def _serve(path: Path, executor: ThreadPoolExecutor, add: Any, servicer: Any) -> grpc.Server:
    server = grpc.server(executor)
    add(servicer, server)
    assert server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


def _leave_stale(path: Path) -> None:
    """A socket file nobody listens on, as a crashed process leaves it."""
    path.unlink(missing_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


@pytest.fixture
def dirs(short_tmp):
    registry, plugins = short_tmp / "reg", short_tmp / "plugins"
    registry.mkdir()
    plugins.mkdir()
    return registry, plugins


@pytest.fixture
def fakes(dirs):
    started: list[Fake] = []

    def make(name: str, **kw: Any) -> Fake:
        fake = Fake(name, *dirs, **kw).start()
        if started:  # file times are coarse (a jiffy): two sockets made at once can tie
            made = os.lstat(fake.reg_socket).st_mtime_ns
            before = os.lstat(started[-1].reg_socket).st_mtime_ns
            if made <= before:
                os.utime(fake.reg_socket, ns=(before + 1, before + 1), follow_symlinks=False)
        started.append(fake)
        return fake

    yield make
    for fake in started:
        fake.stop()


def served_by(result: dict[str, Any]) -> str:
    return str(result["claims"]["uid-c"]["error"]).removeprefix("served by ")


def test_each_plugin_registers_through_getinfo_and_the_newest_gets_the_calls(dirs, fakes):
    old = fakes("old")
    manager = PluginManager(dirs[0], DRIVER)
    manager.sync()
    assert old.notifications == [(True, "")]
    assert served_by(manager.prepare(CLAIM)) == "old"
    new = fakes("new")
    plugins = manager.sync()
    assert [p.registration for p in plugins] == [old.reg_socket, new.reg_socket]
    assert new.notifications == [(True, "")] and old.notifications == [(True, "")]
    assert served_by(manager.prepare(CLAIM)) == "new"
    assert served_by(manager.unprepare(CLAIM)) == "new"
    assert old.calls == ["prepare"] and new.calls == ["prepare", "unprepare"]
    manager.close()


def test_a_removed_registration_socket_deregisters_and_calls_fall_back(dirs, fakes):
    old, new = fakes("old"), fakes("new")
    manager = PluginManager(dirs[0], DRIVER)
    assert served_by(manager.prepare(CLAIM)) == "new"
    new.stop()  # a clean exit: its sockets go
    assert [p.registration for p in manager.sync()] == [old.reg_socket]
    assert served_by(manager.prepare(CLAIM)) == "old"
    manager.close()


def test_a_crashed_newest_plugin_is_passed_over_while_an_older_one_is_connected(dirs, fakes):
    old, new = fakes("old"), fakes("new")
    manager = PluginManager(dirs[0], DRIVER)
    manager.sync()
    new.stop_dra()  # its sockets stay, but nothing answers on the DRA socket
    assert manager.pick().endpoint == old.dra_socket
    assert served_by(manager.prepare(CLAIM)) == "old"
    old.stop_dra()  # none connected: the newest, whose call then fails
    assert manager.pick().endpoint == new.dra_socket
    with pytest.raises(KubeletApiError) as failed:
        manager.prepare(CLAIM)
    assert failed.value.code == "UNAVAILABLE"
    manager.close()


def test_an_endpoint_cannot_be_registered_twice(dirs, fakes):
    first = fakes("first")
    manager = PluginManager(dirs[0], DRIVER)
    manager.sync()
    second = fakes("second", endpoint=first.dra_socket)  # claims the first one's endpoint
    assert [p.registration for p in manager.sync()] == [first.reg_socket]
    reason = f"endpoint {first.dra_socket} already registered for DRA driver plugin {DRIVER}"
    assert second.notifications == [(False, reason)]
    assert manager.refused == [(second.reg_socket, reason)]
    manager.close()


def test_other_drivers_dot_files_and_stale_sockets_are_not_registered(dirs, fakes):
    registry = dirs[0]
    other = fakes("x", driver="other.example.com")
    _leave_stale(registry / f"{DRIVER}-stale-reg.sock")
    _leave_stale(registry / f".{DRIVER}-hidden-reg.sock")
    manager = PluginManager(registry, DRIVER, registration_timeout=2.0)
    assert manager.sync() == ()
    assert other.notifications == []  # another driver's plugin is not ours to answer
    with pytest.raises(KubeletApiError, match=f"DRA driver {DRIVER} is not registered"):
        manager.pick()
    late = fakes("late")  # a plugin that comes up later is registered then
    assert [p.registration for p in manager.sync()] == [late.reg_socket]
    manager.close()
