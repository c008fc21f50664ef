"""A hypothesis strategy for any JSON value (what a hostile or broken input file may hold), for
the fuzz tests of the decoders and of ``tessera explain``."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def json_values(*, text: int, keys: int, items: int, leaves: int) -> st.SearchStrategy[Any]:
    """Null, booleans, integers well outside 64 bits, finite floats, strings of at most ``text``
    characters, and lists and objects (keys of at most ``keys`` characters) of at most ``items``
    members, nested up to ``leaves`` scalars in all."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=False)
        | st.text(max_size=text)
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=items)
            | st.dictionaries(st.text(max_size=keys), children, max_size=items)
        ),
        max_leaves=leaves,
    )


def json_paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into the JSON value ``obj`` (keys and list indexes), the root's ``()`` first:
    where a fuzz test replaces or removes a value."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += json_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += json_paths(v, (*prefix, i))
    return out
