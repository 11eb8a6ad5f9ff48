"""What a sandbox returns: one execution's result, and a program's report over a list of tests."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, computed_field

__all__ = ["ExecutionStatus", "ExecutionResult", "TestCase", "TestResult", "TestReport", "outputs_match"]

ExecutionStatus = Literal["ok", "runtime_error", "timeout", "memory", "output_limit", "sandbox_error"]


class ExecutionResult(BaseModel):
    """One run of a program.

    ``status`` is ``ok`` only for a zero exit; ``sandbox_error`` means the sandbox itself failed (the program's
    verdict is unknown), every other status is the program's fault. ``exit_code`` is negative for a signal and
    ``None`` when the program never started. ``cpu_s`` is ``None`` where the sandbox cannot measure it.
    """

    status: ExecutionStatus
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    cpu_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class TestCase(BaseModel):
    """A stdin/stdout test: the program is fed ``stdin`` and must print ``expected_stdout``."""

    __test__ = False  # not a pytest class

    stdin: str = ""
    expected_stdout: str


class TestResult(BaseModel):
    __test__ = False

    passed: bool
    result: ExecutionResult


class TestReport(BaseModel):
    """A program's results over a list of tests, in the tests' order."""

    __test__ = False

    results: list[TestResult]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total(self) -> int:
        return len(self.results)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def all_passed(self) -> bool:
        return bool(self.results) and self.passed == self.total


def _normalize(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def outputs_match(actual: str, expected: str) -> bool:
    """Whether two outputs agree up to trailing whitespace on each line and trailing blank lines."""
    return _normalize(actual) == _normalize(expected)
