"""The typed error hierarchy shared by the client and every backend.

Every error carries the operation name, the training sequence number (when there is one) and the
backend's request id, so a failure in a long pipelined loop can be traced to the call that caused it.
"""

from __future__ import annotations

__all__ = [
    "AsyncSessError",
    "InvalidInputError",
    "UnsupportedError",
    "ConflictError",
    "TransientError",
    "RetriesExhaustedError",
    "DeadlineExceededError",
    "ServerError",
    "SessionGoneError",
    "PoisonedError",
    "OperationCancelledError",
    "FacadeMisuseError",
    "ResourceExhaustedError",
]


class AsyncSessError(Exception):
    """Base class of every asyncsess error."""

    def __init__(
        self,
        message: str,
        *,
        operation: str | None = None,
        seq: int | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.operation = operation
        self.seq = seq
        self.request_id = request_id

    def __str__(self) -> str:
        where = [f"{k}={v}" for k, v in (("op", self.operation), ("seq", self.seq), ("request_id", self.request_id)) if v is not None]
        return f"{self.message} [{', '.join(where)}]" if where else self.message

    def __reduce__(self):  # keep errors picklable across processes
        return (_rebuild, (type(self), self.message, self.__dict__))


def _rebuild(cls: type[AsyncSessError], message: str, state: dict) -> AsyncSessError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class InvalidInputError(AsyncSessError, ValueError):
    """Bad input from the caller (a 4xx). ``field`` names what is wrong, ``fix`` says how to mend it."""

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None, **kw) -> None:
        text = message if field is None else f"{field}: {message}"
        if fix:
            text = f"{text} (fix: {fix})"
        super().__init__(text, **kw)
        self.field = field
        self.fix = fix


class UnsupportedError(InvalidInputError):
    """The backend does not offer this feature (a loss, a model, an option)."""


class ConflictError(InvalidInputError):
    """A sequence number was reused with a different idempotency key, or a name already exists."""


class TransientError(AsyncSessError):
    """A fault worth retrying: timeout, dropped connection, throttling, 408/409/429/5xx."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after


class RetriesExhaustedError(AsyncSessError):
    """A transient fault persisted through every retry; ``attempts`` were made, ``__cause__`` is the last."""

    def __init__(self, message: str, *, attempts: int, **kw) -> None:
        super().__init__(message, **kw)
        self.attempts = attempts


class DeadlineExceededError(AsyncSessError, TimeoutError):
    """An operation did not finish within its deadline."""


class ServerError(AsyncSessError):
    """The backend failed while executing a valid request (not retried)."""


class SessionGoneError(AsyncSessError):
    """The session was stopped, expired or failed; no further operation can run on it."""


class PoisonedError(AsyncSessError):
    """An earlier training op on this client failed, so later ops were not run. ``cause`` is that failure."""

    def __init__(self, message: str, *, cause: BaseException | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.cause = cause


class OperationCancelledError(AsyncSessError):
    """The future was cancelled before the op finished."""


class FacadeMisuseError(RuntimeError):
    """A blocking call was made from the sync facade's own event loop, where it would deadlock."""


class ResourceExhaustedError(ServerError):
    """The backend ran out of a resource (device memory) on a valid request; the session stays usable.

    ``budget`` names the limit in force when it happened (e.g. tokens per micro-batch); send less
    (fewer or shorter datums) or let the backend's lowered budget take effect.
    """

    budget: int | None = None  # also when rebuilt from a wire body that does not carry it

    def __init__(self, message: str, *, budget: int | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.budget = budget
