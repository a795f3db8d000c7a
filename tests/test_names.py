"""Naming rules and AMQP-style pattern matching."""

from __future__ import annotations

import pytest

from mqabstract import InvalidArgument, InvalidName, names


@pytest.mark.parametrize("topic", ["a", "orders.eu.created", "A-b_c.9", "x" * 255])
def test_valid_topics(topic: str) -> None:
    assert names.check_topic(topic) == topic


@pytest.mark.parametrize(
    "topic", ["", ".", "a.", ".a", "a..b", "a b", "a/b", "a.*", "a.#", "ü", "x" * 256, None, 1]
)
def test_invalid_topics(topic: object) -> None:
    with pytest.raises(InvalidName):
        names.check_topic(topic)


@pytest.mark.parametrize(
    ("pattern", "topic", "match"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.b.c", False),
        ("a.*", "a.b", True),
        ("a.*", "a", False),
        ("a.*", "a.b.c", False),
        ("a.#", "a", True),
        ("a.#", "a.b.c", True),
        ("#", "x.y.z", True),
        ("#.z", "z", True),
        ("#.z", "x.z", True),
        ("#.z", "z.x", False),
        ("a.#.z", "a.z", True),
        ("a.#.z", "a.b.c.z", True),
        ("*.*", "a.b", True),
        ("*.*", "a", False),
        ("a.*.#", "a", False),
        ("a.*.#", "a.b", True),
        ("#.#", "a", True),
    ],
)
def test_pattern_matching(pattern: str, topic: str, match: bool) -> None:
    assert names.topic_matches(pattern, topic) is match


@pytest.mark.parametrize("pattern", ["", "a..b", "a*", "a.b#", "*x", "a b"])
def test_invalid_patterns(pattern: str) -> None:
    with pytest.raises(InvalidName):
        names.check_pattern(pattern)


@pytest.mark.parametrize("name", ["mq-attempt", "MQ-x", "aws.trace", "Amazon.x", "", "a b", 5])
def test_reserved_or_bad_header_names(name: object) -> None:
    with pytest.raises(InvalidName):
        names.check_header_name(name)


def test_header_values_and_keys() -> None:
    assert names.check_text_value("tab\tnewline\n ok ✓", "v") == "tab\tnewline\n ok ✓"
    for bad in ("\x00", "\x1b", "\ufffe", "\ud800"):
        with pytest.raises(InvalidArgument):
            names.check_text_value(f"a{bad}b", "v")
    with pytest.raises(InvalidArgument):
        names.check_key("")
    with pytest.raises(InvalidArgument):
        names.check_key("k" * 257)


def test_ids() -> None:
    assert names.check_id("job:1/batch-2.p3#row4") == "job:1/batch-2.p3#row4"
    for bad in ("", "a b", "é", "x" * 129, 7):
        with pytest.raises(InvalidArgument):
            names.check_id(bad)


@pytest.mark.parametrize("value", [["a"], {"a": 1}, {1}, b"topic", 1.5])
def test_unhashable_or_wrong_types_get_typed_errors(value: object) -> None:
    for check in (names.check_topic, names.check_group, names.check_pattern,
                  names.check_header_name):
        with pytest.raises(InvalidName):
            check(value)
