"""The composition root's lifecycle, in process: a dying task stops the agent with exit 1."""

from __future__ import annotations

import logging
import threading

from agent.config import Config
from agent.daemon import build_agent


def config(state_dir) -> Config:
    return Config(
        simulate="l40s-pcie",
        state_dir=state_dir,
        no_kube=True,
        metrics_address="127.0.0.1:0",
        telemetry_interval=60.0,
    )


def test_a_dying_background_task_shuts_the_agent_down_with_exit_1(short_tmp, caplog):
    agent = build_agent(config(short_tmp), logging.getLogger("tessera.test"))

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
    assert not agent.lock.held  # everything was stopped, the state directory released
    assert not agent.plugin.dra_socket.exists()


def test_a_clean_stop_exits_0_and_releases_the_state_dir(short_tmp):
    agent = build_agent(config(short_tmp), logging.getLogger("tessera.test"))
    stop = threading.Event()
    stop.set()  # asked to stop as soon as it started
    assert agent.run(stop) == 0
    assert agent.unfinished == []
    again = build_agent(config(short_tmp), logging.getLogger("tessera.test"))
    assert again.lock.held  # the next agent gets the directory
    again.run(stop)


def test_every_rediscovery_takes_the_start_s_one_path_and_reports_only_changes(short_tmp, caplog):
    from agent.hotplug import DevicesChanged, GpuRef
    from agent.sim.udev import add_gpu, remove_gpu

    agent = build_agent(config(short_tmp), logging.getLogger("tessera.test"))
    changes: list[DevicesChanged] = []
    agent.on_devices_changed = changes.append
    agent.triggers = None  # rediscoveries are called by the test, not by the loop
    stop = threading.Event()
    try:
        agent.start()
        assert agent.inventory is not None
        first = agent.inventory.gpus[1]
        caplog.set_level(logging.INFO, logger="tessera.test")
        agent.rediscover()
        assert changes == []  # nothing changed: no callback, no record
        assert not [r for r in caplog.records if r.getMessage() == "node inventory changed"]

        remove_gpu(agent.source.sim, 1)
        agent.rediscover()
        gone = GpuRef(1, first.device.uuid, first.pcie.bus_id)
        assert changes[-1] == DevicesChanged(removed_gpus=(gone,), removed_devices=("gpu-1",))
        assert "gpu-1" not in [d.name for d in agent.devices.get().devices]
        assert [g.uuid for g in agent.sampler.gpus] == [g.device.uuid for g in agent.inventory.gpus]
        assert agent.publisher.policy.node_name == agent.source.hostname

        add_gpu(agent.source.sim, 1)
        agent.rediscover(frozenset({first.pcie.bus_id}))
        assert changes[-1] == DevicesChanged(
            added_gpus=(gone,), added_devices=("gpu-1",), rebound=(first.pcie.bus_id,)
        )
        records = [r for r in caplog.records if r.getMessage() == "node inventory changed"]
        assert len(records) == 2

        agent.source.sim.lose_gpu(2)  # fell off the bus but still there: kept for health
        agent.rediscover()
        assert len(changes) == 2 and "gpu-2" in [d.name for d in agent.devices.get().devices]
    finally:
        stop.set()
        agent.stop()
