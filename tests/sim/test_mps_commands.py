"""The MPS control daemon's command language (pure)."""

from __future__ import annotations

import pytest

from agent.sim.sharing import MpsDaemon
from agent.sim.tools.mps_commands import execute, format_limit, parse_limit

DAEMON = MpsDaemon(1, 1, "/p", "/l", ("GPU-a", "MIG-b"))


@pytest.mark.parametrize(
    ("text", "mib"),
    [("2G", 2048), ("2048M", 2048), ("0M", 0), ("900M", 900), ("2g", None), ("2", None),
     ("2 G", None), ("1.5G", None), ("-1G", None), ("2GB", None), ("2GiB", None)],
)  # fmt: skip
def test_limits_are_an_integer_and_m_or_g(text, mib):
    assert parse_limit(text) == mib


@pytest.mark.parametrize(
    ("mib", "text"), [(0, "0M"), (900, "900M"), (1023, "1023M"), (1024, "1G"), (1044, "1G"),
                      (2048, "2G"), (20350, "19G")],
)  # fmt: skip
def test_limits_print_in_whole_gib_from_one_gib(mib, text):
    assert format_limit(mib) == text


def test_settings_change_the_record_and_queries_read_it():
    step = execute(DAEMON, "set_default_active_thread_percentage 33.3")
    assert step.reply == "33.3" and step.daemon.active_thread_percentage == 33.3
    step = execute(step.daemon, "set_default_device_pinned_mem_limit 1 3G")
    assert step.reply == "" and step.daemon.pinned_mem_limits == (("MIG-b", 3072),)
    step = execute(step.daemon, "set_default_device_pinned_mem_limit GPU-a 100M")
    assert step.daemon.pinned_mem_limits == (("GPU-a", 100), ("MIG-b", 3072))
    assert execute(step.daemon, "get_default_device_pinned_mem_limit MIG-b").reply == "3G"
    assert execute(step.daemon, "get_default_device_pinned_mem_limit 0").reply == "100M"
    assert execute(DAEMON, "get_default_device_pinned_mem_limit 0").reply == "0M"


def test_quit_blank_and_unknown_lines():
    assert execute(DAEMON, "quit").quit
    assert execute(DAEMON, "  ") == execute(DAEMON, "")
    assert not execute(DAEMON, "").quit and execute(DAEMON, "").reply == ""
    unknown = execute(DAEMON, "quit now")
    assert not unknown.quit and unknown.reply.startswith("Unrecognized command 'quit now'")
    assert execute(DAEMON, "get_server_list").reply == ""
    assert execute(DAEMON, "get_default_active_thread_percentage").reply == "100.0"
    assert execute(DAEMON, "set_default_active_thread_percentage nan").daemon == DAEMON
