import io
import json

from agent.logs import configure_logging, fields_


def test_json_logs_are_one_object_per_line_with_fields():
    buf = io.StringIO()
    log = configure_logging("json", "info", buf)
    log.info("discovered GPU", extra=fields_(gpu=3, uuid="GPU-x", msg="shadowed"))
    log.debug("hidden")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
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
