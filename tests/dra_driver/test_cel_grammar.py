"""The CEL grammar's parser kept between runs (dra_driver.scheduler.cel.grammar): the same trees
and errors as celpy's, its analysis read back from a private directory only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from celpy.celparser import CELParseError, CELParser

from dra_driver.scheduler.cel.grammar import CachedCelParser
from dra_driver.scheduler.celenv import CelEnvironment

EXPRESSIONS = [
    'device.driver == "gpu.tessera.dev"',
    "device.attributes['gpu.tessera.dev'].profile.startsWith('1g') && true",
    "device.capacity['gpu.tessera.dev'].memory.compareTo(quantity('10Gi')) >= 0",
    "[1, 2, 3].all(x, x > 0) ? false : size({'a': 1}) == 1",
]


@pytest.mark.parametrize("expression", EXPRESSIONS)
def test_trees_are_celpys(tmp_path: Path, expression: str) -> None:
    assert CachedCelParser(tmp_path / "cache").parse(expression) == CELParser().parse(expression)


def test_a_syntax_error_is_celpys(tmp_path: Path) -> None:
    with pytest.raises(CELParseError) as ours:
        CachedCelParser(tmp_path / "cache").parse("device.driver ==")
    with pytest.raises(CELParseError) as theirs:
        CELParser().parse("device.driver ==")
    assert str(ours.value) == str(theirs.value)
    assert (ours.value.line, ours.value.column) == (theirs.value.line, theirs.value.column)


def test_the_analysis_is_saved_once_then_read_back(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    CachedCelParser(cache)
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    (saved,) = cache.iterdir()
    before = saved.stat().st_mtime_ns, saved.read_bytes()
    second = CachedCelParser(cache)  # loaded: lark writes the file only when it built the parser
    assert (saved.stat().st_mtime_ns, saved.read_bytes()) == before
    assert second.parse(EXPRESSIONS[0]) == CELParser().parse(EXPRESSIONS[0])


def test_a_directory_others_can_write_to_is_not_used(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert CachedCelParser(shared).parse(EXPRESSIONS[1]) == CELParser().parse(EXPRESSIONS[1])
    assert list(shared.iterdir()) == []


def test_an_environment_with_a_parser_cache_compiles_as_one_without(tmp_path: Path) -> None:
    cached, plain = CelEnvironment(parser_cache=tmp_path / "cache"), CelEnvironment()
    for expression in EXPRESSIONS[:3]:
        assert cached.compile(expression).reads == plain.compile(expression).reads
