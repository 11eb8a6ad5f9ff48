"""The code task: the bundled problems and the DeepCoder loader, code extraction, the reward, check_solution."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from asyncsess.chat import ChatRenderer, parse_tool_calls
from asyncsess.sandbox import LocalSandbox, TestCase
from asyncsess.tasks import code
from asyncsess_mock import CharTokenizer

pytestmark = pytest.mark.anyio
BUNDLED = Path(__file__).parents[2] / "examples" / "data" / "code_problems.jsonl"
SUM = code.CodeProblem(
    "sum", "Print a + b.", (TestCase(stdin="1 2\n", expected_stdout="3\n"), TestCase(stdin="5 5\n", expected_stdout="10\n"))
)
RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.fixture(scope="module")
def sandbox() -> LocalSandbox:
    return LocalSandbox(max_concurrency=4, timeout_s=5, memory_mb=256)


async def test_every_bundled_reference_solution_passes_its_tests(sandbox):
    problems = code.load(BUNDLED)
    assert len(problems) == 20 and len({p.id for p in problems}) == 20
    for p in problems:
        assert 3 <= len(p.tests) <= 5 and p.question.isascii() and p.solution
        report = await sandbox.run_tests(p.solution, list(p.tests))
        assert report.all_passed, (p.id, report)
        assert not (await sandbox.run_tests("print(0)\n", list(p.tests))).all_passed, p.id


def test_deepcoder_rows_keep_stdin_stdout_problems(tmp_path):
    rows = [
        {"problem": "lcb stdin", "tests": json.dumps([{"input": "1\n", "output": "2\n", "testtype": "stdin", "metadata": {}}])},
        {"problem": "lcb functional", "tests": json.dumps([{"input": "[1]", "output": "2", "testtype": "functional"}])},
        {"problem": "primeintellect", "tests": [{"input": "3\n", "output": "4\n", "type": "stdin_stdout"}]},
        {"problem": "primeintellect fn", "tests": [{"input": [3], "output": [4], "type": "function_call", "fn_name": "f"}]},
        {"problem": "taco stdio", "tests": json.dumps({"inputs": ["5\n", "6\n"], "outputs": ["6\n", "7\n"]})},
        {"problem": "taco fn", "tests": json.dumps({"inputs": [[1]], "outputs": [[2]], "fn_name": "f"})},
        {"problem": "no tests", "tests": "[]"},
    ]
    path = tmp_path / "deepcoder.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = code.load(path)
    assert [(p.id, p.question) for p in problems] == [("0", "lcb stdin"), ("2", "primeintellect"), ("4", "taco stdio")]
    assert problems[2].tests == (TestCase(stdin="5\n", expected_stdout="6\n"), TestCase(stdin="6\n", expected_stdout="7\n"))
    assert code.load(path, limit=1) == problems[:1]


def test_extract_code_takes_the_last_block():
    assert code.extract_code("no code") is None
    assert code.extract_code("```python\nprint(1)\n```") == "print(1)\n"
    assert code.extract_code("```py\nx\n``` then ```\nprint(2)\n```") == "print(2)\n"
    assert code.extract_code("```python\nunclosed") is None


@pytest.mark.parametrize(
    ("reply", "reward", "correct", "format_"),
    [
        (f"```python\n{RIGHT}```", 1.0, 1.0, 1.0),
        ("```python\nprint(3)\n```", 0.0, 0.0, 1.0),  # passes one test of two
        ("I cannot solve it.", -0.1, 0.0, 0.0),
    ],
)
async def test_reward(sandbox, reply, reward, correct, format_):
    got, metrics = await code.grade(SUM, reply, sandbox, timeout_s=5)
    assert got == reward and metrics["correct"] == correct and metrics["format"] == format_


FAKES = [  # programs that try to pass without computing a + b; the grader compares each test's stdout, nothing else
    "print('All tests passed')",
    "import os\nos._exit(0)",
    "import sys\nsys.exit(0)",
    "import builtins\nbuiltins.print = lambda *a, **k: None\ntry:\n    raise SystemExit(1)\nexcept SystemExit:\n    pass",
    "print('3\\n10')",  # every test's answer at once
    "import sys\nsys.stdout.buffer.write(b'3\\xff\\n')",  # not UTF-8
    "print(open('/proc/self/cmdline').read())",  # the grader's arguments hold no expected output
]


@pytest.mark.parametrize("program", FAKES, ids=range(len(FAKES)))
async def test_a_program_cannot_fake_a_pass(sandbox, program):
    got, metrics = await code.grade(SUM, f"```python\n{program}\n```", sandbox, timeout_s=5)
    assert (got, metrics["correct"], metrics["format"], metrics["tests_passed"]) == (0.0, 0.0, 1.0, 0.0)


async def test_a_program_that_cannot_run_is_graded_as_failing_not_raised(sandbox):
    # a reply holding a lone surrogate (a custom decoder's, or an env's own text): reward 0 like any failing program
    got, metrics = await code.grade(SUM, "```python\nprint('\ud800')\n```", sandbox, timeout_s=5)
    assert got == 0.0 and metrics == {"correct": 0.0, "format": 1.0, "tests_passed": 0.0, "sandbox_errors": 0.0}
    # a program larger than the sandbox's working directory: the same, and check_solution says so
    small = LocalSandbox(timeout_s=5, memory_mb=256, workdir_mb=1)
    big = "print(3)\n" + "#" * (1 << 20) + "\n"
    got, metrics = await code.grade(SUM, f"```python\n{big}```", small, timeout_s=5)
    assert got == 0.0 and metrics["correct"] == 0.0 and metrics["format"] == 1.0
    text, _ = await code.check_solution_tool(SUM, small, timeout_s=5).run({"code": big})
    assert json.loads(text)["error"].startswith("the program cannot be run: code:")


async def test_a_sandbox_that_cannot_start_runs_scores_zero_and_says_so(tmp_path):
    """A host-side failure to start the program (here its interpreter is gone) is a ``sandbox_error`` per test, not
    an exception out of the grader: reward 0, counted in ``sandbox_errors``."""
    link = tmp_path / "python"
    link.symlink_to(os.path.realpath(sys.executable))
    broken = LocalSandbox(python=str(link), timeout_s=5, memory_mb=256, namespaces=False)
    link.unlink()
    got, metrics = await code.grade(SUM, f"```python\n{RIGHT}```", broken, timeout_s=5)
    assert got == 0.0 and metrics == {"correct": 0.0, "format": 1.0, "tests_passed": 0.0, "sandbox_errors": 2.0}


async def test_check_solution_reports_the_first_failing_test(sandbox):
    tool = code.check_solution_tool(SUM, sandbox, timeout_s=5)
    assert tool.schema()["function"]["name"] == "check_solution"
    text, metrics = await tool.run({"code": "print(3)\n"})
    verdict = json.loads(text)
    assert verdict["passed"] is False and (verdict["tests_passed"], verdict["test_count"]) == (1, 2)
    assert verdict["details"] == [
        {"test": 0, "status": "passed"},
        {"test": 1, "status": "wrong_answer", "input": "5 5\n", "expected": "10\n", "got": "3\n", "stderr": ""},
    ]
    assert metrics == {"check/tests_passed": 1.0, "check/test_count": 2.0}
    crash = json.loads((await tool.run({"code": "raise SystemExit(3)"}))[0])
    assert crash["details"][0]["status"] == "runtime_error" and crash["details"][1] == {"test": 1, "status": "runtime_error"}
    assert json.loads((await tool.run({}))[0]) == {"error": 'check_solution needs {"code": "<python program>"}'}
    # a model's call whose JSON escapes decode to a lone surrogate: a tool error, not an exception that ends the run
    [call], _ = parse_tool_calls('<tool_call>{"name": "check_solution", "arguments": {"code": "print(\'\\ud800\')"}}</tool_call>')
    text, metrics = await tool.run(call.arguments)
    assert json.loads(text)["error"].startswith("the program cannot be run: code: not encodable as UTF-8") and metrics == {}


async def test_a_code_episode_with_a_check_then_an_answer(sandbox):
    tok = CharTokenizer()
    builder = code.CodeGroupBuilder(SUM, ChatRenderer(tok), sandbox, group_size=2, timeout_s=5)
    envs = await builder.make_envs()
    assert len(envs) == 2
    ob, stop = await envs[0].initial_observation()
    text = tok.decode(ob.to_ints())
    assert (
        text.startswith("<|bos|><|system|>" + code.INSTRUCTIONS)
        and '"name": "check_solution"' in text
        and "<|user|>Print a + b.<|end|>" in text
    )
    call = "<tool_call>" + json.dumps({"name": "check_solution", "arguments": {"code": RIGHT}}) + "</tool_call>"
    first = await envs[0].step(tok.encode(call, add_special_tokens=False) + [stop[0]])
    assert not first.episode_done and '"passed": true' in tok.decode(first.next_observation.to_ints())
    last = await envs[0].step(tok.encode(f"```python\n{RIGHT}```", add_special_tokens=False) + [stop[0]])
    assert last.episode_done and last.reward == 1.0 and last.metrics["tool_calls"] == 1.0
