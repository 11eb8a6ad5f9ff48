"""The typed error hierarchy shared by the client and every backend.

Every error carries the operation name, the training sequence number (when there is one) and the
backend's request id, so a failure in a long pipelined loop can be traced to the call that caused it.

Both anchors' error names are part of this one hierarchy, so ``except`` clauses written for either
SDK keep working: Tinker's ``TinkerError``/``APIError`` and SageMaker's ``TrainingSessionError`` are the
base class; ``APIStatusError`` (with ``status_code``) is the parent of every error that maps to an HTTP
status (``BadRequestError`` = :class:`InvalidInputError`, ``NotFoundError``, ``ConflictError``,
``RateLimitError``, ``InternalServerError`` = :class:`ServerError`, ...); ``OperationError`` =
``RequestFailedError`` is the parent of every failure of an accepted op (:class:`ServerError`,
:class:`PoisonedError`, :class:`SessionGoneError`, ...). :func:`is_retryable` says whether sending the
call again may succeed.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "ArtifactDeletionError",
    "AuthenticationError",
    "BadRequestError",
    "BillingError",
    "InternalServerError",
    "NotFoundError",
    "OperationError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestFailedError",
    "ResultMismatchError",
    "TinkerError",
    "TrainingSessionError",
    "UnprocessableEntityError",
    "is_retryable",
    "AsyncSessError",
    "InvalidInputError",
    "InputValidationError",
    "UnsupportedError",
    "NonFiniteGradientError",
    "ConflictError",
    "TransientError",
    "RetriesExhaustedError",
    "DeadlineExceededError",
    "ServerError",
    "SessionGoneError",
    "PoisonedError",
    "OperationCancelledError",
    "FacadeMisuseError",
    "ClientClosedError",
    "WrongEventLoopError",
    "ResourceExhaustedError",
    "InsufficientStorageError",
    "SamplerRefreshError",
]


class AsyncSessError(Exception):
    """Base class of every asyncsess error."""

    void: bool = False
    """True when the failed op applied nothing and its ``seq`` is used up: the session is as it was, so the op
    poisons nothing and the ops numbered after it run (see :func:`poisons`). A server sets it when it refuses a
    numbered op before anything ran (``"void": true`` in the worker's error body); a
    :class:`NonFiniteGradientError` is always void."""

    def __init__(
        self,
        message: str,
        *,
        operation: str | None = None,
        seq: int | None = None,
        request_id: str | None = None,
        void: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.operation = operation
        self.seq = seq
        self.request_id = request_id
        if void:
            self.void = True

    def __str__(self) -> str:
        where = [f"{k}={v}" for k, v in (("op", self.operation), ("seq", self.seq), ("request_id", self.request_id)) if v is not None]
        return f"{self.message} [{', '.join(where)}]" if where else self.message

    def __reduce__(self):  # keep errors picklable across processes
        return (_rebuild, (type(self), self.message, self.__dict__))

    # The anchors' attribute names for the same facts.
    @property
    def operation_type(self) -> str | None:
        """SageMaker's name for :attr:`operation`."""
        return self.operation

    @property
    def operation_id(self) -> str | None:
        """SageMaker's name for :attr:`request_id`."""
        return self.request_id

    @property
    def category(self) -> str:
        """Tinker's ``RequestFailedError.category``: ``user`` for bad input, else ``server``."""
        return "user" if isinstance(self, InvalidInputError) else "server"

    body: object = None  # Tinker's APIError.body / .request: no HTTP body or request object here
    request: object = None


def _rebuild(cls: type[AsyncSessError], message: str, state: dict) -> AsyncSessError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class APIStatusError(AsyncSessError):
    """An error that maps to an HTTP status (Tinker's ``APIStatusError``); ``status_code`` says which."""

    status_code: int = 500


class OperationError(AsyncSessError):
    """An accepted op failed while running (SageMaker's ``OperationError``, Tinker's ``RequestFailedError``)."""


class InvalidInputError(APIStatusError, ValueError):
    """Bad input from the caller (a 4xx). ``field`` names what is wrong, ``fix`` says how to mend it."""

    status_code = 400

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None, **kw) -> None:
        text = message if field is None else f"{field}: {message}"
        if fix:
            text = f"{text} (fix: {fix})"
        super().__init__(text, **kw)
        self.field = field
        self.fix = fix


