"""A misbehaving HTTP server on 127.0.0.1 for the client drivers' tests (anyio sockets: runs under asyncio and trio).

Each request is read (head, then a ``Content-Length`` body), recorded, and answered by the test's handler, which
returns the raw bytes to write, or an :class:`Act` (write some bytes, then hang, drip or reset the connection).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import SocketStream


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Act:
    """Write ``data``, then: ``hang`` (keep the socket open, say nothing more), ``drip`` (one byte of ``drip`` at a
    time, forever, 10 ms apart) or close (a reset when ``reset``)."""

    data: bytes = b""
    hang: bool = False
    drip: bytes = b""
    reset: bool = False


Handler = Callable[[Seen], "bytes | Act"]


def response(status: int, body: bytes | str | Any = b"", *, headers: dict[str, str] | None = None, length: int | None = None) -> bytes:
    """A raw HTTP/1.1 answer; ``body`` that is not bytes/str is sent as JSON; ``length`` overrides Content-Length."""
    if not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    raw = body.encode() if isinstance(body, str) else body
    head = {"content-type": "application/json", "content-length": str(len(raw) if length is None else length), **(headers or {})}
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in head.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + raw


@dataclass
class Rogue:
    port: int
    handler: Handler
    seen: list[Seen] = field(default_factory=list)
    hung: anyio.Event = field(default_factory=anyio.Event)  # set once a connection is being held open

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def _read_request(stream: SocketStream, buf: bytearray) -> Seen | None:
    while b"\r\n\r\n" not in buf:
        chunk = await stream.receive(65536)
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    n = int(headers.get("content-length", "0"))
    body = bytearray(rest)
    while len(body) < n:
        body += await stream.receive(65536)
    buf[:] = body[n:]
    return Seen(method, path, headers, bytes(body[:n]))


@asynccontextmanager
async def rogue_server(handler: Handler) -> AsyncIterator[Rogue]:
    """Serve ``handler`` until the block ends (then every connection is cancelled)."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    rogue = Rogue(listener.extra(anyio.abc.SocketAttribute.local_port), handler)

    async def serve(stream: SocketStream) -> None:
        buf = bytearray()
        try:
            async with stream:
                while True:
                    seen = await _read_request(stream, buf)
                    if seen is None:
                        return
                    rogue.seen.append(seen)
                    act = rogue.handler(seen)
                    if isinstance(act, bytes):
                        act = Act(act)
                    await stream.send(act.data) if act.data else None
                    if act.hang:
                        rogue.hung.set()
                        await anyio.sleep_forever()
                    if act.drip:
                        rogue.hung.set()
                        while True:
                            await stream.send(act.drip)
                            await anyio.sleep(0.01)
                    if act.reset:
                        import socket
                        import struct

                        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
            return

    async with listener, anyio.create_task_group() as tg:  # the port is closed when the block ends
        tg.start_soon(listener.serve, serve)
        try:
            yield rogue
        finally:
            tg.cancel_scope.cancel()
