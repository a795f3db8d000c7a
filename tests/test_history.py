"""The reliability suite's history checker (tests/reliability/history.py), on hand-made
histories: a clean one passes; for each rule, a history that breaks only that rule yields
violations naming only that rule, and one right at the rule's boundary passes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from tests.reliability.history import (
    ACK_STARTED,
    ACKED,
    LEASE_EXPIRED,
    NACKED,
    RULES,
    TOLERANCE,
    History,
    check,
)

MARGIN = 1.0
LEASE = 2.0


def clean() -> History:
    """Every rule exercised and holding.

    - ``a``: delivered to w1, acked.
    - ``b``: w1 is killed holding it; w2 (receiving from 1.5) gets it again at 2.5, inside
      max(deadline 2.0, 1.5) + margin 1.0.
    - ``c``: nacked twice, dead-lettered on the final attempt (3 of 3); each nack lets the
      next delivery start before the earlier deadline.
    - ``d``: published twice (a failed publish retried): its second copy starts at 1 again.
    - ``e``: w3 is frozen across its deadline; w2 gets it in time; w3 wakes, its ack expires.
    """
    h = History(max_attempts=3)
    for mid in "abce":
        h.publish(mid, f"dig-{mid}")
    h.publish("d", "dig-d", confirmed=False)
    h.publish("d", "dig-d")
    h.receiving("w1", 0.0, None)
    h.receiving("w2", 1.5, None)
    h.receiving("w3", 0.0, None)
    h.deliver("a", 1, "w1", 0.0, 2.0, "dig-a", returned=0.1)
    h.settle("a", "w1", ACK_STARTED, 0.2)
    h.settle("a", "w1", ACKED, 0.2)
    h.deliver("b", 1, "w1", 0.0, 2.0, "dig-b", returned=0.1)
    h.killed("w1", 1.0)
    h.deliver("b", 2, "w2", 2.5, 4.5, "dig-b", returned=2.6)
    h.settle("b", "w2", ACKED, 2.7)
    for n, start in enumerate((1.6, 1.8, 2.0), 1):
        h.deliver("c", n, "w2", start, start + LEASE, "dig-c", returned=start + 0.05)
        if n < 3:
            h.settle("c", "w2", NACKED, start + 0.1)
    h.dead_letter("c", 3, "nacked on final attempt (3 of 3)")
    h.deliver("d", 1, "w2", 1.6, 3.6, "dig-d", returned=1.7)
    h.settle("d", "w2", ACKED, 1.75)
    h.deliver("d", 1, "w2", 1.9, 3.9, "dig-d", returned=1.95)
    h.settle("d", "w2", ACKED, 1.96)
    h.deliver("e", 1, "w3", 0.0, 2.0, "dig-e", returned=0.1)
    h.frozen("w3", 0.5, 3.5)
    h.deliver("e", 2, "w2", 2.4, 4.4, "dig-e", returned=2.5)
    h.settle("e", "w2", ACKED, 2.55)
    h.settle("e", "w3", LEASE_EXPIRED, 3.6)
    for mid in "abcde":
        h.effect(mid)
    return h


def _replace_delivery(h: History, mid: str, attempt: int, /, **changes: object) -> History:
    """The history with delivery (mid, attempt) changed (the first such one)."""
    for i, d in enumerate(h.deliveries):
        if d.id == mid and d.attempt == attempt:
            h.deliveries[i] = dataclasses.replace(d, **changes)  # type: ignore[arg-type]
            return h
    raise AssertionError(f"no delivery {mid}/{attempt}")


def _drop_settle(h: History, mid: str, outcome: str) -> History:
    h.settles = [s for s in h.settles if not (s.id == mid and s.outcome == outcome)]
    return h


def _run(h: History, **kw: object) -> list[str]:
    return check(h, release_margin=MARGIN, **kw)  # type: ignore[arg-type]


def test_clean_history_passes() -> None:
    assert _run(clean()) == []


# -- one breaking history per rule, and one at its boundary ---------------------------------
def _lost_unacked() -> History:
    return _drop_settle(_drop_settle(clean(), "a", ACKED), "a", ACK_STARTED)


def _lost_stranger() -> History:
    h = clean()
    h.deliver("zz", 1, "w2", 3.0, 5.0, "dig-zz")
    h.settle("zz", "w2", ACKED, 3.1)
    h.effects = None  # (an effect for it would break "effects" too)
    return h


def _lost_other_bytes() -> History:
    return _replace_delivery(clean(), "b", 2, digest="other")


def _lost_ack_never_delivered() -> History:
    h = clean()
    h.settle("ghost", "w2", ACKED, 3.0)
    return h


def _attempts_repeat() -> History:
    return _replace_delivery(clean(), "b", 2, attempt=1)


def _attempts_third_copy() -> History:
    h = clean()  # "d" was published twice: a third start at 1 is one too many
    h.deliver("d", 1, "w2", 2.2, 4.2, "dig-d", returned=2.25)
    h.settle("d", "w2", ACKED, 2.3)
    return h


def _attempts_go_back() -> History:
    # [1, 3, 2] in receive-start order, even though recorded in another order
    h = clean()
    h.deliver("x", 2, "w2", 6.0, 8.0, "dig-x")
    h.deliver("x", 1, "w2", 2.0, 4.0, "dig-x")
    h.deliver("x", 3, "w2", 5.0, 7.0, "dig-x")
    h.publish("x", "dig-x")
    for t in (2.1, 5.1, 6.1):
        h.settle("x", "w2", NACKED if t < 6 else ACKED, t)
    h.effect("x")
    return h


def _overlapping(first: tuple[float, float], second: tuple[float, float], killed: float,
                 acked: float | None = 3.06) -> History:
    """``g``: attempt 1 to w4 by a receive call ``first`` (start, return), attempt 2 to w2
    by a receive call ``second``; w4 is killed at ``killed`` holding it, w2 acks it at
    ``acked``. (The chaos runs' "attempt 2, then attempt 1": w2's receive call waited,
    w4's returned at once from its buffer, w4 was killed, and the broker gave the message
    back to w2's waiting call, counted.)"""
    h = clean()
    h.publish("g", "dig-g")
    h.receiving("w4", 0.0, None)
    h.deliver("g", 1, "w4", first[0], first[0] + LEASE, "dig-g", returned=first[1])
    h.killed("w4", killed)
    h.deliver("g", 2, "w2", second[0], second[0] + LEASE, "dig-g", returned=second[1])
    if acked is not None:
        h.settle("g", "w2", ACK_STARTED, acked)
        h.settle("g", "w2", ACKED, acked)
    h.effect("g")
    return h


def _attempts_lower_after_higher_returned() -> History:
    # w2's call returned attempt 2 (2.95) before w4's call even started (3.0)
    return _overlapping((3.0, 3.001), (2.9, 2.95), killed=3.02, acked=2.96)


def _attempts_back_in_one_call() -> History:
    # two copies of "g" in one receive call of w2: attempt 2, then attempt 1
    h = _overlapping((3.0, 3.001), (3.0, 3.001), killed=3.02, acked=3.005)
    h.deliveries = [d for d in h.deliveries if d.id != "g"]
    h.deliver("g", 2, "w2", 3.0, 3.0 + LEASE, "dig-g", returned=3.001)
    h.deliver("g", 1, "w2", 3.0, 3.0 + LEASE, "dig-g", returned=3.001)
    return h


def _second_holder_long_poll_before_the_kill() -> History:
    # w2's waiting call got attempt 2 at 3.01 at the latest; w4 (attempt 1, not settled)
    # was killed only at 3.05: two holders at once
    return _overlapping((3.0, 3.001), (2.98, 3.01), killed=3.05)


def _second_holder_early() -> History:
    h = clean()  # a second holder gets "a" while w1's lease runs and before w1's ack
    h.deliver("a", 2, "w2", 0.15, 2.15, "dig-a", returned=0.18)
    h.settle("a", "w2", ACKED, 0.19)
    return h


def _second_holder_frozen_holder() -> History:
    # a frozen holder keeps its lease: "e" back to w2 by 1.95 is inside w3's lease (2.0)
    return _replace_delivery(clean(), "e", 2, start=1.9, deadline=3.9, returned=1.95)


def _release_late() -> History:
    return _replace_delivery(clean(), "b", 2, start=3.0 + 2 * TOLERANCE, deadline=5.0,
                             returned=3.1)


def _release_late_after_freeze() -> History:
    # w3 frozen across its deadline; w2 receiving all along from 1.5: due by 3.0
    return _replace_delivery(clean(), "e", 2, start=3.05, deadline=5.05, returned=3.1)


def _dead_letter_early() -> History:
    h = clean()
    h.dead_letters[0] = dataclasses.replace(h.dead_letters[0], attempts=2)
    return h


def _dead_letter_twice() -> History:
    h = clean()
    h.dead_letter("c", 3, "max attempts (3) exceeded")
    return h


def _delivered_beyond_max() -> History:
    h = clean()
    h.deliver("c", 4, "w2", 4.5, 6.5, "dig-c", returned=4.55)
    return h


def _late_past_max(late: tuple[int, ...] = (2, 3, 4)) -> History:
    """``f``: seen once by w2, then delivered at ``late`` attempts by receive calls that
    returned after the lease (handed to nobody), then dead-lettered with the last count."""
    h = clean()
    h.publish("f", "dig-f")
    h.deliver("f", 1, "w2", 1.6, 3.6, "dig-f", returned=1.65)
    for n, attempt in enumerate(late):
        h.unseen("f", attempt, "w2", 4.0 + n)
    h.dead_letter("f", 4, "max attempts (3) exceeded")
    h.effect("f")
    return h


def _cut_short() -> History:
    """``f`` seen once, then counted twice more unseen: once by a late receive, once by
    the receive call w1 was killed in (a CALLING without its CALL)."""
    h = _late_past_max((2,))
    h.dead_letters[-1] = dataclasses.replace(h.dead_letters[-1], attempts=3)
    h.cut_short("w1", 0.9, 1.0)
    return h


def _drop_cut(h: History) -> History:
    h.cut = []
    return h


def _effect_twice() -> History:
    h = clean()
    h.effect("a")
    return h


def _effect_missing() -> History:
    h = clean()
    assert h.effects is not None
    del h.effects["b"]
    return h


BREAKS: dict[str, Callable[[], History]] = {
    # past max_attempts with no late delivery to explain it, or with late ones that stayed
    # within max_attempts (a timely receive should have dead-lettered it at 3)
    "dead-letters/past-max-unexplained": lambda: _late_past_max(()),
    "dead-letters/late-within-max": lambda: _late_past_max((2, 3)),
    "dead-letters/more-unseen-than-cut-calls": lambda: _drop_cut(_cut_short()),
    "lost/unacked": _lost_unacked,
    "lost/stranger": _lost_stranger,
    "lost/other-bytes": _lost_other_bytes,
    "lost/ack-never-delivered": _lost_ack_never_delivered,
    "attempts/repeat": _attempts_repeat,
    "attempts/third-copy": _attempts_third_copy,
    "attempts/go-back": _attempts_go_back,
    "attempts/lower-after-a-returned-higher": _attempts_lower_after_higher_returned,
    "attempts/back-in-one-receive-call": _attempts_back_in_one_call,
    "second-holder/early": _second_holder_early,
    "second-holder/frozen-holder": _second_holder_frozen_holder,
    "second-holder/long-poll-returned-before-the-kill": _second_holder_long_poll_before_the_kill,
    "release/late-after-kill": _release_late,
    "release/late-after-freeze": _release_late_after_freeze,
    "release/late-after-receiver-starts": lambda: _late_receiver(6.0 + 2 * TOLERANCE),
    "release/late-after-a-receiver-that-died-within-margin":
        lambda: _receiver_killed_at(2.5, 6.0 + 2 * TOLERANCE),
    "release/late-for-a-receiver-that-stayed": lambda: _receiver_killed_at(3.1, 4.0),
    "release/late-even-to-a-call-a-kill-cut-short":
        lambda: _released_to_a_cut_call(3.0 + 2 * TOLERANCE),
    "dead-letters/early": _dead_letter_early,
    "dead-letters/twice": _dead_letter_twice,
    "dead-letters/beyond-max": _delivered_beyond_max,
    "effects/twice": _effect_twice,
    "effects/missing": _effect_missing,
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_a_broken_rule_is_reported_by_that_rule_only(case: str) -> None:
    rule = case.split("/")[0]
    found = _run(BREAKS[case]())
    assert found, f"{case}: no violation"
    assert all(v.startswith(f"[{rule}]") for v in found), found
    # ... and by the rule's own function, alone
    h = BREAKS[case]()
    alone = (RULES[rule](h, MARGIN) if rule == "release"
             else RULES[rule](h, None) if rule == "dead-letters" else RULES[rule](h))
    assert alone == found


def test_every_rule_has_a_breaking_case() -> None:
    assert {c.split("/")[0] for c in BREAKS} == set(RULES)


def _lost_in_doubt() -> History:
    h = _drop_settle(clean(), "a", ACKED)  # w1 started the ack and was killed inside it
    h.faults[0] = dataclasses.replace(h.faults[0], at=0.3)
    _replace_delivery(h, "b", 2, start=2.5)
    return h


def _attempts_copy_restart() -> History:
    return clean()  # "d": [1, 1] with two publishes


def _second_holder_at_deadline() -> History:
    h = _drop_settle(_drop_settle(clean(), "a", ACKED), "a", ACK_STARTED)
    h.settle("a", "w1", LEASE_EXPIRED, 2.5)  # w1 was slow: its lease ran out
    h.faults[0] = dataclasses.replace(h.faults[0], at=2.6)  # (killed only after that)
    h.deliver("a", 2, "w2", 1.5, 3.5, "dig-a", returned=2.0 - TOLERANCE / 2)
    h.settle("a", "w2", ACKED, 2.1)
    return h


def _second_holder_right_after_settle() -> History:
    h = clean()  # w1's ack at 0.2 lands while w2's receive call (0.15 .. 0.25) waits
    h.deliver("a", 2, "w2", 0.15, 2.15, "dig-a", returned=0.25)
    h.settle("a", "w2", ACKED, 0.26)
    return h


def _second_holder_long_poll() -> History:
    # w2's receive call started before w3's deadline and returned "e" only after it
    return _replace_delivery(clean(), "e", 2, start=1.8, deadline=3.8, returned=2.1)


def _second_holder_after_kill() -> History:
    h = clean()  # a killed holder holds nothing: "b" may come back before its deadline
    return _replace_delivery(h, "b", 2, start=1.6, deadline=3.6, returned=1.7)


def _release_at_bound() -> History:
    return _replace_delivery(clean(), "b", 2, start=3.0 + TOLERANCE / 2, deadline=5.0,
                             returned=3.1)


def _b_killed_in_w1(w2_from: float) -> History:
    """w1 receives "b" (attempt 1, deadline 2.0) and is killed at 1.0; w2 receives from
    ``w2_from`` on."""
    h = History(max_attempts=3)
    h.publish("b", "dig-b")
    h.receiving("w1", 0.0, None)
    h.receiving("w2", w2_from, None)
    h.deliver("b", 1, "w1", 0.0, 2.0, "dig-b", returned=0.1)
    h.killed("w1", 1.0)
    return h


def _back_to_w2(h: History, attempt: int, start: float) -> History:
    """"b" delivered to w2 as ``attempt`` from ``start`` and acked."""
    h.deliver("b", attempt, "w2", start, start + LEASE, "dig-b", returned=start + 0.1)
    h.settle("b", "w2", ACKED, start + 0.2)
    return h


def _late_receiver(start: float) -> History:
    """w1 is killed holding "b"; nobody else receives until w2 starts at 5.0."""
    return _back_to_w2(_b_killed_in_w1(5.0), 2, start)


def _released_to_a_cut_call(cut_start: float) -> History:
    """w1 is killed holding "b" (deadline 2.0); w2 receives from 1.5 on, so "b" is due by
    3.0. w3's receive call, from ``cut_start``, is cut short by a kill: it took attempt 2
    unrecorded, and "b" came back to w2 as attempt 3 after w3's lease."""
    h = _b_killed_in_w1(1.5)
    h.killed("w3", cut_start + 0.5)
    h.cut_short("w3", cut_start, cut_start + 0.5)
    return _back_to_w2(h, 3, cut_start + LEASE)


def _release_waits_for_a_receiver() -> History:
    return _late_receiver(6.0)  # due by max(2.0, 5.0) + 1.0


def _receiver_killed_at(killed: float, back: float) -> History:
    """w3 is receiving at b's deadline (2.0) and killed at ``killed``; w2 receives from
    5.0; b comes back at ``back``. Due by 3.0 if w3 stays up past 3.0, else by 6.0."""
    h = _late_receiver(back)
    h.receiving("w3", 1.9, 2.1)
    h.killed("w3", killed)
    return h


def _release_short_freeze() -> History:
    h = clean()  # thawed before the deadline and acked: nothing to release
    h.faults = [f for f in h.faults if f.holder != "w3"]
    h.frozen("w3", 0.5, 1.5)
    h.settles = [s for s in h.settles if s.holder != "w3"]
    h.settle("e", "w3", ACKED, 1.6)
    h.deliver("e", 2, "w2", 9.0, 11.0, "dig-e")  # a late duplicate after the ack: allowed
    h.deliveries = [d for d in h.deliveries if not (d.id == "e" and d.start == 2.4)]
    return h


def _dead_letter_explicit() -> History:
    h = clean()  # an explicit dead_letter(reason) at attempt 1 is not judged by attempts
    h.publish("p", "dig-p")
    h.deliver("p", 1, "w2", 2.0, 4.0, "dig-p")
    h.settle("p", "w2", "dead-lettered", 2.1)
    h.dead_letter("p", 1, "invalid payload: bad json")
    h.effect("p")
    return h


BOUNDARIES: dict[str, Callable[[], History]] = {
    "lost/ack-in-doubt": _lost_in_doubt,
    "attempts/copy-restarts-at-1": _attempts_copy_restart,
    # w2's call started first but returned attempt 2 after w4 got attempt 1 and was killed
    "attempts/long-poll-returned-after-a-kill":
        lambda: _overlapping((3.0, 3.001), (2.98, 3.05), killed=3.02),
    "second-holder/within-tolerance-of-deadline": _second_holder_at_deadline,
    "second-holder/settled-during-receive": _second_holder_right_after_settle,
    "second-holder/holder-killed": _second_holder_after_kill,
    "second-holder/long-poll-returned-after-deadline": _second_holder_long_poll,
    "release/within-tolerance-of-bound": _release_at_bound,
    "release/waits-for-a-receiver": _release_waits_for_a_receiver,
    "release/receiver-died-within-margin": lambda: _receiver_killed_at(2.5, 6.0),
    "release/thawed-before-deadline": _release_short_freeze,
    "release/unrecorded-delivery-to-a-call-a-kill-cut-short":
        lambda: _released_to_a_cut_call(2.1),
    "dead-letters/explicit-reason": _dead_letter_explicit,
    "dead-letters/late-deliveries-past-max": _late_past_max,
    "dead-letters/a-kill-cut-a-receive-short": _cut_short,
}


@pytest.mark.parametrize("case", sorted(BOUNDARIES))
def test_a_history_at_the_boundary_passes(case: str) -> None:
    assert _run(BOUNDARIES[case]()) == []


def test_duplicate_dead_letters_pass_when_declared() -> None:
    h = _dead_letter_twice()
    assert _run(h, dead_letter_duplicates="SQS moves a message twice on a retried send") == []


def test_effects_are_not_judged_without_effects() -> None:
    h = clean()
    h.effects = None
    assert _run(h) == []


def test_skipped_rule_is_not_judged_and_needs_a_reason() -> None:
    assert _run(_attempts_repeat(), skip={"attempts": "no attempts in this scenario"}) == []
    with pytest.raises(ValueError, match="reason"):
        _run(_attempts_repeat(), skip={"attempts": " "})
    with pytest.raises(ValueError, match="unknown"):
        _run(clean(), skip={"nonsense": "x"})


def test_missing_data_is_a_violation_not_a_pass() -> None:
    h = clean()
    assert check(h) == ["[release] not judged: kills or freezes recorded but no "
                        "release_margin given"]
    h.windows = []
    assert [v[:24] for v in _run(h)] == ["[release] not judged: fa"]
    h = clean()
    h.max_attempts = None
    assert [v[:27] for v in _run(h)] == ["[dead-letters] not judged: "]


# -- the backend's release clock ------------------------------------------------------------
def _churn(back: float, *, freeze: tuple[float, float] | None = None,
           kill_other: float | None = None) -> History:
    """w1 is killed holding "b" (deadline 2.0); w2 receives all along from 1.5 and gets it
    back at ``back``. Optionally a third consumer w3 is frozen or killed meanwhile."""
    h = History(max_attempts=3)
    h.publish("b", "dig-b")
    h.receiving("w1", 0.0, None)
    h.receiving("w2", 1.5, None)
    h.deliver("b", 1, "w1", 0.0, 2.0, "dig-b", returned=0.1)
    h.killed("w1", 1.0)
    if freeze or kill_other:
        h.receiving("w3", 0.0, None)
    if freeze:
        h.frozen("w3", *freeze)
    if kill_other:
        h.killed("w3", kill_other)
    h.deliver("b", 2, "w2", back, back + LEASE, "dig-b", returned=back + 0.1)
    h.settle("b", "w2", ACKED, back + 0.2)
    return h


@pytest.mark.parametrize("clock, history, ok", [
    # deadline clock: due by 2.0 + 1.0 whatever else happens
    ("deadline", _churn(2.9), True),
    ("deadline", _churn(3.5, kill_other=2.5), False),
    # membership (Kafka): another member leaving at 2.5 restarts the margin: due by 3.5
    ("membership", _churn(3.4, kill_other=2.5), True),
    ("membership", _churn(3.6, kill_other=2.5), False),
    # ... and a change after the margin ran out does not excuse a late one
    ("membership", _churn(4.5, kill_other=3.2), False),
    # unfrozen (SQLite): w3 frozen 1.8..4.0 may hold the write lock: due by 4.0 + 1.0
    ("unfrozen", _churn(4.9, freeze=(1.8, 4.0)), True),
    ("unfrozen", _churn(5.1, freeze=(1.8, 4.0)), False),
    ("deadline", _churn(4.9, freeze=(1.8, 4.0)), False),
])
def test_release_clock_is_the_backends_formula(clock: str, history: History, ok: bool) -> None:
    found = _run(history, release_clock=clock)
    assert (found == []) == ok, found
    assert all(v.startswith("[release]") for v in found)


def test_unknown_release_clock_is_refused() -> None:
    with pytest.raises(ValueError, match="release clock"):
        _run(_churn(2.9), release_clock="sometime")


def test_a_stop_that_never_ends_does_not_hold_the_unfrozen_clock() -> None:
    """A hung in-process consumer (frozen, never thawed) holds no file lock: the SQLite
    clock starts as usual (this looped forever in CI's fault stage)."""
    h = _churn(2.9)
    h.frozen("hung", 1.8, None)
    assert _run(h, release_clock="unfrozen") == []
    late = _churn(3.5)
    late.frozen("hung", 1.8, None)
    assert _run(late, release_clock="unfrozen") != []
