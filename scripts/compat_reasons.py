"""Why a row of docs/compatibility.md is not "same": ``"<anchor>:<member>" -> (status, reason)``.

``<anchor>`` is ``tinker``, ``sagemaker`` or ``*`` (both); ``<member>`` is the row's member text.
"""

from __future__ import annotations

REASONS: dict[str, tuple[str, str]] = {}
