"""Backend-side helper: run one session's ops in sequence order, each exactly once.

Every backend that executes ops itself (mock, local worker, SageMaker emulator) wraps its executor
in a :class:`Sequencer`, so the exactly-once and ordering rules are written once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import anyio

from ..errors import AsyncSessError, ConflictError, PoisonedError, SessionGoneError, TransientError, poisons

__all__ = ["Sequenced", "Sequencer"]


class Sequenced(Protocol):
    """What the sequencer reads: a place, a delivery key, and a name for errors. Every op record is one."""

    @property
    def seq(self) -> int: ...

    @property
    def idempotency_key(self) -> str: ...

    @property
    def kind(self) -> str: ...


R = TypeVar("R")


@dataclass
class _Slot(Generic[R]):
    key: str
    done: anyio.Event
    result: R | None = None
    error: BaseException | None = None
    what: tuple[Any, ...] = ()  # what a re-delivery must repeat (see _what)


def _what(op: Sequenced) -> tuple[Any, ...]:
    """The parts of ``op`` a re-delivery under its key must repeat: its kind, and the checkpoint name or path it
    names. No backend rewrites these when it checks an op (a batch may be coerced, so it is not compared)."""
    return (op.kind, getattr(op, "name", None), getattr(op, "path", None))


class Sequencer(Generic[R]):
    """Executes ``run(op)`` for ops in ``seq`` order starting at ``first_seq``.

    ``run`` gets the object ``execute`` was given: an op record for a backend, any :class:`Sequenced` for a door.

    - An op that arrives early waits for its predecessors (at most ``gap_timeout`` seconds, then it
      fails with a retryable error and the slot is freed so a retry can wait again). With ``skip_gaps``
      (a server whose clients never re-send a number they gave up on, as Tinker's SDK) it runs instead, and the
      numbers that never arrived are void: their turn passes, and :attr:`skipped` lists them.
    - A repeated delivery (same ``seq`` and key) gets the stored result or error without re-running; one of
      another kind (or naming another checkpoint) is a :class:`ConflictError` naming ``idempotency_key``:
      answering it with the first op's result would hide the caller's bug.
    - The same ``seq`` with another key is a :class:`ConflictError`, and so is a re-delivery of an op
      more than ``keep_results`` ops old (its result is no longer kept).
    - After an op fails, every later op fails with :class:`PoisonedError` naming the cause, unless the failure
      left the session as it was (a :attr:`~asyncsess.errors.AsyncSessError.void` one: see
      :func:`~asyncsess.errors.poisons`).
    - :meth:`refuse` gives a refused op's ``seq`` its turn without running anything: its seq is void.
    - :meth:`stored` says whether a delivery would be answered from the store, so a backend can answer it
      as cheaply as a real server answers a re-delivered op: one round trip, no op time.
    """

    def __init__(
        self,
        run: Callable[[Any], Awaitable[R]],
        *,
        first_seq: int = 1,
        gap_timeout: float = 60.0,
        keep_results: int = 1024,
        skip_gaps: bool = False,
    ) -> None:
        self._run = run
        self._next = first_seq
        self._slots: dict[int, _Slot[R]] = {}
        self._turn: dict[int, anyio.Event] = {}
        self._gap_timeout = gap_timeout
        self._keep = keep_results  # results kept for re-delivery; older duplicates get a ConflictError
        self._poison: tuple[int, BaseException] | None = None
        self._void: set[int] = set()  # refused seqs ahead of the next one: their turn passes without running anything
        self._stopped: str | None = None
        self._skip_gaps = skip_gaps
        self.skipped: set[int] = set()  # seqs voided by skip_gaps (the last keep_results of them)
        self.applied: list[int] = []  # seqs actually executed, in order (for tests and logs)

    @property
    def next_seq(self) -> int:
        return self._next

    def stored(self, op: Sequenced) -> bool:
        """Whether ``op`` (same ``seq`` and key) already ran and its result or error is kept: executing it again
        returns that outcome at once, without running anything."""
        slot = self._slots.get(op.seq)
        return slot is not None and slot.key == op.idempotency_key and slot.done.is_set()

    def stop(self, reason: str = "stopped") -> None:
        """Refuse every later op; wake waiters so they fail instead of hanging."""
        self._stopped = reason
        for ev in self._turn.values():
            ev.set()

    async def execute(self, op: Sequenced) -> R:
        slot = self._slots.get(op.seq)
        if slot is not None:
            if slot.key != op.idempotency_key:
                raise ConflictError(
                    f"sequence number {op.seq} was already used with another idempotency key",
                    field="seq",
                    fix="use a fresh sequence number for a new op",
                    operation=op.kind,
                    seq=op.seq,
                )
            if slot.what != _what(op):
                raise ConflictError(
                    f"sequence number {op.seq} and its idempotency key were already used for another op ({slot.what[0]})",
                    field="idempotency_key",
                    fix="give each new op its own seq and key; resend one only to retry the same op",
                    operation=op.kind,
                    seq=op.seq,
                )
            await slot.done.wait()
            return self._outcome(slot)
        if op.seq < self._next:
            raise ConflictError(
                f"sequence number {op.seq} is behind the session ({self._next})", field="seq", operation=op.kind, seq=op.seq
            )
        if self._stopped is not None:
            raise SessionGoneError(f"session {self._stopped}", operation=op.kind, seq=op.seq)
        slot = _Slot(key=op.idempotency_key, done=anyio.Event(), what=_what(op))
        self._slots[op.seq] = slot
        try:
            await self._wait_turn(op)
        except BaseException as err:
            del self._slots[op.seq]
            slot.error = TransientError(f"op {op.seq} was not run ({err!r}); send it again", operation=op.kind, seq=op.seq)
            slot.done.set()
            raise
        try:
            if self._poison is not None:
                cause_seq, cause = self._poison
                raise PoisonedError(f"op {cause_seq} failed earlier on this session: {cause}", cause=cause, operation=op.kind, seq=op.seq)
            try:
                with anyio.CancelScope(shield=True):  # a caller giving up must not half-apply an op
                    slot.result = await self._run(op)
                self.applied.append(op.seq)
            except AsyncSessError as err:
                if err.seq is None:
                    err.seq = op.seq
                if err.operation is None:
                    err.operation = op.kind
                raise
        except Exception as err:
            slot.error = err
            if poisons(err):
                self._poison = self._poison or (op.seq, err)
        finally:
            self._advance()
            slot.done.set()
        return self._outcome(slot)

    def refuse(self, op: Sequenced, error: AsyncSessError) -> None:
        """Raise ``error`` for ``op``, refused before anything ran, marked void: ``op``'s ``seq`` is used up (its turn
        passes without running anything, so the ops after it run) and a re-delivery gets the same error.

        Returns without raising when ``op``'s ``seq`` is no longer free (a re-delivery, a stopped session):
        :meth:`execute` answers that delivery as it answers any other."""
        if op.seq in self._slots or op.seq < self._next or self._stopped is not None:
            return
        error.void = True
        error.seq = op.seq if error.seq is None else error.seq
        error.operation = error.operation or op.kind
        done = anyio.Event()
        done.set()
        self._slots[op.seq] = _Slot(key=op.idempotency_key, done=done, error=error, what=_what(op))
        self._void.add(op.seq)
        if op.seq == self._next:
            self._advance()
        raise error

    async def _wait_turn(self, op: Sequenced) -> None:
        while op.seq != self._next:
            ev = self._turn.setdefault(op.seq, anyio.Event())
            with anyio.move_on_after(self._gap_timeout) as scope:
                await ev.wait()
            self._turn.pop(op.seq, None)
            if self._stopped is not None:
                raise SessionGoneError(f"session {self._stopped}", operation=op.kind, seq=op.seq)
            if scope.cancelled_caught and not self._skip_gaps:
                raise TransientError(
                    f"ops {self._next}..{op.seq - 1} never arrived (waited {self._gap_timeout:g}s)", operation=op.kind, seq=op.seq
                )
            if scope.cancelled_caught:
                self._skip_missing(op.seq)

    def _skip_missing(self, seq: int) -> None:
        """Void the numbers before ``seq`` that never arrived (those that did keep their turn), then advance past them."""
        missing = [s for s in range(self._next, seq) if s not in self._slots and s not in self._void]
        self._void.update(missing)
        self.skipped.update(missing)
        self.skipped -= {s for s in self.skipped if s < self._next - self._keep}
        if self._next in self._void:
            self._void.discard(self._next)
            self._advance()

    def _advance(self) -> None:
        """Move past the current number and every void one after it; wake the op whose turn it is."""
        while True:
            self._slots.pop(self._next - self._keep, None)
            self._next += 1
            if self._next not in self._void:
                break
            self._void.discard(self._next)
        ev = self._turn.get(self._next)
        if ev is not None:
            ev.set()

    @staticmethod
    def _outcome(slot: _Slot[R]) -> R:
        if slot.error is not None:
            raise slot.error
        return slot.result  # type: ignore[return-value]
