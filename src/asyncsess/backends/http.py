"""``http(s)://host:port``: a running worker (``asyncsess-worker``), spoken to with httpx.

The API key comes from the ``api_key`` option or ``$ASYNCSESS_API_KEY``. Errors come back as the
worker's typed errors; dropped connections and timeouts become :class:`TransientError` (the client's
retry policy resends, and the worker's sequencer applies each op once). A refusal (4xx: 400 bad input,
401 key, 404 unknown or another key's object, 409 a conflict with the worker's state, 413 body too large) is
raised as the worker's typed error, with its ``field`` and ``fix``, and never retried.

The worker on the other end may be buggy, another version or hostile: redirects are not followed (the key
goes to ``base_url`` only), an answer over ``max_response_bytes`` (decoded) is refused while it streams, and
an answer that is not what the call expects (not JSON, a wrong shape, another op's result, an undecodable
``Content-Encoding``) is an :class:`~asyncsess.errors.APIResponseValidationError`. A create sends its spec's
``idempotency_key`` as ``Idempotency-Key``: the worker answers a retry of it with the session it already made, and a
create given up on is called off (``DELETE /v1/creates/{key}``: what it made is stopped). ``Retry-After`` on a 429 or
5xx is the retry's hint (read by :func:`~asyncsess.retry.retry_after_seconds`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_random_exponential

from ..errors import APIResponseValidationError, InvalidInputError, TransientError
from ..types import Checkpoint, CheckpointResponse, GetInfoResponse, SampleResponse, ServerCapabilities, TrainingResult
from . import http_wire as wire
from .base import (
    Backend,
    ParsedURL,
    SampleRequest,
    SamplerSpec,
    SaveStateOp,
    SaveWeightsOp,
    Tokenizer,
    TrainingOp,
    TrainingSessionSpec,
    require_op,
)

__all__ = ["HttpBackend", "MAX_RESPONSE_BYTES", "read_capped", "response_limit"]

MAX_RESPONSE_BYTES = 256 * 2**20
"""The largest answer (decoded bytes) the driver reads; ``max_response_bytes=`` changes it."""
ABANDON_S = 60.0
"""Seconds :meth:`HttpBackend.abandon_create` keeps trying to reach the worker."""
M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("asyncsess.http")


def response_limit(value: Any) -> int:
    """``max_response_bytes`` as given, or an InvalidInputError naming it (a whole number of bytes >= 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{value!r:.40} is not a whole number of bytes >= 1", field="max_response_bytes", fix="e.g. 256 * 2**20")
    return value


_CHECKPOINTS = TypeAdapter(list[Checkpoint])
_LOGPROBS = TypeAdapter(list[float | None])


class HttpBackend(Backend):
    scheme = "http"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 3600.0,
        transport: Any = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_response_bytes = response_limit(max_response_bytes)
        key = api_key or os.environ.get("ASYNCSESS_API_KEY", "")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._tokenizers: dict[str, Any] = {}

    @classmethod
    def from_url(cls, url: ParsedURL, **options: Any) -> HttpBackend:
        if not url.host:  # "http://" was retried against no host until the op's deadline
            raise InvalidInputError(f"{url.raw!r:.200} names no host", field="url", fix="e.g. http://127.0.0.1:8000")
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
        request = self.client.build_request(method, path, **kw)
        try:
            r = await self.client.send(request, stream=True)  # follow_redirects is off: the key never leaves base_url
            try:
                content = await read_capped(r, self.max_response_bytes, f"{method} {path}")
            finally:
                await r.aclose()
        except (httpx.TransportError, httpx.TimeoutException) as err:
            # A read that broke off means the worker got the request: its result is stored under the op's key.
            lost = isinstance(err, (httpx.ReadError, httpx.RemoteProtocolError))
            raise TransientError(f"{method} {path}: {type(err).__name__}: {err}", lost_response=lost) from err
        except httpx.DecodingError as err:
            raise APIResponseValidationError(f"{method} {path}: the answer's Content-Encoding does not decode: {err}") from None
        return _result(r, content)

    async def capabilities(self) -> ServerCapabilities:
        return _parse(ServerCapabilities, await self._call("GET", "/v1/capabilities"))

    async def create_training_session(self, spec: TrainingSessionSpec) -> GetInfoResponse:
        body, headers = wire.create_request(wire.SESSION_SPEC, spec)
        return _parse(GetInfoResponse, await self._call("POST", "/v1/sessions", json=body, headers=headers))

    async def stop_session(self, session_id: str) -> None:
        await self._call("DELETE", f"/v1/sessions/{session_id}")

    async def abandon_create(self, idempotency_key: str) -> None:
        """``DELETE /v1/creates/{key}``: the worker stops what the create made (a session whose every reply was lost
        held its LoRA until the idle timeout) and refuses the key. Transient failures are retried for up to
        :data:`ABANDON_S` seconds; a failure is logged (the worker's idle timeout is then the bound)."""
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(TransientError),
                stop=stop_after_delay(ABANDON_S),
                wait=wait_random_exponential(multiplier=0.5, max=10.0),
                reraise=True,
            ):
                with attempt:
                    await self._call("DELETE", f"/v1/creates/{idempotency_key}")
        except Exception as err:  # the client's background task: logged here, never raised into a caller
            log.warning(
                "could not tell the worker that the create %s was given up on (%r): what it made stays until its idle timeout",
                idempotency_key,
                err,
            )

    async def heartbeat(self, session_id: str) -> None:
        await self._call("POST", f"/v1/sessions/{session_id}/heartbeat")

    async def execute_training(self, session_id: str, op: TrainingOp) -> TrainingResult:
        op = require_op(op)
        body = await self._call("POST", f"/v1/sessions/{session_id}/ops", json=wire.encode_op(op))
        result = wire.decode_result(body, op.kind)
        if isinstance(op, (SaveStateOp, SaveWeightsOp)) and isinstance(result, CheckpointResponse) and result.kind != op.checkpoint_kind:
            raise APIResponseValidationError(
                f"the worker answered a {op.kind} op with a {result.kind!r} checkpoint, not {op.checkpoint_kind!r}"
            )
        return result

    async def create_sampler(self, spec: SamplerSpec) -> str:
        request, headers = wire.create_request(wire.SAMPLER_SPEC, spec)
        body = await self._call("POST", "/v1/samplers", json=request, headers=headers)
        sampler_id = body.get("sampler_id") if isinstance(body, dict) else None
        if not isinstance(sampler_id, str) or not sampler_id:
            raise APIResponseValidationError(f"the worker's answer names no sampler_id: {str(body)[:200]!r}")
        return sampler_id

    async def sample(self, sampler_id: str, request: SampleRequest) -> SampleResponse:
        body = await self._call("POST", f"/v1/samplers/{sampler_id}/sample", json=wire.SAMPLE_REQUEST.dump_python(request, mode="json"))
        return _parse(SampleResponse, body)

    async def compute_logprobs(self, sampler_id: str, tokens: list[int]) -> list[float | None]:
        body = await self._call("POST", f"/v1/samplers/{sampler_id}/logprobs", json={"tokens": list(tokens)})
        if not isinstance(body, dict) or "logprobs" not in body:
            raise APIResponseValidationError(f"the worker's answer holds no logprobs: {str(body)[:200]!r}")
        return _adapt(_LOGPROBS, body["logprobs"], "a list of log-probs")

    async def list_checkpoints(self, session_id: str | None = None) -> list[Checkpoint]:
        params = {"session_id": session_id} if session_id else {}
        return _adapt(_CHECKPOINTS, await self._call("GET", "/v1/checkpoints", params=params), "a list of checkpoints")

    async def delete_checkpoint(self, path: str) -> None:
        await self._call("DELETE", "/v1/checkpoints", params={"path": path})

    def get_tokenizer(self, base_model: str) -> Tokenizer:
        """The worker's tokenizer files, loaded here with transformers (fetched once per base model)."""
        if base_model not in self._tokenizers:
            from transformers import AutoTokenizer

            try:
                with httpx.stream(
                    "GET", f"{self.base_url}/v1/tokenizer", params={"base_model": base_model}, headers=self._headers, timeout=60.0
                ) as r:
                    content = b""
                    for chunk in r.iter_bytes():
                        content += chunk
                        if len(content) > self.max_response_bytes:
                            raise APIResponseValidationError(f"GET /v1/tokenizer: the answer is over {self.max_response_bytes} bytes")
            except (httpx.TransportError, httpx.TimeoutException) as err:
                raise TransientError(f"GET /v1/tokenizer: {type(err).__name__}: {err}") from err
            except httpx.DecodingError as err:
                raise APIResponseValidationError(f"GET /v1/tokenizer: the answer's Content-Encoding does not decode: {err}") from None
            files = _result(r, content)
            files = files.get("files") if isinstance(files, dict) else None
            if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
                raise APIResponseValidationError("GET /v1/tokenizer: the answer holds no {name: text} files")
            with tempfile.TemporaryDirectory() as tmp:
                for name, text in files.items():
                    (Path(tmp) / Path(name).name).write_text(text)
                self._tokenizers[base_model] = AutoTokenizer.from_pretrained(tmp)
        return self._tokenizers[base_model]


