"""A real ``asyncsess serve`` app (uvicorn on 127.0.0.1, a free port, in a thread) for the Tinker-wire tests."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

API_KEY = "tml-asyncsess-test"


@dataclass
class Server:
    url: str
    app: object
    backend: object

    @property
    def door(self):
        return self.app.state.tinker_door


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    backend_url: str,
    *,
    poll_timeout: float = 5.0,
    api_keys: set[str] | None = None,
    session_timeout: float = 300.0,
    **options: Any,
) -> Iterator[Server]:
    """``options``: more of ``create_app``'s (``max_body_bytes``, ...)."""
    import uvicorn

    from asyncsess.backends import load_backend
    from asyncsess.serve.tinker_api import create_app

    backend = load_backend(backend_url)
    app = create_app(backend, api_keys or {API_KEY}, poll_timeout=poll_timeout, session_timeout=session_timeout, **options)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield Server(f"http://127.0.0.1:{port}", app, backend)
    finally:
        server.should_exit = True
        thread.join(30)


class Counted(dict):  # type: ignore[type-arg]
    """A dict that counts the entries read from it (lookups and each entry an iteration yields)."""

    touched = 0

    def __getitem__(self, key: Any) -> Any:
        self.touched += 1
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.touched += 1
        return super().get(key, default)

    def __iter__(self) -> Iterator[Any]:
        for key in super().__iter__():
            self.touched += 1
            yield key

    def values(self) -> Iterator[Any]:  # type: ignore[override]
        for key in self:
            yield super().__getitem__(key)

    def items(self) -> Iterator[tuple[Any, Any]]:  # type: ignore[override]
        for key in self:
            yield key, super().__getitem__(key)


@pytest.fixture(scope="module")
def mock_server() -> Iterator[Server]:
    yield from start_server("mock://")


@pytest.fixture(autouse=True)
def _tinker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    os.environ.pop("TINKER_CREDENTIAL_CMD", None)
