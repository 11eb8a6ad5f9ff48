"""Competitive programming with stdin/stdout tests, graded in a sandbox: the ``code_rl`` recipe's task.

Two row formats load (JSONL, one problem per line, told apart by their keys):

- bundled (``examples/data/code_problems.jsonl``): ``{"id", "question", "tests": [{"input", "output"}], "solution"}``
  (``solution``, a reference program, is optional);
- DeepCoder-style (``agentica-org/DeepCoder-Preview-Dataset``): ``{"problem", "tests"}`` where ``tests`` is a
  list (or its JSON string) of ``{"input", "output", "testtype": "stdin" | "functional"}`` (primeintellect:
  ``"type": "stdin_stdout" | "function_call"``) or a TACO dict ``{"inputs", "outputs", "fn_name"?}``. Only
  stdin/stdout problems are kept; functional ones are skipped.

Reward (cookbook §7), from the last assistant message: 1 when its last ```python block passes every test,
0 when it fails one, -0.1 when it has no code block (``format_coef · (has_code - 1) + correct``). Before
answering the model may call ``check_solution(code)``, which runs a program against the same tests and
returns ``{"passed", "tests_passed", "test_count", "details"}``, with the input, expected and actual output
of the first failing test, as a judge would show them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..chat import ChatRenderer, Tool
from ..errors import InvalidInputError
from ..rl.tool_env import ToolEnv
from ..rl.types import Env, EnvGroupBuilder
from ..runs.jsonl import refuse
from ..sandbox import Sandbox, TestCase, TestReport
from .rows import RowError, check_limit, load_rows, need

__all__ = [
    "CodeProblem",
    "INSTRUCTIONS",
    "load",
    "parse_row",
    "extract_code",
    "grade",
    "check_solution_tool",
    "CodeGroupBuilder",
]

INSTRUCTIONS = (
    "Solve the programming problem in Python 3. The program reads standard input and writes standard output. "
    "Give your final program in one ```python code block. Before answering you may call check_solution once "
    "to run a program against the problem's tests."
)
_CODE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.S)
_SHOW = 300  # characters of input/output shown per failing test


@dataclass(frozen=True)
class CodeProblem:
    id: str
    question: str
    tests: tuple[TestCase, ...]
    solution: str | None = None

    def messages(self, instructions: str = INSTRUCTIONS) -> list[dict[str, str]]:
        return [{"role": "system", "content": instructions}, {"role": "user", "content": self.question}]


FIX = (
    'use one problem per line: {"question": "...", "tests": [{"input": "...", "output": "..."}]} '
    '(or DeepCoder\'s {"problem": "...", "tests": [...]}, see asyncsess.tasks.code)'
)


def _test(t: Any, at: str) -> TestCase:
    return TestCase(stdin=need(t, "input", str, "a string", at), expected_stdout=need(t, "output", str, "a string", at))


def _stdio_tests(raw: Any) -> list[TestCase] | None:
    """Tests of a DeepCoder-style row as TestCases, or ``None`` when they are not stdin/stdout tests."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError) as err:
            raise RowError("tests", f"tests is a string but not JSON ({str(err)[:80]})") from None
    if isinstance(raw, dict):  # TACO
        if "fn_name" in raw:
            return None
        inputs = need(raw, "inputs", list, "a list", "tests")
        outputs = need(raw, "outputs", list, "a list", "tests")
        if len(inputs) != len(outputs):
            raise RowError("tests.outputs", f"tests holds {len(inputs)} inputs and {len(outputs)} outputs; give one output per input")
        return [TestCase(stdin=str(i), expected_stdout=str(o)) for i, o in zip(inputs, outputs)]
    if not isinstance(raw, list):
        raise RowError("tests", f"tests is {raw!r:.60}, not a list of tests (or its JSON string, or a TACO dict)")
    out = []
    for k, t in enumerate(raw):
        if not isinstance(t, dict):
            raise RowError(f"tests.{k}", f"tests.{k} is {t!r:.60}, not a test object")
        kind = t.get("testtype", t.get("type", "stdin"))
        if kind not in ("stdin", "stdin_stdout") or not isinstance(t.get("input"), str):
            return None
        out.append(TestCase(stdin=t["input"], expected_stdout=str(need(t, "output", object, "an output", f"tests.{k}"))))
    return out


def parse_row(row: Mapping[str, Any], index: int = 0) -> CodeProblem | None:
    """One JSONL row of either format, or ``None`` for a problem without stdin/stdout tests; a row of neither format,
    or a broken one, is a :class:`~asyncsess.tasks.rows.RowError` naming its key."""
    row = dict(row)
    if "question" in row:
        question = need(row, "question", str, "a string")
        tests = [_test(t, f"tests.{k}") for k, t in enumerate(need(row, "tests", list, "a list of {input, output} tests"))]
        solution = need(row, "solution", str, "a string (a reference program)") if row.get("solution") is not None else None
        if not tests:
            raise RowError("tests", "tests is empty: a problem needs at least one test")
    elif "problem" in row:
        question, solution = need(row, "problem", str, "a string"), None
        tests = _stdio_tests(need(row, "tests", (list, str, dict), "a list of tests (or its JSON string, or a TACO dict)")) or []
    else:
        raise RowError("question", 'the row has neither "question" (bundled format) nor "problem" (DeepCoder)')
    if not tests:
        return None
    return CodeProblem(str(row.get("id", index)), question.strip(), tuple(tests), solution)


