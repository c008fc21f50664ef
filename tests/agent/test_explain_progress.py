"""`tessera explain`'s progress line on stderr (only on a terminal) and the fast page decoder."""

from __future__ import annotations

import io

import pytest

from agent.cli.explain_cluster import Progress
from agent.decode import load_json_fast
from agent.errors import DecodeError


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_or_file_gets_no_progress() -> None:
    err = io.StringIO()
    progress = Progress(err)
    progress.show("read 500 ResourceSlices", force=True)
    progress.done()
    assert err.getvalue() == ""


def test_a_terminal_gets_one_line_rewritten_at_most_every_interval_and_cleared() -> None:
    now = [0.0]
    err = Terminal()
    progress = Progress(err, interval=0.2, clock=lambda: now[0])
    progress.show("evaluated 1 of 3 nodes")
    now[0] = 0.1
    progress.show("evaluated 2 of 3 nodes")  # too soon: skipped
    now[0] = 0.3
    progress.show("evaluated 3 of 3 nodes")
    progress.done()
    lines = err.getvalue().split("\r\x1b[2K")
    assert lines == ["", "evaluated 1 of 3 nodes", "evaluated 3 of 3 nodes", ""]


def test_the_fast_decoder_reads_json_and_refuses_what_is_not() -> None:
    assert load_json_fast(b'{"items": [1, "a", null]}', "the answer", 100) == {
        "items": [1, "a", None]
    }
    with pytest.raises(DecodeError, match="the answer: not valid JSON"):
        load_json_fast(b'{"items": [', "the answer", 100)
    with pytest.raises(DecodeError, match="more than the 10 allowed"):
        load_json_fast(b'{"items": [1, 2, 3]}', "the answer", 10)
    with pytest.raises(DecodeError, match="not valid JSON"):
        load_json_fast(b"[NaN]", "the answer", 100)