async def read_capped(r: httpx.Response, limit: int, what: str) -> bytes:
    """The (decoded) body of the streamed ``r``, refused (an APIResponseValidationError) as soon as it is known to
    pass ``limit`` bytes: a 2 GB ``Content-Length`` before a byte is read, a gzip bomb at ``limit`` decoded bytes."""
    declared = r.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit and "content-encoding" not in r.headers:
        raise APIResponseValidationError(f"{what}: the worker announced a {int(declared)}-byte answer, over max_response_bytes={limit}")
    parts: list[bytes] = []
    size = 0
    async for chunk in r.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise APIResponseValidationError(f"{what}: the answer passed max_response_bytes={limit} (decoded)")
        parts.append(chunk)
    return b"".join(parts)


def _result(r: httpx.Response, content: bytes) -> Any:
    """The JSON of a 2xx answer, or the worker's typed error (a 4xx is the caller's input: never retried;
    a 5xx without the worker's error body, e.g. from a proxy, is a TransientError). A redirect is not followed,
    and an error body under a 2xx is that error."""
    try:
        body = json.loads(content) if content else None
    except ValueError:  # not JSON (or not UTF-8)
        if r.status_code < 300:
            raise APIResponseValidationError(
                f"the worker answered {r.status_code} with a body that is not JSON: {content[:200]!r}"
            ) from None
        body = content[:500].decode("utf-8", "replace")
    if 300 <= r.status_code < 400:
        where = r.headers.get("location", "")[:200]
        raise APIResponseValidationError(f"the worker answered {r.status_code}, a redirect to {where!r}: not followed (check the URL)")
    if r.status_code >= 400 or (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        raise wire.decode_error(body, r.status_code, r.headers.get("retry-after"))
    return body


def _parse(model: type[M], body: Any) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise wire.invalid_answer(f"a {model.__name__}", err) from None


def _adapt(adapter: TypeAdapter[Any], body: Any, what: str) -> Any:
    try:
        return adapter.validate_python(body)
    except ValidationError as err:
        raise wire.invalid_answer(what, err) from None
