"""The ``asyncsess`` command: the typer app and the demo it runs."""
