"""The one interface every sandbox offers, and the test runner they share."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar, runtime_checkable

import anyio
from anyio.lowlevel import RunVar

from asyncsess.errors import InvalidInputError
from asyncsess.sandbox.inputs import check_limit, encode_text
from asyncsess.sandbox.results import ExecutionResult, TestCase, TestReport, TestResult, outputs_match

__all__ = ["Files", "Sandbox", "BaseSandbox", "PerLoop"]

T = TypeVar("T")

Files = Mapping[str, "str | bytes"]
"""Extra files placed in the program's working directory: relative path -> content."""


class PerLoop(Generic[T]):
    """One ``make()`` per running event loop, made on first use there. anyio's limiters and locks belong to the
    loop (and backend) that first waits on them, and a sandbox outlives loops: each ``anyio.run`` /
    ``asyncio.run`` (the sync facade's, a test's) gets its own."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._var: RunVar[T] = RunVar(f"asyncsess.sandbox.PerLoop.{id(self)}")

    def get(self) -> T:
        try:
            return self._var.get()
        except LookupError:
            value = self._make()
            self._var.set(value)
            return value


@runtime_checkable
class Sandbox(Protocol):
    """Runs untrusted Python. Many runs may be awaited at once; the sandbox bounds how many execute together."""

    async def run(
        self,
        code: str,
        *,
        stdin: str = "",
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        files: Files | None = None,
    ) -> ExecutionResult: ...

    async def run_tests(
        self, code: str, tests: Sequence[TestCase], *, timeout_s: float | None = None, memory_mb: int | None = None
    ) -> TestReport: ...


class BaseSandbox(abc.ABC):
    """Implements :meth:`run_tests` on top of :meth:`run`: every test runs (in parallel), none is skipped."""

    @abc.abstractmethod
    async def run(
        self,
        code: str,
        *,
        stdin: str = "",
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        files: Files | None = None,
    ) -> ExecutionResult: ...

    def _check_code(self, code: str) -> bytes:
        """The program as UTF-8, or InvalidInputError(field="code") if this sandbox cannot take it."""
        return encode_text("code", code)

    async def run_tests(
        self, code: str, tests: Sequence[TestCase], *, timeout_s: float | None = None, memory_mb: int | None = None
    ) -> TestReport:
        if not tests:
            raise InvalidInputError("no tests to run", field="tests", fix="give at least one TestCase")
        # Bad input is refused here, as one InvalidInputError, not from inside the task group (an ExceptionGroup).
        self._check_code(code)
        for i, test in enumerate(tests):
            encode_text(f"tests[{i}].stdin", test.stdin)
        for field, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb)):
            if value is not None:
                check_limit(field, value)
        results: list[TestResult | None] = [None] * len(tests)

        async def one(i: int, test: TestCase) -> None:
            res = await self.run(code, stdin=test.stdin, timeout_s=timeout_s, memory_mb=memory_mb)
            results[i] = TestResult(passed=res.ok and outputs_match(res.stdout, test.expected_stdout), result=res)

        async with anyio.create_task_group() as tg:
            for i, test in enumerate(tests):
                tg.start_soon(one, i, test)
        return TestReport(results=[r for r in results if r is not None])
