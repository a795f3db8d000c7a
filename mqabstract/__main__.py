"""``python -m mqabstract``: the ``mqa`` command line."""

from mqabstract.cli import run

run()
