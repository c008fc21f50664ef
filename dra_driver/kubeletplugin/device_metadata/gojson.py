"""Go's ``json.MarshalIndent(v, "", "  ")``, byte for byte, for values made of dicts, lists,
strings, ints and bools.

KEP-5304 readers decode JSON, so any valid JSON would do for them; the bytes matter for a driver
that claims to write what k8s.io/dynamic-resource-allocation's helper writes (a consumer's
golden test, a diff against the Go driver's file). The helper encodes both documents with
``json.MarshalIndent`` (apimachinery's pretty serializer, ``pkg/runtime/serializer/json/json.go``
``doEncode``; the CDI spec in ``kubeletplugin/metadata.go`` ``writeCDISpec``).

Python's ``json.dumps(indent=2, ensure_ascii=False)`` has the same layout (``{}`` and ``[]``
when empty, a new line after each ``,``, ``": "`` after keys) and the same escapes for ``"``,
the backslash and the control characters (``\\b \\f \\n \\r \\t``, else ``\\u00xx``
in lower case; Go 1.22 made ``\\b`` and ``\\f`` so, release notes "encoding/json"). What Go
does on top, and this module adds (``encoding/json/encode.go`` ``appendString``): ``<``, ``>``
and ``&`` escaped as ``\\u003c``, ``\\u003e``, ``\\u0026`` (HTML-safe, the default of
``Marshal``), U+2028 and U+2029 as ``\\u2028``/``\\u2029``, and text that is not valid
UTF-8 replaced by U+FFFD.

Key order is the caller's: a Go struct's fields come in declaration order (build the dict in
that order), a Go map's keys sorted (build it sorted). The standard library's encoder does the
rest rather than a hand-written one.
"""

from __future__ import annotations

import json
import re

_GO_EXTRA_ESCAPES = str.maketrans(
    {
        "<": "\\u003c",
        ">": "\\u003e",
        "&": "\\u0026",
        "\u2028": "\\u2028",
        "\u2029": "\\u2029",
    }
)
_SURROGATE = re.compile("[\ud800-\udfff]")


def marshal_indent(value: object) -> bytes:
    """``value`` as Go's ``json.MarshalIndent(value, "", "  ")`` writes it (no trailing
    newline). The characters Go escapes beyond Python can only occur inside strings (the JSON
    structure around them is ASCII punctuation, digits and ``true``/``false``), so they are
    replaced in the whole text."""
    text = json.dumps(value, indent=2, ensure_ascii=False, allow_nan=False)
    return _SURROGATE.sub("\ufffd", text).translate(_GO_EXTRA_ESCAPES).encode()
