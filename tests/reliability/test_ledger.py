"""The fault suite's checker itself (no broker): what it must catch."""

from __future__ import annotations

from datetime import datetime, timezone
from types import SimpleNamespace

from mqabstract import DeadLetter

from .support import Ledger, collect_dead


def _dead(mid: str, attempts: int) -> DeadLetter:
    now = datetime.now(timezone.utc)
    return DeadLetter(id=mid, topic="t", body=b"", headers={}, key=None, priority=0,
                      published_at=now, attempts=attempts, reason="max attempts",
                      dead_lettered_at=now)


def test_a_dead_letter_written_twice_for_one_id_is_a_problem() -> None:
    """collect_dead records every entry the listing shows (it kept a dict by id, so a
    second dead letter of one id overwrote the first and no check could see it)."""
    listing = [_dead("a", 3), _dead("b", 3), _dead("a", 3)]
    broker = SimpleNamespace(capabilities=SimpleNamespace(supports=lambda _f: True),
                             dead_letters=lambda group, limit: listing)
    ledger = Ledger(max_attempts=3)
    for mid in ("a", "b"):
        ledger.confirm(mid, b"x")
        for attempt in (1, 2, 3):
            start = float(attempt)
            ledger.deliver(mid, attempt, ledger.expected[mid], holder="here", start=start,
                           deadline=start + 1)
    collect_dead(broker, "g", ledger)  # type: ignore[arg-type]
    assert ledger.dead == {"a": 3, "b": 3}
    found = ledger.problems()
    assert found == ["[dead-letters] dead-lettered more than once: a x2"], found