class InputValidationError(InvalidInputError, ValidationError):
    """An input type (``AdamParams``, ``SamplingParams``, ``Datum``, ...) refused a value when built: an
    :class:`InvalidInputError` (so Tinker's ``BadRequestError``) naming the field, and still pydantic's
    ``ValidationError`` (``errors()``, ``title``). Made by :meth:`of`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """pydantic-core calls this from ``from_exception_data``; :meth:`of` sets the rest."""

    @classmethod
    def of(cls, err: ValidationError) -> InputValidationError:
        """The same errors as ``err``, the first one naming ``field``."""
        details = err.errors(include_url=False)
        new = cls.from_exception_data(err.title, details)  # type: ignore[arg-type]
        where, what, given = (details[0]["loc"], details[0]["msg"], details[0]["input"]) if details else ((), str(err), None)
        field = ".".join(map(str, where)) or None
        what = what.removeprefix("Value error, ")
        got = f"{err.title} got {given!r:.60}: " if field else f"{err.title}: "
        InvalidInputError.__init__(new, got + what, field=field, fix=f"see help({err.title}) for what each field takes")
        return new

    __str__ = AsyncSessError.__str__

    def __reduce__(self) -> Any:  # pydantic's own reduce would drop field and fix
        return (_rebuild_validation, (type(self), self.title, self.errors(include_url=False), self.__dict__))


def _rebuild_validation(cls: type[InputValidationError], title: str, details: list[Any], state: dict) -> InputValidationError:
    err = cls.from_exception_data(title, details)
    Exception.__init__(err, state.get("message", ""))
    err.__dict__.update(state)
    return err


class UnsupportedError(InvalidInputError):
    """The backend does not offer this feature (a loss, a model, an option)."""


class NonFiniteGradientError(InvalidInputError, OperationError):
    """``optim_step`` met a gradient whose norm is NaN or infinite and applied nothing (torch's
    ``clip_grad_norm_(error_if_nonfinite=True)`` test): weights and optimizer state are as before the call, the
    gradient is cleared, and the session lives on — neither the backend nor the client is poisoned (it is
    :attr:`~AsyncSessError.void`), so the next ``forward_backward`` starts afresh.
    """

    void = True

    def __init__(self, norm: float, **kw) -> None:
        super().__init__(
            f"the gradient accumulated since the last optim_step has norm {norm}; the step was not applied and the "
            "gradient was cleared (weights and optimizer state are unchanged)",
            field="gradient",
            fix="look for huge advantages or weights in the forward_backward calls since the last step, or lower "
            "learning_rate; the session is intact, so send the next forward_backward",
            **kw,
        )


class ConflictError(InvalidInputError):
    """A sequence number was reused with a different idempotency key, or a name already exists."""

    status_code = 409


class NotFoundError(InvalidInputError):
    """No such session, sampler or checkpoint (a 404)."""

    status_code = 404


class AuthenticationError(APIStatusError):
    """The backend did not accept the credentials (a 401)."""

    status_code = 401


class PermissionDeniedError(APIStatusError):
    """The credentials may not do this (a 403)."""

    status_code = 403


class BillingError(APIStatusError):
    """The account cannot pay for this (a 402)."""

    status_code = 402


class TransientError(AsyncSessError):
    """A fault worth retrying: timeout, dropped connection, throttling, 408/409/429/5xx.

    ``lost_response=True`` says the request reached the backend and only its answer was lost (a
    connection dropped while reading): the backend has, or soon has, the result stored under the op's
    idempotency key, so the first retry goes out at once instead of after a backoff.
    """

    def __init__(self, message: str, *, retry_after: float | None = None, lost_response: bool = False, **kw) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after
        self.lost_response = lost_response


class APIConnectionError(TransientError):
    """The request may not have reached the backend (Tinker's ``APIConnectionError``)."""


class APITimeoutError(APIConnectionError):
    """A request timed out on the wire (Tinker's ``APITimeoutError``)."""


class RateLimitError(TransientError, APIStatusError):
    """The backend is throttling (a 429)."""

    status_code = 429


class RetriesExhaustedError(AsyncSessError):
    """A transient fault persisted through every retry; ``attempts`` were made, ``__cause__`` is the last."""

    def __init__(self, message: str, *, attempts: int, **kw) -> None:
        super().__init__(message, **kw)
        self.attempts = attempts


class DeadlineExceededError(AsyncSessError, TimeoutError):
    """An operation did not finish within its deadline."""


class ServerError(OperationError, APIStatusError):
    """The backend failed while executing a valid request (not retried)."""

    status_code = 500


class APIResponseValidationError(ServerError):
    """The backend answered with something that is not a valid response."""


class ResultMismatchError(ServerError):
    """A per-token result does not match its request's length (SageMaker's ``ResultMismatchError``)."""

    def __init__(self, operation_type: str, expected: int, received: int, **kw) -> None:
        super().__init__(f"{operation_type} returned {received} values for a {expected}-token sequence", operation=operation_type, **kw)
        self.expected = expected
        self.received = received


class ArtifactDeletionError(AsyncSessError):
    """Deleting a checkpoint's stored files did not fully succeed; the checkpoint record was kept."""

    def __init__(self, model_package_arn: str, s3_uri: str, failed_keys: list[str], **kw) -> None:
        super().__init__(f"could not delete every file under {s3_uri} of {model_package_arn}: {', '.join(failed_keys[:5])}", **kw)
        self.model_package_arn = model_package_arn
        self.s3_uri = s3_uri
        self.failed_keys = failed_keys


class SessionGoneError(OperationError):
    """The session was stopped, expired or failed; no further operation can run on it."""


class PoisonedError(OperationError):
    """An earlier training op on this client failed, so later ops were not run. ``cause`` is that failure."""

    def __init__(self, message: str, *, cause: BaseException | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.cause = cause


class OperationCancelledError(OperationError):
    """The future was cancelled before the op finished."""


# The anchors' names for the same classes (one hierarchy; aliases, not copies).
TinkerError = AsyncSessError
APIError = AsyncSessError
TrainingSessionError = AsyncSessError
RequestFailedError = OperationError
BadRequestError = InvalidInputError
UnprocessableEntityError = InvalidInputError
InternalServerError = ServerError


def is_retryable(error: BaseException) -> bool:
    """Whether sending the failed call again may succeed (SageMaker's ``is_retryable``).

    True for transient faults (throttling, 5xx, dropped connections), also after the retry policy
    gave up on them; False for rejected input and for failures of an op that ran.
    """
    if isinstance(error, RetriesExhaustedError):
        return isinstance(error.__cause__, TransientError) or error.__cause__ is None
    if isinstance(error, TransientError):
        return True
    return isinstance(error, (ConnectionError, TimeoutError)) and not isinstance(error, AsyncSessError)


def poisons(error: BaseException) -> bool:
    """Whether a failed ordered op poisons the ops numbered after it (they then fail with :class:`PoisonedError`).

    Every failure does, except a :attr:`~AsyncSessError.void` one: an op refused before anything ran, or an
    ``optim_step`` skipped for a non-finite gradient. The backends' sequencer and the client both ask this.
    """
    return not (isinstance(error, AsyncSessError) and error.void)


class FacadeMisuseError(RuntimeError):
    """A blocking call was made from the sync facade's own event loop, where it would deadlock."""


class ClientClosedError(SessionGoneError, RuntimeError):
    """The ServiceClient was closed, or never opened: open one with ``async with ServiceClient(url) as svc:``."""


class WrongEventLoopError(AsyncSessError, RuntimeError):
    """A client was used from an event loop (or thread, or forked process) other than the one that opened it: its
    tasks and events belong to that loop. Use it there, or open a ServiceClient on this loop."""


class ResourceExhaustedError(ServerError):
    """The backend ran out of a resource (device memory) on a valid request; the session stays usable.

    ``budget`` names the limit in force when it happened (e.g. tokens per micro-batch); send less
    (fewer or shorter datums) or let the backend's lowered budget take effect.
    """

    budget: int | None = None  # also when rebuilt from a wire body that does not carry it

    def __init__(self, message: str, *, budget: int | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.budget = budget


class InsufficientStorageError(ResourceExhaustedError):
    """A save failed for the disk (full, over a quota, a file too large): nothing was written under its name and
    the session goes on (a worker sends it void, HTTP 507). Not retryable: the disk stays full until checkpoints are
    deleted (``delete_checkpoint``) or the operator frees space; then send a new save."""

    status_code = 507
    fix: str | None = None

    def __init__(self, message: str, *, fix: str | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.fix = fix


class SamplerRefreshError(OperationError):
    """A refreshed sampler does not serve the weights it was made from (see :mod:`asyncsess.rl.refresh`).

    ``expected_version`` is the trainer's weight version (optimizer steps) the sampler should serve;
    ``observed`` says what it serves instead: ``"previous"`` (the refresh did not take: still version
    ``previous_version``, by default ``expected_version - 1``) or ``"neither"`` (matches no trainer version, e.g. the last update or the
    adapter applied twice after a resume). ``max_abs_diff`` is the probe's largest log-prob difference
    from the trainer at ``expected_version``; ``tolerance`` the bound it broke.
    """

    def __init__(
        self,
        *,
        expected_version: int,
        observed: str,
        max_abs_diff: float,
        tolerance: float,
        previous_version: int | None = None,
        fix: str | None = None,
        **kw,
    ) -> None:
        prev = expected_version - 1 if previous_version is None else previous_version
        what = {
            "previous": f"still serves weight version {prev}: the refresh did not take",
            "neither": f"matches neither version {expected_version} nor version {prev}: the update (or the adapter) was applied twice "
            "or the wrong adapter was loaded",
        }.get(observed, observed)
        fix = fix or (
            "check that the backend loads the new adapter under a new name (no stale cache) and applies it once; "
            "restart the sampler from save_weights_and_get_sampling_client()"
        )
        message = (
            f"sampler refresh to weight version {expected_version} {what} "
            f"(probe log-probs differ from the trainer's by up to {max_abs_diff:.3g} > tolerance {tolerance:.3g}) (fix: {fix})"
        )
        super().__init__(message, operation=kw.pop("operation", "sampler_refresh"), **kw)
        self.expected_version = expected_version
        self.previous_version = prev
        self.observed = observed
        self.max_abs_diff = max_abs_diff
        self.tolerance = tolerance
        self.fix = fix
