"""Run moto's server (SQS/SNS stand-in) with one fix: atomic writes to a queue.

moto's ``SQSBackend.receive_message`` checks that a message is visible and then marks it
received without holding any lock, while the server answers requests on many threads. Two
concurrent receives on one queue can therefore both take the same message — something
SQS does not do within a visibility timeout, and which made the competing-consumers
conformance scenario flake under load. Here each receive holds the queue's own condition
(re-entrant; released while it long-polls), so check-and-mark is atomic.

The queue's other writers take the same condition, for the same reason. Above all
``Queue.delete_message``: it rebuilds the message list without the deleted message and
assigns it back, unlocked, so a message that ``add_message`` appended meanwhile (an SNS
fan-out, a send) to the list being replaced was dropped: never received, never in the
queue again — the confirmed ids the SQS chaos scenario found "lost" in a CI fault stage
(docs/reliability.md). Two concurrent deletes also undid one another (a deleted message
came back) and a received message could vanish before its delete. (A receive that moves
messages to moto's own redrive DLQ takes that queue's condition inside its own; the
driver sets no redrive policy, so no two queues wait on each other.)

Usage is ``python -m moto.server``'s: ``python scripts/moto_server.py -H 127.0.0.1 -p 5055``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any


def _by_queue(original: Any) -> Any:
    """``SQSBackend.<original>(queue_name, ...)`` holding that queue's condition."""
    @functools.wraps(original)
    def locked(self: Any, queue_name: str, *args: Any, **kwargs: Any) -> Any:
        queue = self.get_queue(queue_name)
        with queue._messages_lock:  # a Condition on an RLock: waits inside release it
            return original(self, queue_name, *args, **kwargs)

    locked._mqabstract_atomic = True  # type: ignore[attr-defined]
    return locked


def _on_queue(original: Any) -> Any:
    """``Queue.<original>(...)`` holding the queue's own condition."""
    @functools.wraps(original)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._messages_lock:
            return original(self, *args, **kwargs)

    locked._mqabstract_atomic = True  # type: ignore[attr-defined]
    return locked


def _patch() -> None:
    from moto.sqs.models import Queue, SQSBackend

    if getattr(SQSBackend.receive_message, "_mqabstract_atomic", False):
        return
    # Every writer of a queue's message list (``Queue._messages``) and of the visibility
    # of its messages: receive (check visible, mark received, move to moto's own DLQ),
    # delete (rebuilds the list), add (FIFO dedupe check, then append), change visibility
    # and purge.
    for name in ("receive_message", "change_message_visibility", "purge_queue"):
        setattr(SQSBackend, name, _by_queue(getattr(SQSBackend, name)))
    for name in ("delete_message", "add_message"):
        setattr(Queue, name, _on_queue(getattr(Queue, name)))


if __name__ == "__main__":
    _patch()
    from moto.server import main

    sys.exit(main(sys.argv[1:]))
