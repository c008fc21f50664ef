"""The one strict decoder for everything Tessera reads that someone else could have written.

Two steps, one module each:

- :mod:`agent.decode.bounds`: bytes to plain JSON data within limits (size, nesting, integer
  digits, YAML aliases and events), before anything looks at the content;
- :mod:`agent.decode.fields`: that data read field by field (types, limits, unknown fields),
  every problem a ``FieldError`` naming the field path, the offending value and what is allowed.

The checkpoint, claims and their files, opaque parameters, the energy and fault files, API
answers and ``tessera explain``'s inputs are all read through these two.
"""

from agent.decode.bounds import (
    MAX_DEPTH,
    MAX_INT_DIGITS,
    MAX_YAML_EVENTS,
    check_depth,
    load_json,
    load_json_fast,
    load_yaml_documents,
)

__all__ = [
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "MAX_YAML_EVENTS",
    "check_depth",
    "load_json",
    "load_json_fast",
    "load_yaml_documents",
]