def load(path: str | Path, limit: int | None = None) -> list[CodeProblem]:
    """Problems from a JSONL file of either format (see the module docstring). A file that is not one problem per line,
    or whose problems have no stdin/stdout tests, is an InvalidInputError naming the file, the line and the key."""
    check_limit(limit)
    problems = load_rows(path, parse_row, FIX)
    if not problems:
        raise refuse(Path(path), None, None, "holds no problem with stdin/stdout tests (functional ones are skipped)", FIX)
    return problems[:limit] if limit is not None else problems


def extract_code(text: str) -> str | None:
    """The last fenced code block of a reply (```python, ```py or plain ```), or ``None``."""
    blocks = _CODE.findall(text)
    return blocks[-1] if blocks else None


def _verdict(tests: Sequence[TestCase], report: TestReport) -> dict[str, Any]:
    details: list[dict[str, Any]] = []
    shown = False
    for i, (test, tr) in enumerate(zip(tests, report.results)):
        status = "passed" if tr.passed else "wrong_answer" if tr.result.ok else tr.result.status
        entry: dict[str, Any] = {"test": i, "status": status}
        if not tr.passed and not shown:
            shown = True
            entry.update(
                input=test.stdin[:_SHOW],
                expected=test.expected_stdout[:_SHOW],
                got=tr.result.stdout[:_SHOW],
                stderr=tr.result.stderr[-_SHOW:],
            )
        details.append(entry)
    return {"passed": report.all_passed, "tests_passed": report.passed, "test_count": report.total, "details": details}


async def _run_tests(problem: CodeProblem, code: str, sandbox: Sandbox, timeout_s: float | None) -> TestReport | InvalidInputError:
    """The program's report over the problem's tests, or why the program cannot run at all (its text: a lone
    surrogate, say); any other bad input (the problem's, the limits) is raised."""
    try:
        return await sandbox.run_tests(code, list(problem.tests), timeout_s=timeout_s)
    except InvalidInputError as err:
        if err.field != "code":
            raise
        return err


async def grade(
    problem: CodeProblem, reply: str, sandbox: Sandbox, timeout_s: float | None = None, format_coef: float = 0.1
) -> tuple[float, dict[str, float]]:
    """The episode's reward from the last assistant message, with ``correct``, ``format``, ``tests_passed``
    (share of tests) and ``sandbox_errors`` (runs whose verdict is unknown, counted as failures). A program the
    sandbox cannot take (a lone surrogate in its text, or too large for it) fails every test."""
    code = extract_code(reply)
    if code is None:
        return -format_coef, {"correct": 0.0, "format": 0.0, "tests_passed": 0.0, "sandbox_errors": 0.0}
    report = await _run_tests(problem, code, sandbox, timeout_s)
    if isinstance(report, InvalidInputError):  # a program that cannot run fails every test
        return 0.0, {"correct": 0.0, "format": 1.0, "tests_passed": 0.0, "sandbox_errors": 0.0}
    correct = float(report.all_passed)
    errors = sum(r.result.status == "sandbox_error" for r in report.results)
    return correct, {"correct": correct, "format": 1.0, "tests_passed": report.passed / report.total, "sandbox_errors": float(errors)}


def check_solution_tool(problem: CodeProblem, sandbox: Sandbox, timeout_s: float | None = None, max_checks: int | None = None) -> Tool:
    """``check_solution(code)``: run a program against the problem's tests; metrics ``check/tests_passed``, ``check/test_count``.
    After ``max_checks`` programs (``None``: no limit) a call runs nothing and answers ``{"error": ...}``: the
    verdicts come from the tests the final answer is graded on, so a model checking many candidates would pick the one
    that passes them."""
    checks = 0

    async def run(arguments: Mapping[str, Any]) -> tuple[str, dict[str, float]]:
        nonlocal checks
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return json.dumps({"error": 'check_solution needs {"code": "<python program>"}'}), {}
        if max_checks is not None and checks >= max_checks:
            return json.dumps({"error": f"check_solution may be called {max_checks} time(s); give your final program"}), {}
        checks += 1
        report = await _run_tests(problem, code, sandbox, timeout_s)
        if isinstance(report, InvalidInputError):  # e.g. a lone surrogate the model wrote as a JSON escape
            return json.dumps({"error": f"the program cannot be run: {report}"}), {}
        return json.dumps(_verdict(problem.tests, report)), {
            "check/tests_passed": float(report.passed),
            "check/test_count": float(report.total),
        }

    return Tool(
        name="check_solution",
        description="Run a Python 3 program against this problem's tests and report which pass.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the whole program"}},
            "required": ["code"],
        },
        run=run,
    )


@dataclass
class CodeGroupBuilder(EnvGroupBuilder):
    """``group_size`` two-turn (by default) episodes on one problem, sharing a renderer and a sandbox; each episode may
    run ``check_solution`` ``max_checks`` times (calls past that, in one reply or later ones, run nothing)."""

    problem: CodeProblem
    renderer: ChatRenderer
    sandbox: Sandbox
    group_size: int
    max_turns: int = 2
    timeout_s: float | None = None
    max_trajectory_tokens: int | None = None
    instructions: str = INSTRUCTIONS
    format_coef: float = 0.1
    max_checks: int = 1

    async def make_envs(self) -> Sequence[Env]:
        async def final(reply: str) -> tuple[float, dict[str, float]]:
            return await grade(self.problem, reply, self.sandbox, self.timeout_s, self.format_coef)

        return [
            ToolEnv(
                self.renderer,
                self.problem.messages(self.instructions),
                [check_solution_tool(self.problem, self.sandbox, self.timeout_s, self.max_checks)],
                final,
                max_turns=self.max_turns,
                max_trajectory_tokens=self.max_trajectory_tokens,
                overflow_reward=-self.format_coef,
                grader_timeout_s=None,  # the sandbox bounds each test run (timeout_s)
            )
            for _ in range(self.group_size)
        ]
