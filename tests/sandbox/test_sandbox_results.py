"""Output comparison and test-report arithmetic."""

from __future__ import annotations

import pytest

from asyncsess.errors import InvalidInputError
from asyncsess.sandbox import BaseSandbox, ExecutionResult, Sandbox, TestCase, TestReport, TestResult, outputs_match


@pytest.mark.parametrize(
    ("actual", "expected"),
    [("1 2\n", "1 2"), ("1 2   \n\n\n", "1 2\n"), ("a \nb\t\n", "a\nb"), ("x\r\ny\r\n", "x\ny\n"), ("", "\n")],
)
def test_outputs_match_ignores_trailing_whitespace(actual, expected):
    assert outputs_match(actual, expected)


@pytest.mark.parametrize(
    ("actual", "expected"),
    [("1 3\n", "1 2\n"), (" 1 2\n", "1 2\n"), ("1  2\n", "1 2\n"), ("1\n\n2\n", "1\n2\n"), ("1\n", "1\n2\n")],
)
def test_outputs_match_rejects_other_differences(actual, expected):
    assert not outputs_match(actual, expected)


def _result(passed: bool) -> TestResult:
    return TestResult(passed=passed, result=ExecutionResult(status="ok" if passed else "runtime_error"))


def test_report_counts_and_serializes():
    report = TestReport(results=[_result(True), _result(False), _result(True)])
    assert (report.passed, report.total, report.all_passed) == (2, 3, False)
    dumped = report.model_dump()
    assert (dumped["passed"], dumped["total"], dumped["all_passed"]) == (2, 3, False)
    assert TestReport(results=[_result(True)]).all_passed


class _Scripted(BaseSandbox):
    """Answers each stdin with a canned result, to test run_tests on its own."""

    def __init__(self, answers: dict[str, ExecutionResult]):
        self.answers = answers

    async def run(self, code, *, stdin="", timeout_s=None, memory_mb=None, files=None):
        return self.answers[stdin]


@pytest.mark.anyio
async def test_run_tests_needs_ok_status_and_matching_output():
    sandbox = _Scripted(
        {
            "a": ExecutionResult(status="ok", stdout="1\n"),
            "b": ExecutionResult(status="ok", stdout="2\n"),
            "c": ExecutionResult(status="runtime_error", exit_code=1, stdout="3\n"),
        }
    )
    assert isinstance(sandbox, Sandbox)
    tests = [TestCase(stdin="a", expected_stdout="1"), TestCase(stdin="b", expected_stdout="3"), TestCase(stdin="c", expected_stdout="3")]
    report = await sandbox.run_tests("code", tests)
    assert [r.passed for r in report.results] == [True, False, False]
    assert (report.passed, report.total, report.all_passed) == (1, 3, False)


@pytest.mark.anyio
async def test_run_tests_rejects_an_empty_test_list():
    with pytest.raises(InvalidInputError, match="tests"):
        await _Scripted({}).run_tests("code", [])
