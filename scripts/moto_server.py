"""Run moto's server (SQS/SNS stand-in) with one fix: atomic receives.

moto's ``SQSBackend.receive_message`` checks that a message is visible and then marks it
received without holding any lock, while the server answers requests on many threads. Two
concurrent receives on one queue can therefore both take the same message — something
SQS does not do within a visibility timeout, and which made the competing-consumers
conformance scenario flake under load. Here each receive holds the queue's own condition
(re-entrant; released while it long-polls), so check-and-mark is atomic.

Usage is ``python -m moto.server``'s: ``python scripts/moto_server.py -H 127.0.0.1 -p 5055``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any


def _patch() -> None:
    from moto.sqs.models import SQSBackend

    original = SQSBackend.receive_message
    if getattr(original, "_mqabstract_atomic", False):
        return

    @functools.wraps(original)
    def receive_message(self: Any, queue_name: str, *args: Any, **kwargs: Any) -> Any:
        queue = self.get_queue(queue_name)
        with queue._messages_lock:  # a Condition on an RLock: waits inside release it
            return original(self, queue_name, *args, **kwargs)

    receive_message._mqabstract_atomic = True  # type: ignore[attr-defined]
    SQSBackend.receive_message = receive_message  # type: ignore[method-assign]


if __name__ == "__main__":
    _patch()
    from moto.server import main

    sys.exit(main(sys.argv[1:]))
