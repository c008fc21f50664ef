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
