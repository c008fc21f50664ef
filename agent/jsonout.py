"""Indented JSON for files people read (the checkpoint, CDI specs), written on the prepare path.

The json module writes indented JSON with its pure-Python encoder only (its C encoder serves the
compact form alone): about 0.1 ms for a CDI spec and more for a checkpoint, several times per
prepare (``python -m bench prepare``). orjson writes the same text: keys sorted, two-space
indents, UTF-8 (as ``ensure_ascii=False``); a float may be spelled differently (``0.000015`` for
``1.5e-05``), which every JSON reader reads as the same number. It refuses what the json module
would also refuse or write as non-JSON: NaN is written as ``null`` and an integer outside 64 bits
raises, neither of which these files hold."""

from __future__ import annotations

from typing import Any


def indented_json(obj: Any) -> bytes:
    """``obj`` as indented JSON with sorted keys and a final newline, UTF-8. Raises TypeError
    for what JSON cannot hold (orjson.JSONEncodeError is one)."""
    # imported here: the checkpoint's module is imported by commands that never write one,
    # among them gpu-check, whose pure-Python bundle (bench/gpu_check/bundle.py) carries no
    # compiled package such as orjson (agent/decode/bounds.py does the same for reading)
    import orjson

    return orjson.dumps(
        obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE
    )
