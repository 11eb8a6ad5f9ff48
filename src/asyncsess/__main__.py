"""``python -m asyncsess``: the same as the ``asyncsess`` command."""

from .cli.app import app

app()
