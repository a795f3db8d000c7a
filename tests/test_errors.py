"""PublishError built from per-message outcomes (the one place every driver builds it)."""

from __future__ import annotations

import pytest

from mqabstract import ConnectionFailed, MQError, NotSent, PublishError, Timeout


def test_from_outcomes_lists_confirmed_ids_and_failed_indexes() -> None:
    down = ConnectionFailed("broker went away")
    later = NotSent("not sent: an earlier message of the batch failed")
    err = PublishError.from_outcomes(["a", "b", "c", "d"], [None, down, later, None])
    assert err.published == ["a", "d"]
    assert err.failed == {1: down, 2: later}
    assert err.cause is down and err.retryable and isinstance(err, MQError)
    assert str(err) == "2 of 4 messages not confirmed: broker went away"


def test_the_cause_is_the_first_real_failure_not_a_not_sent_one() -> None:
    """SQS lanes: an earlier index can be 'not sent' behind a later index's failure."""
    slow = Timeout("sqs: no answer")
    err = PublishError.from_outcomes(["a", "b", "c"], [NotSent("not sent"), None, slow],
                                     by="SNS")
    assert err.cause is slow and err.published == ["b"]
    assert str(err) == "2 of 3 messages not confirmed by SNS: sqs: no answer"


def test_nothing_confirmed_still_names_the_cause() -> None:
    first, second = ConnectionFailed("x"), ConnectionFailed("y")
    err = PublishError.from_outcomes(["a", "b"], [first, second])
    assert err.published == [] and err.cause is first


def test_cause_of_a_hand_built_error() -> None:
    assert PublishError("m", published=["a"], failed={}).cause is None
    only = NotSent("not sent")
    assert PublishError("m", published=[], failed={3: only}).cause is only


def test_ids_and_outcomes_must_line_up() -> None:
    with pytest.raises(ValueError):
        PublishError.from_outcomes(["a"], [None, ConnectionFailed("x")])
