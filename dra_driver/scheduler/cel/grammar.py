"""celpy's CEL grammar as a lark LALR parser whose analysis is cached in a private directory.

celpy builds its parser (``celpy.celparser.CELParser``) from its grammar on first use in each
process: lark's LALR analysis of it costs about 0.3 s quiet (1 s under load), a fifth of
``tessera explain --kubeconfig``'s 1.5 s goal on 64 nodes, and it is the same every time. lark
can keep that analysis in a file (its ``cache`` option; loading it takes about 0.02 s) and checks
on load that the file was made from the same grammar and options (a SHA-256 of both on its first
line), so a stale file (celpy or lark upgraded) is rebuilt. The file is pickled, and unpickling
runs code: it is only read from a directory of the user's own that nobody else can write to
(:func:`private_dir`); anywhere else the parser is built without a cache. Same grammar, same
options, same errors as ``CELParser`` (a syntax error is its ``CELParseError``).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import celpy.celparser as celparser
import lark
from celpy.celparser import CELParseError, CELParser


def private_dir(path: Path) -> Path | None:
    """``path``, created (0700) when missing, when it is a directory of this user's that no one
    else can write to; None otherwise (then nothing is cached)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError:
        return None
    mine = st.st_uid == os.getuid() and stat.S_ISDIR(st.st_mode)
    return path if mine and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) else None


class CachedCelParser:
    """``CELParser``'s ``parse``, its lark parser loaded from (or saved to) ``cache_dir``."""

    def __init__(self, cache_dir: Path) -> None:
        grammar = (Path(celparser.__file__).parent / "cel.lark").read_text()
        where = private_dir(cache_dir)
        cache: str | bool = False
        if where is not None:
            cache = str(where / f"cel-lark-{lark.__version__}.cache")
        self._lark = lark.Lark(
            grammar,
            # celpy's options (celpy/celparser.py, CELParser.__init__), so the trees are its
            parser="lalr",
            start="expr",
            debug=True,
            g_regex_flags=re.M,
            lexer_callbacks={"IDENT": CELParser.ambiguous_literals},
            propagate_positions=True,
            maybe_placeholders=False,
            priority="invert",
            cache=cache,
        )

    def parse(self, text: str) -> lark.Tree[lark.Token]:
        """The parse tree of ``text``; CELParseError (line, column, context) on a syntax
        error, as ``CELParser.parse`` raises it."""
        try:
            return self._lark.parse(text)
        except (lark.exceptions.UnexpectedToken, lark.exceptions.UnexpectedCharacters) as ex:
            raise CELParseError(
                ex.get_context(text), *ex.args, line=ex.line, column=ex.column
            ) from None


__all__ = ["CachedCelParser", "private_dir"]
