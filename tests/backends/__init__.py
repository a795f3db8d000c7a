"""Backend-specific tests (interop with raw clients, restarts, crashes)."""
