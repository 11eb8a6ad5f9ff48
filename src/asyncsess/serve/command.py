"""``asyncsess serve``: one server process with Tinker's HTTP API and the OpenAI front over a backend URL."""

from __future__ import annotations

import math
import os

import typer

from .body_limit import MAX_BODY_BYTES, MAX_BODY_SECONDS
from .defaults import MAX_LIVE_PER_KEY, MAX_PENDING, MAX_SAMPLERS, POLL_TIMEOUT, SESSION_TIMEOUT

__all__ = ["finite", "serve"]


def finite(value: float | None) -> float | None:
    """A typer callback: refuse NaN and ±inf, which click's ranges let through."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def serve(
    backend: str = typer.Option(
        "mock://", "--backend", "-b", help="Backend URL: mock://, local://MODEL, http://host:port, sagemaker://..."
    ),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, min=0, max=65535, help="Port to listen on (0: any free port)."),
    api_key: list[str] = typer.Option(
        [],
        "--api-key",
        help="Accepted API keys, as X-API-Key or Authorization: Bearer (repeatable; default: $ASYNCSESS_API_KEYS, comma list; none = no auth).",
    ),
    poll_timeout: float = typer.Option(
        POLL_TIMEOUT, min=0.0, callback=finite, help="Seconds a retrieve_future long-poll is held before answering 408."
    ),
    session_timeout: float = typer.Option(
        SESSION_TIMEOUT,
        min=0.0,
        callback=finite,
        help="Seconds without a heartbeat (the tinker SDK sends one every 10 s) before a session expires: its models and "
        "samplers are stopped on the backend and its futures dropped; 0 = never.",
    ),
    max_samplers: int = typer.Option(
        MAX_SAMPLERS,
        min=1,
        help="Samplers one session keeps open on the backend; past it the least recently used idle one is closed (one on "
        "a saved path or base weights reopens on its next sample; one from save_weights_and_get_sampling_client answers 410).",
    ),
    max_pending: int = typer.Option(
        MAX_PENDING,
        min=1,
        help="Unfinished requests (futures) one API key may hold on the Tinker API; past it a 429 with Retry-After, which "
        "the tinker SDK retries.",
    ),
    max_live_per_key: int = typer.Option(
        MAX_LIVE_PER_KEY,
        min=1,
        help="Models plus open samplers one API key may hold on the Tinker API (in sessions not finished or expired); "
        "past it creating another is a 400.",
    ),
    max_body_mb: float = typer.Option(
        MAX_BODY_BYTES / 2**20, min=0.001, max=2**20, callback=finite, help="Largest request body in MiB; a larger one gets a 413."
    ),
    max_body_seconds: float = typer.Option(
        MAX_BODY_SECONDS,
        min=0.001,
        callback=finite,
        help="Seconds a request body has to arrive, from the request's start; a slower one (a slow-loris client) gets a 408.",
    ),
    log_level: str = typer.Option("warning", help="uvicorn log level."),
) -> None:
    """Serve Tinker's HTTP API (point TINKER_BASE_URL here) and the OpenAI API (/v1) in front of an asyncsess backend."""
    import uvicorn

    from ..backends import load_backend
    from ..errors import AsyncSessError
    from .tinker_api import create_app

    keys = set(api_key) or {k for k in os.environ.get("ASYNCSESS_API_KEYS", "").split(",") if k}
    try:
        driver = load_backend(backend)
    except AsyncSessError as err:
        raise typer.BadParameter(err.message, param_hint="--backend") from None
    app = create_app(
        driver,
        keys or None,
        poll_timeout=poll_timeout,
        session_timeout=session_timeout,
        max_body_bytes=int(max_body_mb * 2**20),
        max_samplers=max_samplers,
        max_body_seconds=max_body_seconds,
        max_pending=max_pending,
        max_live_per_key=max_live_per_key,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level)
