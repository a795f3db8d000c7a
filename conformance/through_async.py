"""The sync API's shape over ``mqabstract.aio``, so every scenario also runs through asyncio.

``--mq-api async`` (or ``both``) hands the scenarios a broker whose every call is a
coroutine of the ``AsyncBroker`` run on one event loop in a background thread; the
scenarios stay as written. Handlers given to ``consume`` run in worker threads (they may
settle messages, which blocks on the loop).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from mqabstract import aio
from mqabstract.broker import ConsumeStats

T = TypeVar("T")


class _Loop:
    """One event loop in a daemon thread, shared by every wrapped broker."""

    _shared: _Loop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="mq-conformance-aio",
                         daemon=True).start()

    @classmethod
    def get(cls) -> _Loop:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


def connect(url: str, **options: Any) -> Broker:
    loop = _Loop.get()
    return Broker(loop.call(aio.connect(url, **options)), loop)


class Message:
    def __init__(self, msg: aio.AsyncMessage, loop: _Loop) -> None:
        self.amessage = msg
        self._loop = loop

    def __getattr__(self, name: str) -> Any:  # id, topic, body, value, attempt, settled, …
        return getattr(self.amessage, name)

    def ack(self) -> None:
        self._loop.call(self.amessage.ack())

    def nack(self, delay: float = 0.0) -> None:
        self._loop.call(self.amessage.nack(delay))

    def dead_letter(self, reason: str = "dead-lettered by consumer") -> None:
        self._loop.call(self.amessage.dead_letter(reason))

    def extend(self, seconds: float) -> None:
        self._loop.call(self.amessage.extend(seconds))

    def reply(self, body: Any, **options: Any) -> str:
        return self._loop.call(self.amessage.reply(body, **options))

    def __repr__(self) -> str:
        return repr(self.amessage)


class Batch:
    """``AsyncBatch`` in the sync ``Batch``'s shape: columns as they are, messages wrapped,
    whole-batch settles as sync calls."""

    def __init__(self, batch: aio.AsyncBatch[aio.AsyncMessage], loop: _Loop) -> None:
        self.abatch = batch
        self._loop = loop

    def __getattr__(self, name: str) -> Any:  # ids, bodies, …, lease_remaining, to_arrow
        return getattr(self.abatch, name)

    def __len__(self) -> int:
        return len(self.abatch)

    def __bool__(self) -> bool:
        return bool(self.abatch)

    def __iter__(self) -> Iterator[Message]:
        return (Message(m, self._loop) for m in self.abatch)

    def __getitem__(self, index: int) -> Message:
        return Message(self.abatch[index], self._loop)

    def ack(self) -> None:
        self._loop.call(self.abatch.ack())

    def nack(self, delay: float = 0.0) -> None:
        self._loop.call(self.abatch.nack(delay))

    def dead_letter(self, reason: str = "dead-lettered by consumer") -> None:
        self._loop.call(self.abatch.dead_letter(reason))

    def extend(self, seconds: float) -> None:
        self._loop.call(self.abatch.extend(seconds))

    def __repr__(self) -> str:
        return repr(self.abatch)


class Subscription:
    def __init__(self, sub: aio.AsyncSubscription, loop: _Loop) -> None:
        self.asub = sub
        self._loop = loop

    def __getattr__(self, name: str) -> Any:  # group, pattern, closed
        return getattr(self.asub, name)

    def receive(self, max_messages: int = 1, wait: float = 0.0) -> list[Message]:
        return [Message(m, self._loop) for m in
                self._loop.call(self.asub.receive(max_messages, wait))]

    def receive_batch(self, max_messages: int = 100, wait: float = 0.0) -> Batch:
        return Batch(self._loop.call(self.asub.receive_batch(max_messages, wait)), self._loop)

    def ack_many(self, messages: Iterable[Any]) -> None:
        self._loop.call(self.asub.ack_many(
            [m.amessage if isinstance(m, Message) else m for m in messages]))

    def consume(self, handler: Callable[[Message], object], **options: Any) -> ConsumeStats:
        loop = self._loop

        async def run(msg: aio.AsyncMessage) -> None:
            await asyncio.to_thread(handler, Message(msg, loop))

        return loop.call(self.asub.consume(run, **options))

    def stop(self) -> None:
        self._loop.loop.call_soon_threadsafe(self.asub.stop)

    def close(self) -> None:
        self._loop.call(self.asub.close())

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Broker:
    def __init__(self, broker: aio.AsyncBroker, loop: _Loop) -> None:
        self.abroker = broker
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        """Properties as they are (url, backend, capabilities, closed); methods as sync
        calls of their coroutines."""
        attr = getattr(self.abroker, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.call(attr(*args, **kwargs))

        return call

    def subscribe(self, group: str, pattern: str, **options: Any) -> Subscription:
        return Subscription(self._loop.call(self.abroker.subscribe(group, pattern, **options)),
                            self._loop)

    def request(self, topic: str, body: Any, **options: Any) -> Message:
        return Message(self._loop.call(self.abroker.request(topic, body, **options)),
                       self._loop)

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
