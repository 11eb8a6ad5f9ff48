"""ASGI middleware that refuses a request body over a size limit, declared or streamed, with a 413.

Used in front of both servers that read request bodies: ``asyncsess serve`` and the HTTP worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["MAX_BODY_BYTES", "BodyLimit"]

MAX_BODY_BYTES = 256 * 2**20  # the default limit of both servers


class _TooLarge(Exception):
    pass


class BodyLimit:
    """A request whose ``Content-Length`` (or whose body as it streams in) exceeds ``max_bytes`` gets
    ``refuse(scope)``, an ASGI response with status 413; whatever the app answers after that is dropped.

    A ``Content-Length`` that is not a decimal number is refused the same way. Nothing past the limit is
    buffered: the app's ``receive`` fails as soon as the count passes it.
    """

    def __init__(self, app: Any, max_bytes: int, refuse: Callable[[Any], Any]) -> None:
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self.refuse(scope)(scope, receive, send)
        seen, started, refused = 0, False, False

        async def counted() -> Any:
            nonlocal seen, refused
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                if not started:
                    await self.refuse(scope)(scope, receive, send)
                refused = True
                raise _TooLarge()
            return message

        async def tracked(message: Any) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            pass
