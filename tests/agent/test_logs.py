import io
import json
import logging
import threading
import warnings

import pytest

from agent.logs import LIBRARY_LOGGERS, Throttle, configure_logging, fields_


@pytest.fixture(autouse=True)
def restore_logging():
    """configure_logging changes process-wide state on purpose; every test here puts it back."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, threading.excepthook)
    levels = {n: logging.getLogger(n).level for n in (*LIBRARY_LOGGERS, "tessera")}
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    threading.excepthook = saved[2]
    logging.captureWarnings(False)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_logs_are_one_object_per_line_with_fields():
    buf = io.StringIO()
    log = configure_logging("json", "info", buf)
    log.info("discovered GPU", extra=fields_(gpu=3, uuid="GPU-x", msg="shadowed"))
    log.debug("hidden")
    [rec] = lines(buf)
    assert rec["msg"] == "discovered GPU"
    assert rec["level"] == "info"
    assert rec["logger"] == "tessera"
    assert rec["gpu"] == 3 and rec["uuid"] == "GPU-x"
    assert rec["field_msg"] == "shadowed"  # a field never overwrites the message


def test_text_logs_carry_fields():
    buf = io.StringIO()
    log = configure_logging("text", "debug", buf)
    log.getChild("x").debug("hello", extra=fields_(a=1))
    assert "DEBUG" in buf.getvalue() and "hello a=1" in buf.getvalue()


def test_every_logger_of_the_process_comes_out_as_json():
    """Module loggers outside the tessera tree, library loggers, warnings and exceptions that
    escape a thread all use the one format (a bare text line would break a log pipeline)."""
    buf = io.StringIO()
    configure_logging("json", "info", buf)
    logging.getLogger("dra_driver.kubeletplugin.checkpoint").warning("checkpoint is corrupt")
    logging.getLogger("dra_driver.kubeletplugin.checkpoint").info("converted")
    logging.getLogger("urllib3.connectionpool").warning("Retrying connection")
    logging.getLogger("urllib3.connectionpool").info("chatter")  # libraries: warnings and up
    logging.getLogger("grpc._server").error("exception calling application")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("old API", DeprecationWarning, stacklevel=1)

    def boom() -> None:
        raise ValueError("thread died")

    t = threading.Thread(target=boom, name="worker-7")
    t.start()
    t.join()
    recs = lines(buf)
    assert [(r["logger"], r["msg"]) for r in recs[:4]] == [
        ("dra_driver.kubeletplugin.checkpoint", "checkpoint is corrupt"),
        ("dra_driver.kubeletplugin.checkpoint", "converted"),
        ("urllib3.connectionpool", "Retrying connection"),
        ("grpc._server", "exception calling application"),
    ]
    assert recs[4]["logger"] == "py.warnings" and "old API" in recs[4]["msg"]
    assert recs[5]["msg"] == "unhandled exception in a thread"
    assert recs[5]["thread"] == "worker-7" and "ValueError: thread died" in recs[5]["exception"]
    assert len(recs) == 6


def test_debug_level_lets_library_detail_through():
    buf = io.StringIO()
    configure_logging("json", "debug", buf)
    logging.getLogger("urllib3.connectionpool").debug("Starting new HTTP connection")
    assert [r["msg"] for r in lines(buf)] == ["Starting new HTTP connection"]


def test_configuring_twice_does_not_duplicate_lines_or_touch_other_handlers():
    other = logging.StreamHandler(io.StringIO())
    logging.getLogger().addHandler(other)
    first, second = io.StringIO(), io.StringIO()
    configure_logging("json", "info", first)
    log = configure_logging("json", "info", second)
    log.info("once")
    assert first.getvalue() == "" and len(lines(second)) == 1
    assert other in logging.getLogger().handlers


def test_throttle_logs_one_record_per_key_per_interval_and_counts_the_rest():
    buf = io.StringIO()
    log = configure_logging("json", "info", buf)
    now = [100.0]
    throttle = Throttle(log, interval=10.0, clock=lambda: now[0])
    assert throttle(logging.WARNING, "timeout", "HTTP request timed out", peer="a")
    for _ in range(5):
        assert not throttle(logging.WARNING, "timeout", "HTTP request timed out", peer="b")
    assert throttle(logging.WARNING, "refused", "HTTP connection refused", peer="c")  # own key
    now[0] += 10.0
    assert throttle(logging.WARNING, "timeout", "HTTP request timed out", peer="d")
    first, refused, later = lines(buf)
    assert first["peer"] == "a" and "suppressed" not in first
    assert refused["msg"] == "HTTP connection refused"
    assert later["peer"] == "d" and later["suppressed"] == 5
