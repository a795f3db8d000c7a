"""One exception hierarchy for every backend.

Every error says whether retrying the same call can help (``retryable``). Native client
exceptions are chained with ``raise ... from exc`` and never leak raw. Messages never
contain secrets: drivers build them from the redacted URL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "AlreadySettled",
    "Closed",
    "ConnectionFailed",
    "DecodeError",
    "Duplicate",
    "EncodeError",
    "InvalidArgument",
    "InvalidName",
    "InvalidURL",
    "MQError",
    "MessageTooLarge",
    "MiddlewareError",
    "MissingDependency",
    "NotFound",
    "NotSent",
    "PublishError",
    "StoreError",
    "Timeout",
    "Unsupported",
    "ValidationError",
]


class MQError(Exception):
    """Base of every mqabstract error.

    ``retryable`` tells a caller whether the same call may succeed later; ``index`` is set
    when the error concerns one message of a batch (its position in the batch).
    """

    retryable: bool = False

    def __init__(self, message: str, *, index: int | None = None) -> None:
        if index is not None:
            message = f"message #{index}: {message}"
        super().__init__(message)
        self.index = index


class ConnectionFailed(MQError):
    """The broker could not be reached or the connection broke; retrying can help."""

    retryable = True


class Timeout(MQError):
    """The broker did not answer within the configured time; retrying can help."""

    retryable = True


class Closed(MQError):
    """The broker, subscription or message's subscription was already closed."""


class Unsupported(MQError):
    """The backend declares this feature UNSUPPORTED in its capabilities."""


class NotFound(MQError):
    """A group, dead letter or other named object does not exist."""


class AlreadySettled(MQError):
    """A message was already acked, nacked or dead-lettered with a different outcome."""


class LeaseExpired(MQError):
    """A settle or extend came at or after the message's lease deadline.

    It never reached the broker: the message will be delivered again with attempt + 1, to
    this or another consumer. Not retryable (the lease is gone); not a handler failure.
    ``receipts``: set by a driver when only some receipts of a batch settle were stale
    (empty: all of them, or not known). ``ids``: the messages whose lease ran out, set by
    the portable layer (empty when a driver raised it).
    """

    def __init__(self, message: str, *, index: int | None = None,
                 receipts: tuple[object, ...] = (), ids: tuple[str, ...] = ()) -> None:
        super().__init__(message, index=index)
        self.receipts = receipts
        self.ids = ids


class Duplicate(MQError):
    """This message's id was already processed (an idempotent consumer's store says so).

    Raised by ``SQLiteStore.transaction`` before the handler's work starts; a consume loop
    with ``dedupe=`` acks the message without counting a failure."""


class StoreError(MQError):
    """A dedupe store could not read or record an id (its file, disk or lock); retrying
    can help. The message was not acked: it comes again."""

    retryable = True


class MissingDependency(MQError):
    """A backend's client library is not installed (install the matching extra)."""


class MiddlewareError(MQError):
    """A middleware failed on entering its scope: the call was not made (nothing sent)."""


class ValidationError(MQError):
    """Bad input, rejected before anything was sent."""


class InvalidName(ValidationError):
    """A topic, pattern, group or header name breaks the naming rules."""


class InvalidArgument(ValidationError):
    """A value (priority, delay, header value, key, id, option) is out of range or typed wrong."""


class InvalidURL(ValidationError):
    """The broker URL cannot be parsed or names an unknown scheme."""


class MessageTooLarge(ValidationError):
    """Body or headers exceed the backend's declared limits."""


class EncodeError(ValidationError):
    """The body cannot be encoded (only bytes, str and JSON values are accepted; never pickle)."""


class DecodeError(MQError):
    """A received body does not decode as its content-type says."""


class InvalidPayload(DecodeError):
    """A received body decodes but does not validate as the subscription's ``model``."""


class NotSent(MQError):
    """A ``PublishError.failed`` entry: the message was never sent because an earlier one
    it had to follow failed (a later chunk of the batch, a later request of its SQS lane).
    """


class PublishError(MQError):
    """Some messages of a batch were not confirmed by the broker.

    ``published`` holds the ids that the broker confirmed, ``failed`` maps batch index to
    the error for each message that was not confirmed (a ``NotSent`` for those never sent).
    Retrying the failed ones is safe: ids are kept, so consumers can drop duplicates.
    """

    retryable = True

    def __init__(self, message: str, *, published: list[str], failed: dict[int, MQError]):
        super().__init__(message)
        self.published = published
        self.failed = failed

    @property
    def cause(self) -> MQError | None:
        """The first failure by index that is not a ``NotSent``: why the batch broke."""
        return _cause(self.failed)

    @classmethod
    def from_outcomes(cls, ids: Sequence[str], outcomes: Sequence[MQError | None], *,
                      by: str = "") -> PublishError:
        """The error for a batch whose message ``i`` (id ``ids[i]``) had ``outcomes[i]``:
        None when the broker confirmed it, else why not (``NotSent`` when never sent).
        The portable layer and every driver build it here, so the bookkeeping and the
        wording ("N of M messages not confirmed[ by …]: cause") are the same everywhere."""
        failed = {i: err for i, err in enumerate(outcomes) if err is not None}
        published = [mid for mid, err in zip(ids, outcomes, strict=True) if err is None]
        where = f" by {by}" if by else ""
        return cls(f"{len(failed)} of {len(outcomes)} messages not confirmed{where}: "
                   f"{_cause(failed)}", published=published, failed=failed)


def _cause(failed: Mapping[int, MQError]) -> MQError | None:
    errors = [failed[i] for i in sorted(failed)]
    return next((e for e in errors if not isinstance(e, NotSent)), errors[0] if errors else None)
