"""The emulation toolkit, unit-tested once on a fake clock (drivers compose it)."""

from __future__ import annotations

import re

import pytest

from mqabstract import InvalidName, wire
from mqabstract.clock import FakeClock
from mqabstract.emulation import (
    LeaseTable,
    NativeFilter,
    Pattern,
    Routes,
    Tiers,
    dead_headers,
    dead_letter_from,
    fit_name,
    next_hop,
    pick,
    replay_headers,
)

SAFE = re.compile(r"[A-Za-z0-9_-]+")


# -- leases --------------------------------------------------------------------------------
def test_lease_settles_before_deadline_and_is_stale_at_it() -> None:
    clock = FakeClock()
    table: LeaseTable[str] = LeaseTable(clock)
    a, b = table.grant("a", 5.0), table.grant("b", 5.0)
    clock.advance(4.999)
    assert table.take(a) == "a"
    assert table.take(a) is None  # settled once
    clock.advance(0.001)  # exactly the deadline: stale, like the portable rule
    assert table.take(b) is None
    assert table.expired() == ["b"]
    assert len(table) == 0


def test_lease_extend_moves_the_deadline_and_expiry_order() -> None:
    clock = FakeClock()
    table: LeaseTable[str] = LeaseTable(clock)
    a, b = table.grant("a", 1.0), table.grant("b", 2.0)
    assert table.next_deadline() == clock.monotonic() + 1.0
    clock.advance(0.5)
    assert table.extend(a, 3.0)
    assert table.deadline(a) == clock.monotonic() + 3.0
    clock.advance(1.5)  # b's deadline; a's old one passed, its new one did not
    assert table.expired() == ["b"]
    assert table.next_deadline() == table.deadline(a)
    clock.advance(2.0)
    assert not table.extend(a, 1.0)  # past its deadline: cannot be revived
    assert table.expired() == ["a"]
    assert table.next_deadline() is None
    assert not table.extend(b, 1.0)


def test_lease_drop_and_clear() -> None:
    table: LeaseTable[tuple[str, int]] = LeaseTable(FakeClock())
    for i in range(4):
        table.grant(("p0" if i % 2 else "p1", i), 1.0)
    assert sorted(table.drop(lambda item: item[0] == "p0")) == [("p0", 1), ("p0", 3)]
    assert sorted(table) == [("p1", 0), ("p1", 2)]
    assert len(table.clear()) == 2 and len(table) == 0


def test_lease_start_is_the_receive_start() -> None:
    clock = FakeClock()
    table: LeaseTable[str] = LeaseTable(clock)
    start = clock.monotonic()
    clock.advance(0.75)  # the broker call took this long
    token = table.grant("x", 1.0, start=start)
    clock.advance(0.25)
    assert table.take(token) is None


# -- delays --------------------------------------------------------------------------------
def test_tiers_never_release_early() -> None:
    tiers = Tiers((100, 1000, 10_000))
    assert tiers.tier_for(0.05) == 100  # below the smallest
    assert tiers.tier_for(0.1) == 100
    assert tiers.tier_for(9.99) == 1000
    assert tiers.tier_for(3600) == 10_000
    assert list(tiers) == [100, 1000, 10_000]
    # hop through the ladder: the total wait is the delay, rounded up to the smallest tier
    left, total = 12.345, 0.0
    while left > 0:
        step = tiers.tier_for(left) / 1000
        total += step
        left -= step
    assert 12.345 <= total < 12.345 + 0.1
    with pytest.raises(ValueError):
        Tiers((1000, 100))


def test_next_hop_rounds_up_and_caps() -> None:
    assert next_hop(0.2, 900) == 1
    assert next_hop(899.01, 900) == 900
    assert next_hop(86_400, 900) == 900
    assert next_hop(-3, 900) == 0


# -- patterns ------------------------------------------------------------------------------
@pytest.mark.parametrize(("pattern", "expected"), [
    ("a.b", NativeFilter("a.b", None, None, True)),
    ("a.#", NativeFilter("a", "a.", None, True)),
    ("a.*", NativeFilter("a", "a.", None, False)),
    ("a.*.c", NativeFilter("a", "a.", None, False)),
    ("#.c", NativeFilter("c", None, ".c", True)),
    ("*.c", NativeFilter("c", None, ".c", False)),
    ("#", NativeFilter(None, None, None, True)),
    ("*", NativeFilter(None, None, None, False)),
    ("#.b.#", NativeFilter(None, None, None, False)),
])
def test_native_filter_is_a_superset_and_complete_only_when_exact(
        pattern: str, expected: NativeFilter) -> None:
    p = Pattern(pattern)
    f = p.native_filter()
    assert f == expected
    topics = ["a", "b", "c", "a.b", "a.c", "b.c", "a.b.c", "a.x.c", "x.b.y", "ab.c", "a.bc"]
    for topic in topics:
        admitted = (f.exact is None and f.prefix is None and f.suffix is None) or (
            topic == f.exact or (f.prefix is not None and topic.startswith(f.prefix))
            or (f.suffix is not None and topic.endswith(f.suffix)))
        if p.matches(topic):
            assert admitted, (pattern, topic)
        elif f.complete:
            assert not admitted, (pattern, topic)


def test_pattern_parts_and_validation() -> None:
    p = Pattern("orders.*.eu.#.paid")
    assert p.words == ("orders", "*", "eu", "#", "paid")
    assert p.head == ("orders",) and p.tail == ("paid",) and not p.literal
    assert Pattern("a.b").literal and Pattern("a.b").tail == ()
    assert p.matches("orders.x.eu.paid") and not p.matches("orders.eu.paid")
    with pytest.raises(InvalidName):
        Pattern("a..b")


