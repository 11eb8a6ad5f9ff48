"""ASGI middleware that refuses a request body over a size limit, declared or streamed, with a 413, and one that
does not arrive within a time limit (a slow-loris client) with a 408.

Used in front of both servers that read request bodies: ``asyncsess serve`` and the HTTP worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import anyio
from starlette.requests import ClientDisconnect

__all__ = ["MAX_BODY_BYTES", "MAX_BODY_SECONDS", "BodyLimit"]

MAX_BODY_BYTES = 256 * 2**20  # the default limit of both servers
MAX_BODY_SECONDS = 300.0  # the whole body must have arrived this long after the request began (256 MB at ~1 MB/s)


class _Refused(Exception):
    pass


class BodyLimit:
    """A request whose ``Content-Length`` (or whose body as it streams in) exceeds ``max_bytes`` gets
    ``refuse(scope)``, an ASGI response with status 413; one whose body has not all arrived ``max_seconds`` after
    the request began gets ``too_slow(scope)`` (a 408); whatever the app answers after that is dropped.

    A ``Content-Length`` that is not a decimal number is refused the same way. Nothing past the limit is
    buffered: the app's ``receive`` fails as soon as the count passes it. Once the body is in, ``receive`` (which
    then waits for the client to hang up) is not timed: a long call is not a slow body. A client that hangs up while its
    body arrives gets no answer, and is no error.
    """

    def __init__(
        self,
        app: Any,
        max_bytes: int,
        refuse: Callable[[Any], Any],
        *,
        max_seconds: float = MAX_BODY_SECONDS,
        too_slow: Callable[[Any], Any] | None = None,
    ) -> None:
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse
        self.max_seconds, self.too_slow = max_seconds, too_slow

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self.refuse(scope)(scope, receive, send)
        seen, started, refused, done = 0, False, False, False
        deadline = anyio.current_time() + self.max_seconds

        async def answer(response: Callable[[Any], Any] | None) -> NoReturn:
            nonlocal refused
            if not started and response is not None:
                await response(scope)(scope, receive, send)
            refused = True
            raise _Refused()

        async def counted() -> Any:
            nonlocal seen, done
            if done:
                return await receive()
            with anyio.move_on_after(deadline - anyio.current_time()):
                message = await receive()
                seen += len(message.get("body", b""))
                done = message["type"] != "http.request" or not message.get("more_body", False)
                if seen > self.max_bytes:
                    await answer(self.refuse)
                return message
            await answer(self.too_slow)  # the body is still arriving at the deadline

        async def tracked(message: Any) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _Refused:
            pass
        except ClientDisconnect:  # the client hung up while its body arrived: no one to answer, nothing went wrong (it was
            pass  # an "Exception in ASGI application" or a worker error, a 500 with a traceback in the log per connection)
