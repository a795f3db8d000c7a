"""A Kafka holder frozen between its fenced commit and its re-publish (the zombie window).

The lease rule: attempts strictly increase per id within a group, ordered by the start of
the receive call that returned each delivery. The Kafka driver re-publishes a nacked or
expired message to the group's retry topic with one attempt more, after a commit that
proves membership (the fence). A holder that freezes right after that fence, past its
session, loses the partition; the new owner delivers the original again with a higher
attempt. When the holder wakes it must not write its copy: delivered later, with a
lower attempt, it would make the attempts go back (CI: ``[1, 6, 2]`` in the chaos run).

Deterministic: the worker stops itself (SIGSTOP) at that exact point (``zombie_worker.py``).
One retry partition (``partitions=1``): the worker owns the only slot, this test's consumer
waits as a standby and takes over once the frozen worker is evicted. ``commit``: frozen
inside the re-publish transaction (offsets sent, not committed) and woken while the
standby's takeover waits for that transaction.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest

import mqabstract

from . import support
from .support import Ledger, Worker, body_for, cleanup, digest, token

LEASE = 2.0


def _url(rel_url: str) -> str:
    return rel_url + ("&" if "?" in rel_url else "?") + "partitions=1"


@pytest.mark.backends("kafka")
@pytest.mark.parametrize("mode", ["nack", "lapse", "commit"])
def test_zombie_copy_never_goes_back(backend: str, rel_url: str, mode: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    url = _url(rel_url)
    tok = token("z")
    topic, pattern, group = f"rel.{tok}.work", f"rel.{tok}.#", f"rel-{tok}"
    monkeypatch.setattr(support, "WORKER", str(Path(__file__).with_name("zombie_worker.py")))
    ledger = Ledger(max_attempts=50, backend=backend)
    # (time the receive call started, attempt) of every delivery of the one message
    seen: list[tuple[float, int, str]] = []
    with mqabstract.connect(url) as mq:
        mq.declare(group, pattern, lease=LEASE, max_attempts=50)
        holder = Worker(url, group, pattern, str(LEASE), mode)
        try:
            assert holder.wait_for("READY", 1, 60), holder.stderr
            mid = f"{tok}-0"
            mq.publish(topic, body_for(mid), id=mid)
            ledger.confirm(mid, body_for(mid))
            assert holder.wait_for("FENCED", 1, 60), (holder.events(), holder.stderr)
            frozen_at = time.monotonic()
            recv = next(e for e in holder.events() if e[0] == "RECV")
            seen.append((float(recv[3]), int(recv[2]), "holder"))
            if mode == "commit":
                # Frozen with its transaction open: the standby's takeover waits for it
                # (require_stable) and must see the outcome, whichever it is. Woken before
                # the transaction times out, the holder commits it.
                timer = threading.Timer(9.0, holder.thaw)
                timer.start()
            with mq.subscribe(group, pattern, lease=LEASE, max_attempts=50) as sub:
                # The frozen holder is evicted after its session (6 s); its message
                # comes back here with a higher attempt.
                limit = time.monotonic() + 60
                while not seen[1:] and time.monotonic() < limit:
                    started = time.monotonic()
                    for msg in sub.receive(10, 0.5):
                        seen.append((started, msg.attempt, "standby"))
                        msg.ack()
                        ledger.ack(msg.id)
                assert seen[1:], f"the message never came back: {holder.events()}"
                holder.thaw()
                # The woken holder finishes what it was doing when it froze; whatever it
                # writes now reaches this consumer (the only one that receives).
                limit = time.monotonic() + 3 * LEASE + 6
                while time.monotonic() < limit:
                    started = time.monotonic()
                    for msg in sub.receive(10, 0.5):
                        seen.append((started, msg.attempt, "standby"))
                        msg.ack()
                if holder.proc.poll() is None:
                    holder.tell()
                assert holder.finish(60) == 0, (holder.events(), holder.stderr)
        finally:
            if holder.proc.poll() is None:
                holder.thaw()
                holder.kill()
            cleanup(mq, group)
    seen.sort()
    attempts = [a for _, a, _ in seen]
    print("zombie", mode, backend, "frozen", round(time.monotonic() - frozen_at, 1),
          "deliveries", seen, "holder", holder.events())
    assert all(b > a for a, b in itertools.pairwise(attempts)), (
        f"attempts of {mid} not strictly increasing in delivery order: {seen}; "
        f"holder: {holder.events()}")
    if mode == "nack":  # refused: its transaction was fenced, nothing was written
        assert ["EXPIRED", mid] in holder.events(), holder.events()
    if mode == "commit" and ["NACKED", mid] in holder.events():
        assert attempts == [1, 2], seen  # the copy, and never the original again
    for started, attempt, who in seen:
        ledger.deliver(mid, attempt, digest(body_for(mid)), holder=who, start=started,
                       deadline=started + LEASE)
    problems = ledger.problems()
    assert not problems, problems
