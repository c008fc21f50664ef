"""The composition root's lifecycle, in process: a dying task stops the agent with exit 1."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace

import pytest

from agent.cli.node_access import node_access
from agent.config import Config, CrashAt
from agent.daemon import Agent, NodeAccess, build_agent, crash_hook
from dra_driver.kubeletplugin.crash_points import CRASH_POINTS


def config(state_dir, **more: object) -> Config:
    return Config.of(
        simulate="l40s-pcie",
        state_dir=state_dir,
        no_kube=True,
        metrics_address="127.0.0.1:0",
        telemetry_interval=60.0,
        **more,
    )


def build(config: Config, log: logging.Logger, node: NodeAccess | None = None) -> Agent:
    """The agent ``tessera run`` builds: the node as the CLI opens it (the simulator's here)."""
    return build_agent(config, log, node or node_access(config))


def test_a_dying_background_task_shuts_the_agent_down_with_exit_1(short_tmp, caplog):
    agent = build(config(short_tmp), logging.getLogger("tessera.test"))

    def publisher_dies(stop: threading.Event) -> None:
        raise RuntimeError("publisher bug")

    agent.publisher.run = publisher_dies  # type: ignore[method-assign]
    never = threading.Event()  # no signal comes: only the failure can end the run
    with caplog.at_level(logging.ERROR, logger="tessera.test"):
        code = agent.run(never)
    assert code == 1
    assert agent.supervisor is not None
    assert agent.supervisor.failures == {"publisher": "RuntimeError('publisher bug')"}
    failed = [r for r in caplog.records if r.getMessage() == "task failed; shutting down"]
    assert failed and failed[0].fields == {"task": "publisher"}  # type: ignore[attr-defined]
    assert not agent.state.lock.held  # everything was stopped, the state directory released
    assert not agent.plugin.dra_socket.exists()


def test_a_clean_stop_exits_0_and_releases_the_state_dir(short_tmp):
    agent = build(config(short_tmp), logging.getLogger("tessera.test"))
    stop = threading.Event()
    stop.set()  # asked to stop as soon as it started
    assert agent.run(stop) == 0
    assert agent.unfinished == []
    again = build(config(short_tmp), logging.getLogger("tessera.test"))
    assert again.state.lock.held  # the next agent gets the directory
    again.run(stop)


class Seen(logging.Handler):
    """Sets an event when a record with ``msg`` is logged (a handshake with the agent)."""

    def __init__(self, msg: str) -> None:
        super().__init__()
        self.msg = msg
        self.event = threading.Event()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == self.msg:
            self.records.append(record)
            self.event.set()


def test_a_rolling_update_successor_serves_at_once_and_takes_the_state_dir_when_released(
    short_tmp,
):
    """In-process, two agents on one state directory with --rolling-update: the second
    registers its own sockets while the first holds the directory, is ready while it waits,
    writes nothing, answers the kubelet's calls that cannot wait any longer with a retryable
    error, and takes the directory over when the first stops."""
    from dra_driver.errors import CheckpointError
    from dra_driver.kubeletplugin.checkpoint import Checkpoint
    from dra_driver.testkubelet.calls import ClaimRef
    from dra_driver.testkubelet.client import KubeletClient

    old_uid, new_uid = (
        "0a1b2c3d-0000-4000-8000-00000000000a",
        "0a1b2c3d-0000-4000-8000-00000000000b",
    )
    old = build(
        config(short_tmp, rolling_update=True, pod_uid=old_uid),
        logging.getLogger("tessera.test.old"),
    )
    old.start()
    new_log = logging.getLogger("tessera.test.new")
    new_log.setLevel(logging.INFO)
    waiting, took_over = (
        Seen("waiting for the state directory"),
        Seen("took over the state directory"),
    )
    new_log.addHandler(waiting)
    new_log.addHandler(took_over)
    new = build(config(short_tmp, rolling_update=True, pod_uid=new_uid), new_log)
    stop_new = threading.Event()
    starting = threading.Thread(target=new.start, args=(stop_new,))
    starting.start()
    try:
        assert waiting.event.wait(30)
        assert new.plugin.reg_socket.name == f"gpu.tessera.dev-{new_uid}-reg.sock"
        assert new.plugin.reg_socket.exists() and old.plugin.reg_socket.exists()
        assert not new.state.lock.held and old.state.lock.held
        ready, checks = new.readiness.evaluate()
        assert ready, checks  # ready while waiting: the DaemonSet may now delete the old pod
        assert checks["state-dir"].startswith(f"waiting for PID {os.getpid()} of pod {old_uid}")
        with pytest.raises(CheckpointError, match="does not hold"):
            new.preparer.store.save(Checkpoint("any"))  # it cannot write, by construction
        # a call whose deadline leaves no time to wait is answered at once, retryably
        with KubeletClient(new.plugin.dra_socket, timeout=5.5) as kubelet:
            answer = kubelet.prepare([ClaimRef("default", "c", "uid-c")])["claims"]["uid-c"]
        assert "is still waiting for the state directory" in answer["error"]
        assert f"of pod {old_uid}" in answer["error"] and "kubelet retries" in answer["error"]
        old.stop()
        starting.join(30)
        assert not starting.is_alive() and new.state.lock.held and not old.state.lock.held
        assert took_over.records[0].fields["previous"] == f"PID {os.getpid()} of pod {old_uid}"  # type: ignore[attr-defined]
        assert new.readiness.evaluate()[1]["state-dir"] == "held"
        assert not old.plugin.reg_socket.exists()  # the old one's sockets went with it
    finally:
        stop_new.set()
        starting.join(30)
        new.stop()
        old.stop()
        new_log.removeHandler(waiting)
        new_log.removeHandler(took_over)
        new_log.setLevel(logging.NOTSET)


def test_every_rediscovery_takes_the_start_s_one_path_and_reports_only_changes(short_tmp, caplog):
    from agent.hotplug import DevicesChanged, GpuRef
    from agent.sim.udev import add_gpu, remove_gpu

    cfg = config(short_tmp)
    # rediscoveries are called by the test, not by the loop
    agent = build(cfg, logging.getLogger("tessera.test"), replace(node_access(cfg), triggers=None))
    changes: list[DevicesChanged] = []
    agent.node.devices_changed.subscribe(changes.append)
    stop = threading.Event()
    try:
        agent.start()
        assert agent.node.inventory is not None
        first = agent.node.inventory.gpus[1]
        caplog.set_level(logging.INFO, logger="tessera.test")
        agent.node.rediscover()
        assert changes == []  # nothing changed: no callback, no record
        assert not [r for r in caplog.records if r.getMessage() == "node inventory changed"]

        remove_gpu(agent.source.sim, 1)
        agent.node.rediscover()
        gone = GpuRef(1, first.device.uuid, first.pcie.bus_id)
        assert changes[-1] == DevicesChanged(removed_gpus=(gone,), removed_devices=("gpu-1",))
        assert "gpu-1" not in [d.name for d in agent.node.devices.get().devices]
        assert [g.uuid for g in agent.telemetry.sampler.gpus] == [
            g.device.uuid for g in agent.node.inventory.gpus
        ]
        assert agent.publisher.policy.node_name == agent.source.hostname

        add_gpu(agent.source.sim, 1)
        agent.node.rediscover(frozenset({first.pcie.bus_id}))
        assert changes[-1] == DevicesChanged(
            added_gpus=(gone,), added_devices=("gpu-1",), rebound=(first.pcie.bus_id,)
        )
        records = [r for r in caplog.records if r.getMessage() == "node inventory changed"]
        assert len(records) == 2

        agent.source.sim.lose_gpu(2)  # fell off the bus but still there: kept for health
        agent.node.rediscover()
        assert len(changes) == 2 and "gpu-2" in [d.name for d in agent.node.devices.get().devices]
    finally:
        stop.set()
        agent.stop()


class Kills:
    """A fake kill: counts the calls instead of ending the test process."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_the_crash_hook_kills_at_the_first_pass_of_its_point_and_only_there() -> None:
    kills = Kills()
    hook = crash_hook(CrashAt("after-cdi"), kill=kills)
    hook("after-started")
    hook("after-completed")
    assert kills.calls == 0
    hook("after-cdi")
    assert kills.calls == 1
    hook("after-cdi")  # in the real daemon there is no second time; here: no second kill
    assert kills.calls == 1


def test_the_crash_hook_kills_at_the_nth_pass_and_logs_the_ones_before(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kills = Kills()
    log = logging.getLogger("tessera.test.crash")
    hook = crash_hook(CrashAt("after-gi-create", 3), log, kill=kills)
    with caplog.at_level(logging.INFO, logger="tessera.test.crash"):
        for point in ["after-gi-create", "after-ci-create", "after-gi-create", "after-cdi"]:
            hook(point)
        assert kills.calls == 0
        hook("after-gi-create")
        assert kills.calls == 1
    passes = [r for r in caplog.records if r.getMessage() == "passed a crash point"]
    assert [r.fields for r in passes] == [  # type: ignore[attr-defined]
        {"point": "after-gi-create", "occurrence": 1, "fires_at": 3},
        {"point": "after-gi-create", "occurrence": 2, "fires_at": 3},
    ]


def test_the_crash_hook_counts_each_pass_once_across_threads() -> None:
    """The claims of a batch reach a point on several threads: exactly one of them kills, at
    exactly the armed occurrence."""
    kills = Kills()
    hook = crash_hook(CrashAt("after-started", 50), kill=kills)
    start = threading.Barrier(8)

    def claim() -> None:
        start.wait()
        for _ in range(25):
            hook("after-started")

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert kills.calls == 1


def test_an_unarmed_crash_hook_does_nothing() -> None:
    kills = Kills()
    hook = crash_hook(None, kill=kills)
    for point in CRASH_POINTS:
        hook(point)
    assert kills.calls == 0


def test_a_rediscovery_read_a_mig_change_overtook_is_read_again(short_tmp, monkeypatch):
    """A prepare makes a dynamic MIG device while a rediscovery reads the node: the older read
    is not applied over the change (the sampler would lose the device's profile until the next
    rediscovery); the node is read again."""
    import agent.daemon.devices as devices_module
    from agent.nvml.mig import MigControl

    cfg = Config.of(
        simulate="dgx-h100", state_dir=short_tmp, no_kube=True, metrics_address="127.0.0.1:0",
        telemetry_interval=60.0, mig_mode="dynamic",
    )  # fmt: skip
    agent = build(cfg, logging.getLogger("tessera.test"), replace(node_access(cfg), triggers=None))
    reads = 0
    real = devices_module.rediscover

    def overtaken(source, previous, vm=None):  # type: ignore[no-untyped-def]
        nonlocal reads
        reads += 1
        result = real(source, previous, vm)
        if reads == 1:  # a prepare on GPU 2 finishes between this read and its apply
            mig = MigControl(agent.source.nvml)
            assert mig.set_mode(2, True)
            mig.create(2, 19, 0, 1)
            agent.node.mig_changed(2)
        return result

    monkeypatch.setattr(devices_module, "rediscover", overtaken)
    try:
        agent.start()
        agent.node.rediscover()
        assert reads == 2
        (gpu2,) = [g for g in agent.telemetry.sampler.gpus if g.index == 2]
        assert [p for _, p in gpu2.mig_profiles] == ["1g.10gb"]
    finally:
        agent.stop()


def test_the_kubelet_gets_its_registration_before_the_start_reads_the_node_and_no_claim_call_before_the_checkpoint_is_recovered(  # noqa: E501
    short_tmp,
):
    """A cold start serves the registration socket first (GetInfo needs only the driver's name,
    endpoint and versions), so the kubelet registers the plugin while the agent still reads the
    node; a DRA call that comes meanwhile waits at the gate, and one whose deadline runs out is
    answered retryably, saying the agent is still starting. The gate opens only once the
    prepared claims are recovered from the checkpoint."""
    from dra_driver.testkubelet.calls import ClaimRef
    from dra_driver.testkubelet.client import KubeletClient

    agent = build(config(short_tmp), logging.getLogger("tessera.test"))
    recovering, release = threading.Event(), threading.Event()
    gate_at_recovery: list[bool] = []
    recover = agent.preparer.reconcile_on_start

    def held_recovery() -> None:
        gate_at_recovery.append(agent.plugin.gate.is_open)
        recovering.set()
        assert release.wait(30)
        recover()

    agent.preparer.reconcile_on_start = held_recovery  # type: ignore[method-assign]
    stop = threading.Event()
    starting = threading.Thread(target=agent.start, args=(stop,))
    starting.start()
    try:
        assert recovering.wait(30)
        with KubeletClient(agent.plugin.reg_socket, timeout=5) as kubelet:
            info = kubelet.get_info()
        assert info["name"] == "gpu.tessera.dev"
        assert info["endpoint"] == str(agent.plugin.dra_socket)
        with KubeletClient(agent.plugin.dra_socket, timeout=5.5) as kubelet:
            answer = kubelet.prepare([ClaimRef("default", "c", "uid-c")])["claims"]["uid-c"]
        assert answer["error"] == (
            "claim default/c (uid-c): the agent is still starting (reading the node and"
            " recovering its prepared claims); the kubelet retries the call"
        )
        assert not agent.plugin.gate.is_open
        release.set()
        starting.join(30)
        assert not starting.is_alive()
        assert gate_at_recovery == [False] and agent.plugin.gate.is_open
    finally:
        release.set()
        starting.join(30)
        agent.stop()
