"""``python -m asyncsess``: the same as the ``asyncsess`` command."""

from .cli import app

app()
