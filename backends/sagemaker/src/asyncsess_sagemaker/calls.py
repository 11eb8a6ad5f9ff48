"""Calling boto3 from async code: worker threads, AWS errors -> asyncsess errors, retries, adaptive polling."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    HTTPClientError,
    NoCredentialsError,
    NoRegionError,
    ParamValidationError,
)
from botocore.parsers import ResponseParserError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_random_exponential

from asyncsess.errors import (
    AsyncSessError,
    AuthenticationError,
    ConflictError,
    InvalidInputError,
    PermissionDeniedError,
    ServerError,
    SessionGoneError,
    TransientError,
)
from asyncsess.retry import retry_after_seconds

__all__ = ["AwsCalls", "translate", "error_code", "TRANSIENT_CODES", "field_of"]

log = logging.getLogger("asyncsess_sagemaker")
T = TypeVar("T")

TRANSIENT_CODES = frozenset(
    {
        "ThrottlingException",
        "Throttling",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "InternalServerException",
        "InternalFailure",
        "ServiceUnavailable",
        "ServiceUnavailableException",
    }
)
DONE = frozenset({"Completed", "Failed", "Skipped"})
# the request's signature or credentials were refused (AWS's common errors, JSON and query names)
AUTH_CODES = frozenset(
    {
        "MissingAuthenticationTokenException",
        "MissingAuthenticationToken",
        "IncompleteSignatureException",
        "IncompleteSignature",
        "InvalidSignatureException",
        "SignatureDoesNotMatch",
        "UnrecognizedClientException",
        "InvalidClientTokenId",
        "ExpiredTokenException",
        "ExpiredToken",
    }
)
DENIED_CODES = frozenset({"AccessDeniedException", "AccessDenied"})


def error_code(err: BaseException | None) -> str | None:
    return err.response.get("Error", {}).get("Code") if isinstance(err, ClientError) else None


def field_of(message: str) -> str | None:
    """The member path in an AWS validation message (``... at 'operationConfig.x' failed ...``)."""
    head, sep, rest = message.partition(" at '")
    return rest.split("'", 1)[0] if sep else None


def translate(err: BaseException, operation: str, *, not_found: type[AsyncSessError] = SessionGoneError) -> AsyncSessError:
    """An asyncsess error for a botocore failure. ``not_found`` is what a missing resource means here."""
    if isinstance(err, ClientError):
        info, meta = err.response.get("Error", {}), err.response.get("ResponseMetadata", {})
        code, message, request_id = info.get("Code", "Unknown"), info.get("Message", str(err)), meta.get("RequestId")
        status = meta.get("HTTPStatusCode") or 0
        text = f"{code}: {message}"
        if code in TRANSIENT_CODES or status in (429, 500, 502, 503, 504):
            retry_after = retry_after_seconds((meta.get("HTTPHeaders") or {}).get("retry-after"))
            if retry_after is None and ("hrottl" in code or status == 429):
                retry_after = 0.5
            return TransientError(text, retry_after=retry_after, operation=operation, request_id=request_id)
        if code == "ValidationException":
            return InvalidInputError(
                text, field=field_of(message), fix="see the SageMaker limits in the message", operation=operation, request_id=request_id
            )
        if code in ("ResourceNotFound", "ResourceNotFoundException"):
            if not_found is InvalidInputError:
                return InvalidInputError(text, operation=operation, request_id=request_id)
            return not_found(text, operation=operation, request_id=request_id)
        if code in AUTH_CODES:
            return AuthenticationError(
                f"{text} (fix: check the AWS credentials, their region and the clock)", operation=operation, request_id=request_id
            )
        if code in DENIED_CODES:
            return PermissionDeniedError(text, operation=operation, request_id=request_id)
        if code == "ResourceInUse":  # a create of a name that exists
            return ConflictError(text, fix="pick another name", operation=operation, request_id=request_id)
        if code == "ConflictException":
            return SessionGoneError(text, operation=operation, request_id=request_id)
        return ServerError(text, operation=operation, request_id=request_id)
    if isinstance(err, (ConnectionError, HTTPClientError)):
        return TransientError(f"{type(err).__name__}: {err}", operation=operation)
    if isinstance(err, ResponseParserError):  # a reply broken on the way back: the call may have been applied
        return TransientError(f"unreadable reply: {str(err)[:200]}", operation=operation, lost_response=True)
    if isinstance(err, (NoCredentialsError, NoRegionError)):
        return InvalidInputError(
            str(err), field="credentials", fix="configure AWS credentials (env, profile= option, or instance role)", operation=operation
        )
    if isinstance(err, ParamValidationError):
        return InvalidInputError(str(err), fix="see the SageMaker limits in the message", operation=operation)
    if isinstance(err, BotoCoreError):
        return ServerError(f"{type(err).__name__}: {err}", operation=operation)
    raise err


def _check_reply(fn: Callable[..., Any], reply: Any, operation: str) -> None:
    """A reply of a boto3 client method holds its output shape's required members (but lists and maps). botocore reads a
    rest-json body it cannot parse as ``{}`` (a 200 cut short gave a KeyError on ``operationId``); such a reply is a
    lost one."""
    meta: Any = getattr(getattr(fn, "__self__", None), "meta", None)
    if meta is None or not isinstance(reply, dict):
        return
    api = meta.method_to_api_mapping.get(getattr(fn, "__name__", ""))
    if api is None:
        return
    shape = meta.service_model.operation_model(api).output_shape
    # a list or map the service leaves out when empty is no sign of a broken reply; a missing operationId is
    required = [m for m in (shape.required_members if shape is not None else []) if shape.members[m].type_name not in ("list", "map")]
    missing = [m for m in required if m not in reply]
    if missing:
        raise TransientError(f"unreadable reply: {api} answered without {', '.join(missing)}", operation=operation, lost_response=True)


class AwsCalls:
    """Runs boto3 calls in worker threads (bounded), retries transient failures, polls for results."""

    def __init__(self, *, threads: int, retry_base_s: float, retry_budget_s: float, poll_initial_s: float, poll_max_s: float) -> None:
        self._limiter = anyio.CapacityLimiter(threads)
        self.retry_base_s = retry_base_s
        self.retry_budget_s = retry_budget_s
        self.poll_initial_s = poll_initial_s
        self.poll_max_s = poll_max_s

    def with_budget(self, retry_budget_s: float) -> AwsCalls:
        """The same calls (sharing the thread limiter) with another retry budget."""
        calls = copy.copy(self)
        calls.retry_budget_s = retry_budget_s
        return calls

    async def once(self, fn: Callable[..., T], *, operation: str, not_found: type[AsyncSessError] = SessionGoneError, **kwargs: Any) -> T:
        """One call, errors translated."""
        try:
            reply = await anyio.to_thread.run_sync(functools.partial(fn, **kwargs), limiter=self._limiter)
        except (ClientError, BotoCoreError, ResponseParserError) as err:  # the last is no BotoCoreError
            raise translate(err, operation, not_found=not_found) from err
        _check_reply(fn, reply, operation)
        return reply

    async def retried(
        self,
        fn: Callable[..., T],
        *,
        operation: str,
        not_found: type[AsyncSessError] = SessionGoneError,
        replayed: Callable[[ClientError], T | None] | None = None,
        unanswered: bool = False,
        **kwargs: Any,
    ) -> T:
        """Like :meth:`once`, retrying ``TransientError`` with full-jitter backoff for up to ``retry_budget_s``.

        A transient failure may come after the service applied the call (a lost reply, a dropped connection), so a
        retry can be refused for what the first attempt did (``ResourceInUse`` for a create, "does not exist" for a
        delete). ``replayed(err)``, asked only about such a refusal after a transient failure (or on the first
        attempt too when ``unanswered``: an earlier call sent this request and read no answer), returns the reply to
        stand for the applied call, or None when the refusal is real."""
        transient = unanswered

        async def attempt_once() -> T:
            nonlocal transient
            try:
                return await self.once(fn, operation=operation, not_found=not_found, **kwargs)
            except TransientError:
                transient = True
                raise
            except AsyncSessError as err:
                cause = err.__cause__
                if transient and replayed is not None and isinstance(cause, ClientError):
                    reply = replayed(cause)
                    if reply is not None:
                        log.debug("%s: a retry found the earlier attempt applied (%s)", operation, error_code(cause))
                        return reply
                raise

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(TransientError),
            wait=wait_random_exponential(multiplier=self.retry_base_s, max=4.0),
            stop=stop_after_delay(self.retry_budget_s),
            sleep=anyio.sleep,
            reraise=True,
            before_sleep=lambda state: log.debug("retrying %s after %r", operation, state.outcome.exception() if state.outcome else None),
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await attempt_once()
        except TransientError as err:
            err.attempts = retrying.statistics.get("attempt_number", 1)  # type: ignore[attr-defined]
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def poll(
        self,
        fn: Callable[..., dict[str, Any]],
        *,
        operation: str,
        check: Callable[[], Awaitable[None]] | None = None,
        check_every_s: float = 5.0,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Poll a Get*OperationResult until the status is final: fast at first, backing off to ``poll_max_s``.

        ``check`` (e.g. "is the session still alive?") runs every ``check_every_s`` while the op is unfinished.
        """
        delay = self.poll_initial_s
        checked = anyio.current_time()
        while True:
            resp = await self.retried(fn, operation=operation, **kwargs)
            if resp.get("status") in DONE:
                return resp
            if check is not None and anyio.current_time() - checked >= check_every_s:
                await check()
                checked = anyio.current_time()
            await anyio.sleep(delay)
            delay = min(delay * 1.5, self.poll_max_s)