# -- routes --------------------------------------------------------------------------------
@pytest.mark.parametrize(("topic", "expected"), [
    ("a.b", ("exact", "star", "tail", "all")),
    ("a", ("tail", "all")),  # '#' matches zero words; '*' needs exactly one
    ("a.b.c", ("tail", "all", "mid")),
    ("a.x.y.c", ("tail", "all", "mid")),
    ("a.c", ("star", "tail", "all", "mid")),
    ("b.a", ("all",)),
    ("ab", ("all",)),  # words match whole, never as a prefix
])
def test_routes_follow_the_pattern_rules_in_add_order(
        topic: str, expected: tuple[str, ...]) -> None:
    routes: Routes[str] = Routes()
    for group, pattern in [("exact", "a.b"), ("star", "a.*"), ("tail", "a.#"),
                           ("all", "#"), ("mid", "a.#.c")]:
        routes.add(group, pattern)
    assert routes.groups_for(topic) == expected


def test_routes_cache_is_dropped_when_the_group_set_changes() -> None:
    routes: Routes[int] = Routes()
    routes.add(1, "orders.#")
    first = routes.groups_for("orders.eu")
    assert first == (1,) and routes.groups_for("orders.eu") is first  # cached
    routes.add(2, "*.eu")
    assert routes.groups_for("orders.eu") == (1, 2)
    routes.add(1, "orders.us")  # a known id takes its new pattern
    assert routes.groups_for("orders.eu") == (2,)
    routes.remove(2)
    assert routes.groups_for("orders.eu") == () and len(routes) == 1
    routes.remove(99)  # unknown: nothing happens
    routes.replace([(3, "#"), (4, "orders.eu")])
    assert routes.groups_for("orders.eu") == (3, 4) and routes.groups_for("orders.us") == (3,)
    with pytest.raises(InvalidName):
        routes.add(5, "orders..eu")
    assert len(routes) == 2


def test_routes_cache_is_bounded() -> None:
    routes: Routes[str] = Routes(max_topics=2)
    routes.add("g", "t.*")
    for i in range(5):
        assert routes.groups_for(f"t.{i}") == ("g",)
        assert len(routes._cache) <= 2
    assert routes.groups_for("u.1") == ()


# -- names ---------------------------------------------------------------------------------
def test_fit_name_keeps_what_fits_and_digests_the_rest() -> None:
    assert fit_name("orders", 80, safe=SAFE) == "orders"
    long = "x" * 100
    fitted = fit_name(long, 80, safe=SAFE)
    assert len(fitted) == 80 and fitted.startswith("x" * 69 + "-")
    assert fit_name("a.b", 80, safe=SAFE) != fit_name("a_b", 80, safe=SAFE) == "a_b"
    assert fit_name("g-dlq", 80, reserved_suffixes=("-dlq",)) != "g-dlq"
    assert len(fit_name("é" * 200, 255).encode()) <= 255  # limits are bytes
    assert re.fullmatch(r"[0-9a-f]{48}", fit_name(long, 40, digest_chars=48, keep_head=False))
    with pytest.raises(ValueError):
        fit_name(long, 5)


def test_fit_name_is_injective_on_a_sample() -> None:
    names = [f"g{i}" + "." * (i % 3) + "y" * (i % 90) for i in range(500)]
    names += [n.replace(".", "_") for n in names]
    fitted = {fit_name(n, 40, safe=SAFE) for n in set(names)}
    assert len(fitted) == len(set(names))


# -- dead letters --------------------------------------------------------------------------
def test_dead_letter_round_trip_and_replay() -> None:
    headers: dict[str, object] = {"user": b"v", wire.ID: "m1", wire.TOPIC: "a.b",
                                  wire.PUBLISHED_AT: "1700000000.25", "x-broker": 1}
    headers.update(dead_headers("poison", 3, 1_700_000_100.5))
    dl = dead_letter_from(headers, b"body", id="native", topic="native.topic",
                          skip=("x-broker",))
    assert (dl.id, dl.topic, dl.attempts, dl.reason) == ("m1", "a.b", 3, "poison")
    assert dl.headers == {"user": "v"}
    assert dl.published_at.timestamp() == 1_700_000_000.25
    assert dl.dead_lettered_at is not None
    assert dl.dead_lettered_at.timestamp() == 1_700_000_100.5
    replayed = replay_headers(headers)
    assert wire.REASON not in replayed and wire.ATTEMPT not in replayed
    assert replayed[wire.ID] == "m1"
    plain = dead_letter_from({}, b"", id="native", topic="t", published_at=5.0)
    assert (plain.id, plain.topic, plain.attempts, plain.dead_lettered_at) == (
        "native", "t", 0, None)


def test_pick_by_ids_keeps_order() -> None:
    rows = [("a", 1), ("b", 2), ("c", 3)]
    assert pick(rows, None, lambda r: r[0]) == rows
    assert pick(rows, {"c", "a", "zz"}, lambda r: r[0]) == [("a", 1), ("c", 3)]


def test_waker_wakes_only_the_written_group_and_never_misses_an_earlier_write() -> None:
    import threading

    from mqabstract.emulation.wakeup import Waker

    waker = Waker()
    seen = waker.stamp(1)
    assert waker.wait(1, seen, 0.01) is False  # nothing written: a plain timeout
    waker.wake({2})
    assert waker.wait(1, seen, 0.01) is False  # another group's write: still asleep
    waker.wake({1})  # written after the stamp, before the wait: not lost
    assert waker.wait(1, seen, 30) is True
    seen = waker.stamp(1)
    threading.Timer(0.05, waker.wake).start()  # everyone (close, a clock jump)
    assert waker.wait(1, seen, 30) is True
