"""Run the emulator: in the foreground (:func:`serve`, the CLI) or in a background thread (:func:`running_emulator`, tests)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from asyncsess.backends import Backend

from .app import create_app
from .config import EmulatorConfig, FaultConfig

__all__ = ["serve", "running_emulator", "RunningEmulator"]


def serve(backend_url: str = "mock://", host: str = "127.0.0.1", port: int = 8089, config: EmulatorConfig | None = None) -> None:
    """Serve both wire protocols on ``http://host:port`` until interrupted."""
    uvicorn.run(create_app(backend_url, config), host=host, port=port, log_level="warning")


@dataclass
class RunningEmulator:
    """A background emulator. ``url`` is the ``endpoint_url`` for both boto3 clients."""

    url: str
    config: EmulatorConfig

    def set_faults(self, **faults: Any) -> None:
        """Replace the fault settings (see :class:`FaultConfig`); no argument clears them."""
        httpx.post(f"{self.url}/_emulator/faults", json=FaultConfig(**faults).model_dump()).raise_for_status()

    def injected_faults(self) -> dict[str, int]:
        """How many faults were injected since the last :meth:`set_faults`, by kind."""
        return httpx.get(f"{self.url}/_emulator/faults").json()["injected"]

    def session_state(self, name: str, account: str | None = None) -> dict[str, Any]:
        """Status, the sequence numbers the engine applied (in order), and every operation's status (of the session
        of ``account``, default :attr:`EmulatorConfig.account_id`)."""
        resp = httpx.get(f"{self.url}/_emulator/sessions/{name}", params={"account": account} if account else None)
        resp.raise_for_status()
        return resp.json()

    def end_session(
        self, name: str, status: str = "Failed", reason: str = "Failed by the emulator's test hook", account: str | None = None
    ) -> None:
        """Fail or expire a session (of ``account``, default :attr:`EmulatorConfig.account_id`) from the service side."""
        params = {"account": account} if account else None
        httpx.post(f"{self.url}/_emulator/sessions/{name}/end", json={"status": status, "reason": reason}, params=params).raise_for_status()


@contextmanager
def running_emulator(backend: Backend | str = "mock://", config: EmulatorConfig | None = None, port: int = 0) -> Iterator[RunningEmulator]:
    """Start the emulator on ``127.0.0.1`` (a free port unless given) in a thread; stop it on exit."""
    config = config or EmulatorConfig()
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (with proto 0 every
    # answer waits ~40 ms for the client's delayed ACK)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(create_app(backend, config), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="sagemaker-emulator", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the SageMaker emulator failed to start (see the log above)")
            threading.Event().wait(0.01)
        yield RunningEmulator(url=f"http://127.0.0.1:{sock.getsockname()[1]}", config=config)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
