"""``http(s)://host:port``: a running worker (``asyncsess-worker``), spoken to with httpx.

The API key comes from the ``api_key`` option or ``$ASYNCSESS_API_KEY``. Errors come back as the
worker's typed errors; dropped connections and timeouts become :class:`TransientError` (the client's
retry policy resends, and the worker's sequencer applies each op once). A refusal (4xx: 400 bad input,
401 key, 404 unknown or another key's object, 413 body too large) is raised as the worker's typed error,
with its ``field`` and ``fix``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import httpx

from ..errors import ServerError, TransientError
from ..types import Checkpoint, GetInfoResponse, SampleResponse, ServerCapabilities, TrainingResult
from . import http_wire as wire
from .base import Backend, ParsedURL, SampleRequest, SamplerSpec, Tokenizer, TrainingOp, TrainingSessionSpec, require_op

__all__ = ["HttpBackend"]


class HttpBackend(Backend):
    scheme = "http"

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 3600.0, transport: Any = None) -> None:
        self.base_url = base_url.rstrip("/")
        key = api_key or os.environ.get("ASYNCSESS_API_KEY", "")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._tokenizers: dict[str, Any] = {}

    @classmethod
    def from_url(cls, url: ParsedURL, **options: Any) -> HttpBackend:
        port = f":{url.port}" if url.port else ""
        return cls(f"{url.scheme}://{url.host}{port}{url.path}", **options)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.base_url, headers=self._headers, timeout=self._timeout, transport=self._transport
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = await self.client.request(method, path, **kw)
        except (httpx.TransportError, httpx.TimeoutException) as err:
            # A read that broke off means the worker got the request: its result is stored under the op's key.
            lost = isinstance(err, (httpx.ReadError, httpx.RemoteProtocolError))
            raise TransientError(f"{method} {path}: {type(err).__name__}: {err}", lost_response=lost) from err
        return _result(r)

    async def capabilities(self) -> ServerCapabilities:
        return ServerCapabilities.model_validate(await self._call("GET", "/v1/capabilities"))

    async def create_training_session(self, spec: TrainingSessionSpec) -> GetInfoResponse:
        return GetInfoResponse.model_validate(
            await self._call("POST", "/v1/sessions", json=wire.SESSION_SPEC.dump_python(spec, mode="json"))
        )

    async def stop_session(self, session_id: str) -> None:
        await self._call("DELETE", f"/v1/sessions/{session_id}")

    async def heartbeat(self, session_id: str) -> None:
        await self._call("POST", f"/v1/sessions/{session_id}/heartbeat")

    async def execute_training(self, session_id: str, op: TrainingOp) -> TrainingResult:
        body = await self._call("POST", f"/v1/sessions/{session_id}/ops", json=wire.encode_op(require_op(op)))
        return wire.decode_result(body)

    async def create_sampler(self, spec: SamplerSpec) -> str:
        return (await self._call("POST", "/v1/samplers", json=wire.SAMPLER_SPEC.dump_python(spec, mode="json")))["sampler_id"]

    async def sample(self, sampler_id: str, request: SampleRequest) -> SampleResponse:
        body = await self._call("POST", f"/v1/samplers/{sampler_id}/sample", json=wire.SAMPLE_REQUEST.dump_python(request, mode="json"))
        return SampleResponse.model_validate(body)

    async def compute_logprobs(self, sampler_id: str, tokens: list[int]) -> list[float | None]:
        return (await self._call("POST", f"/v1/samplers/{sampler_id}/logprobs", json={"tokens": list(tokens)}))["logprobs"]

    async def list_checkpoints(self, session_id: str | None = None) -> list[Checkpoint]:
        params = {"session_id": session_id} if session_id else {}
        return [Checkpoint.model_validate(c) for c in await self._call("GET", "/v1/checkpoints", params=params)]

    def get_tokenizer(self, base_model: str) -> Tokenizer:
        """The worker's tokenizer files, loaded here with transformers (fetched once per base model)."""
        if base_model not in self._tokenizers:
            from transformers import AutoTokenizer

            try:
                r = httpx.get(f"{self.base_url}/v1/tokenizer", params={"base_model": base_model}, headers=self._headers, timeout=60.0)
            except (httpx.TransportError, httpx.TimeoutException) as err:
                raise TransientError(f"GET /v1/tokenizer: {type(err).__name__}: {err}") from err
            with tempfile.TemporaryDirectory() as tmp:
                for name, text in _result(r)["files"].items():
                    (Path(tmp) / Path(name).name).write_text(text)
                self._tokenizers[base_model] = AutoTokenizer.from_pretrained(tmp)
        return self._tokenizers[base_model]


def _result(r: httpx.Response) -> Any:
    """The JSON of a 2xx answer, or the worker's typed error (a 4xx is the caller's input: never retried;
    a 5xx without the worker's error body, e.g. from a proxy, is a TransientError)."""
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            body = r.text
        raise wire.decode_error(body, r.status_code)
    if not r.content:
        return None
    try:
        return r.json()
    except ValueError:
        raise ServerError(f"the worker answered {r.status_code} with a body that is not JSON: {r.text[:200]!r}") from None
