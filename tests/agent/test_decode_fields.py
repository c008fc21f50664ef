"""agent.decode.fields: the one field reader's words (path, value, what is allowed)."""

import pytest

from agent.decode import fields
from agent.decode.fields import FieldError, Shape


@pytest.mark.parametrize(
    ("read", "value", "message"),
    [
        (fields.text, None, "a.b: missing"),
        (fields.text, 7, "a.b: expected a string, got an integer: 7"),
        (fields.integer, "2", 'a.b: expected an integer, got a string: "2"'),
        (fields.integer, True, "a.b: expected an integer, got a boolean: true"),
        (fields.obj, [1], "a.b: expected an object, got a list: [1]"),
        (fields.items, "x", 'a.b: expected a list, got a string: "x"'),
        (fields.number, "1", 'a.b: expected a number, got a string: "1"'),
        (fields.flag, "yes", 'a.b: expected true or false, got a string: "yes"'),
    ],
)
def test_a_wrong_value_names_the_path_the_kind_and_the_value(read, value, message):
    with pytest.raises(FieldError) as e:
        read(value, "a.b")
    assert str(e.value) == message
    assert e.value.path == "a.b"


def test_limits_and_choices_say_what_is_allowed():
    with pytest.raises(FieldError, match=r"^x.count: must be >= 1, got 0$"):
        fields.integer(0, "x.count", low=1)
    with pytest.raises(FieldError, match=r'^x.kind: "tpu" is not allowed; allowed: gpu, mig$'):
        fields.one_of("tpu", "x.kind", ("gpu", "mig"))
    with pytest.raises(FieldError, match=r"^x.n: must be >= 0, got -1$"):
        fields.number(-1, "x.n", low=0)
    assert fields.flag(None, "x") is False
    with pytest.raises(FieldError, match="missing"):
        fields.texts(None, "x", required=True)
    assert fields.texts(None, "x") == ()


def test_a_long_or_unprintable_value_stays_one_short_line():
    text = fields.shown("a" * 500)
    assert len(text) < 100 and "502 characters" in text
    assert fields.shown("a\x1eb") == '"a\\u001eb"'


def test_unknown_fields_name_the_path_and_what_is_allowed():
    with pytest.raises(fields.UnknownField) as e:
        fields.check_known({"a": 1, "turbo": 2}, "p.sharing", ("a", "b"))
    assert str(e.value) == "p.sharing: unknown field(s) turbo; allowed: a, b"
    shape = Shape({"spec": Shape({"items": Shape({"name": None}), "labels": Shape(each=None)})})
    found = fields.first_unknown(
        {"spec": {"labels": {"any": 1}, "items": [{"name": 1}, {"nmae": 2}]}}, shape
    )
    assert found is not None and found.field == "spec.items[1].nmae"
    assert found.allowed == ("name",)
    assert fields.first_unknown({"spec": {"items": "not a list"}}, shape) is None
