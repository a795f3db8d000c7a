"""The README's backend/feature table covers every built-in backend."""

from __future__ import annotations

from mqabstract.captable import builtin_capabilities


def test_every_builtin_backend_declares_static_capabilities() -> None:
    found, skipped = builtin_capabilities()
    assert not skipped, f"missing from the README table: {skipped}"
    assert set(found) == {"memory", "sqlite", "rabbitmq", "kafka", "sqs", "postgresql"}
