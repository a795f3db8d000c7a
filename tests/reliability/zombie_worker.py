"""Subprocess side of ``test_kafka_zombie.py`` (run as a script, not collected by pytest).

    zombie_worker.py URL GROUP PATTERN LEASE MODE

Subscribes, receives one message (``RECV id attempt t``, t = time.monotonic() at the start
of the receive call), then makes the Kafka driver re-publish it: ``nack`` settles it with
``nack()``, ``lapse`` lets its lease run out (the data thread re-publishes it). The driver
is patched so that the process SIGSTOPs itself right after the fence that precedes the
re-publish, before the copy is written (``FENCED`` is printed first): the window a holder
frozen between its fenced checkpoint commit and its write falls into. ``commit`` nacks
too, and stops inside the re-publish transaction instead: its offsets sent, before its
commit (a client-level patch of both clients' transaction commit). After the parent's
SIGCONT it finishes what it was doing; ``nack`` prints ``NACKED`` or ``EXPIRED``; ``commit``
then leaves the group (``CLOSED``: woken during the standby's takeover, it must not take the
only slot back); then it waits for a line on stdin and closes (it never receives again).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import mqabstract
from mqabstract.backends.kafka.subscription import KafkaSubscription


def out(*words: object) -> None:
    sys.stdout.write(" ".join(map(str, words)) + "\n")
    sys.stdout.flush()


def freeze_after(name: str, fenced: Any) -> None:
    """Wrap ``KafkaSubscription.<name>``: the first time it returns with the fence passed
    (``fenced(result)``), stop this whole process before anything is written."""
    original = getattr(KafkaSubscription, name)
    armed = [True]

    def wrapper(self: KafkaSubscription, *args: Any, **kw: Any) -> Any:
        result = original(self, *args, **kw)
        if armed[0] and fenced(result):
            armed[0] = False
            out("FENCED", name, repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(0.01)  # (a system call: the stop has taken this thread too)
            out("WOKEN", repr(time.monotonic()))
        return result

    setattr(KafkaSubscription, name, wrapper)


def freeze_in_commit() -> None:
    """Stop this process inside the re-publish transaction, after its offsets were sent
    (TxnOffsetCommit accepted: pending in the group coordinator) and before its commit."""
    armed = [True]

    def freeze() -> None:
        if armed[0]:
            armed[0] = False
            out("FENCED", "commit", repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(0.01)
            out("WOKEN", repr(time.monotonic()))

    import confluent_kafka
    from kafka.producer.transaction_manager import TransactionManager

    begin_commit = TransactionManager.begin_commit

    def kp_commit(self: Any) -> Any:
        freeze()
        return begin_commit(self)

    TransactionManager.begin_commit = kp_commit

    class Producer(confluent_kafka.Producer):
        def commit_transaction(self, *args: Any) -> Any:
            freeze()
            return super().commit_transaction(*args)

    confluent_kafka.Producer = Producer  # type: ignore[misc]


def main(url: str, group: str, pattern: str, lease: float, mode: str) -> None:
    if mode == "commit":
        freeze_in_commit()
    elif mode == "nack":
        freeze_after("_fence_for", lambda result: True)  # returns only when fenced
    else:
        # (True before the re-publishes became transactions; the group snapshot since)
        freeze_after("_fence_tick", lambda result: result not in (None, False))
    with mqabstract.connect(url) as mq:
        sub = mq.subscribe(group, pattern, lease=lease, max_attempts=50)
        out("READY")
        while True:
            started = time.monotonic()
            msgs = sub.receive(max_messages=1, wait=1.0)
            if msgs:
                break
        msg = msgs[0]
        out("RECV", msg.id, msg.attempt, repr(started))
        if mode in ("nack", "commit"):
            try:
                msg.nack()
            except mqabstract.LeaseExpired:
                out("EXPIRED", msg.id)
            else:
                out("NACKED", msg.id)
        if mode == "commit":
            # Woken while the standby takes over, this process rejoins the group: with one
            # retry partition (the only slot) the assignor could hand the slot back to it,
            # and a member that never receives again would keep the copy from the standby
            # for good (CI: "the message never came back" after NACKED). Done with its
            # one message, it leaves the group, as a worker that stops would.
            sub.close()
            out("CLOSED")
        sys.stdin.readline()
        sub.close()
    out("DONE")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], float(a[3]), a[4])
