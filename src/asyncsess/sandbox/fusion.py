"""SandboxFusionClient: the Sandbox interface over a SandboxFusion server (``POST /run_code``).

Request and response follow SandboxFusion's ``RunCodeRequest`` / ``RunCodeResponse``
(bytedance/SandboxFusion, sandbox/server/sandbox_api.py): the response's ``status`` is ``Success``, ``Failed`` or
``SandboxError`` and ``run_result`` is a ``CommandRunResult{status: Finished|Error|TimeLimitExceeded,
execution_time, return_code, stdout, stderr}``.
"""

from __future__ import annotations

import base64
import json
import os
import time

import anyio
import httpx
from pydantic import BaseModel

from asyncsess.errors import AsyncSessError, TransientError
from asyncsess.retry import RetryBudget, RetryPolicy, call_with_retry, retry_after_seconds
from asyncsess.sandbox.base import BaseSandbox, Files
from asyncsess.sandbox.inputs import check_files, check_limit, encode_text
from asyncsess.sandbox.results import ExecutionResult, ExecutionStatus

__all__ = ["SandboxFusionClient"]

DEFAULT_URL = "http://localhost:8080/run_code"
DEFAULT_RETRY = RetryPolicy(max_attempts=4, max_backoff=5.0, attempt_timeout=None, deadline=None)


class _CommandRunResult(BaseModel):
    status: str
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class _RunCodeResponse(BaseModel):
    status: str
    message: str = ""
    compile_result: _CommandRunResult | None = None
    run_result: _CommandRunResult | None = None


class SandboxFusionClient(BaseSandbox):
    """Runs Python on a SandboxFusion server; at most ``max_concurrency`` requests are in flight.

    ``url`` defaults to ``$SANDBOX_URL`` or ``http://localhost:8080/run_code``; a base URL gets ``/run_code``
    appended. Bad input (limits, code or stdin that is not valid text, bad ``files`` names or contents) is an
    InvalidInputError before any request, as with LocalSandbox. Timeouts, network errors, 429 and 5xx are retried
    under ``retry`` (asyncsess's one retry policy); a request that still fails, and a server-side ``SandboxError``,
    become an ``ExecutionResult`` with status ``sandbox_error``. SandboxFusion does not report memory exhaustion or
    CPU time: ``memory`` is inferred from a ``MemoryError`` at the end of stderr, and ``cpu_s`` is ``None``. Output
    past ``max_output_bytes`` is cut here and reported as ``output_limit``.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        max_concurrency: int = 32,
        timeout_s: float = 6.0,
        memory_mb: int = 1024,
        max_output_bytes: int = 1 << 20,
        retry: RetryPolicy = DEFAULT_RETRY,
        request_slack_s: float = 30.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        for field, value in (
            ("max_concurrency", max_concurrency),
            ("timeout_s", timeout_s),
            ("memory_mb", memory_mb),
            ("max_output_bytes", max_output_bytes),
            ("request_slack_s", request_slack_s),
        ):
            check_limit(field, value)
        url = (url or os.environ.get("SANDBOX_URL") or DEFAULT_URL).rstrip("/")
        self.url = url if url.endswith("/run_code") else url + "/run_code"
        self._timeout_s = timeout_s
        self._memory_mb = memory_mb
        self._max_output_bytes = max_output_bytes
        self._retry = retry
        self._retry_budget = RetryBudget()  # a sandbox server that keeps failing is not retried at once
        self._request_slack_s = request_slack_s
        self._client = client or httpx.AsyncClient()
        self._owns_client = client is None
        self._limiter = anyio.CapacityLimiter(max_concurrency)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> SandboxFusionClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def run(
        self,
        code: str,
        *,
        stdin: str = "",
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        files: Files | None = None,
    ) -> ExecutionResult:
        timeout_s = self._timeout_s if timeout_s is None else check_limit("timeout_s", timeout_s)
        memory_mb = self._memory_mb if memory_mb is None else check_limit("memory_mb", memory_mb)
        encode_text("code", code)
        encode_text("stdin", stdin)
        body: dict[str, object] = {
            "code": code,
            "language": "python",
            "compile_timeout": timeout_s,
            "run_timeout": timeout_s,
            "memory_limit_MB": memory_mb,
            "stdin": stdin,
            "files": {name: base64.b64encode(content).decode() for name, content in check_files(files).items()},
            "fetch_files": [],
        }
        async with self._limiter:
            started = time.monotonic()
            try:
                response = await self._post(body, timeout_s + self._request_slack_s)
            except (httpx.HTTPError, AsyncSessError, ValueError) as exc:
                wall_s = time.monotonic() - started
                return ExecutionResult(
                    status="sandbox_error",
                    stderr=f"SandboxFusion request to {self.url} failed: {type(exc).__name__}: {exc}\n",
                    wall_s=wall_s,
                )
            wall_s = time.monotonic() - started
        return self._to_result(response, wall_s)

    async def _post(self, body: dict, timeout_s: float) -> _RunCodeResponse:
        async def attempt() -> _RunCodeResponse:
            response = await self._client.post(self.url, json=body, timeout=timeout_s)
            if response.status_code == 429 or response.status_code >= 500:
                raise TransientError(
                    f"HTTP {response.status_code}: {response.text[:500]}",
                    retry_after=retry_after_seconds(response.headers.get("Retry-After")),
                )
            response.raise_for_status()
            return _RunCodeResponse.model_validate(json.loads(response.content))  # json: takes a lone surrogate escape

        return await call_with_retry(self._retry, attempt, operation="sandbox_fusion.run_code", budget=self._retry_budget)

    def _cap(self, text: str | None) -> tuple[str, bool]:
        """At most ``max_output_bytes`` of UTF-8 (a lone surrogate, from output that was not UTF-8, as U+FFFD)."""
        data = (text or "").encode("utf-8", "surrogatepass")
        cut = len(data) > self._max_output_bytes
        return data[: self._max_output_bytes].decode("utf-8", "ignore" if cut else "replace"), cut

    def _to_result(self, response: _RunCodeResponse, wall_s: float) -> ExecutionResult:
        run = response.run_result
        if response.status == "SandboxError" or run is None or run.status == "Error":
            detail = response.message or (run.stderr if run else "") or "no run result"
            return ExecutionResult(status="sandbox_error", stderr=f"SandboxFusion: {detail}\n", wall_s=wall_s)
        stdout, cut_out = self._cap(run.stdout)
        stderr, cut_err = self._cap(run.stderr)
        status: ExecutionStatus
        if run.status == "TimeLimitExceeded":
            status = "timeout"
        elif cut_out or cut_err:
            status = "output_limit"
        elif run.return_code == 0:
            status = "ok"
        elif stderr.rstrip().rsplit("\n", 1)[-1].startswith("MemoryError"):
            status = "memory"
        else:
            status = "runtime_error"
        return ExecutionResult(
            status=status,
            exit_code=run.return_code,
            stdout=stdout,
            stderr=stderr,
            wall_s=run.execution_time if run.execution_time is not None else wall_s,
        )
