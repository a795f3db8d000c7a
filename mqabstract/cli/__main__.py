"""``python -m mqabstract.cli``: the same as ``mqa`` (kept from when cli was one module)."""

from mqabstract.cli import run

run()
