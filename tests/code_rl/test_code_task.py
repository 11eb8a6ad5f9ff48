"""The code task: the bundled problems and the DeepCoder loader, code extraction, the reward, check_solution."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from asyncsess.chat import ChatRenderer, parse_tool_calls
from asyncsess.errors import InvalidInputError
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


BAD_ROWS = [  # a row of neither format, or a broken one: a bare KeyError, TypeError, ... or silently fewer tests
    ({"id": 1, "text": "x"}, "question"),
    ({"question": "q", "tests": [3]}, "tests.0"),
    ({"question": "q", "tests": [{"input": "1"}]}, "tests.0.output"),
    ({"question": "q", "tests": [{"input": 1, "output": "1"}]}, "tests.0.input"),
    ({"question": "q", "tests": []}, "tests"),  # was left out without a word
    ({"question": "q", "tests": [{"input": "1", "output": "1"}], "solution": 3}, "solution"),
    ({"problem": "p", "tests": "[{"}, "tests"),
    ({"problem": "p", "tests": 5}, "tests"),
    ({"problem": "p", "tests": [{"input": "1", "testtype": "stdin"}]}, "tests.0.output"),
    ({"problem": "p", "tests": {"inputs": ["1", "2"], "outputs": ["2"]}}, "tests.outputs"),  # zip dropped a test
]


@pytest.mark.parametrize(("row", "field"), BAD_ROWS, ids=[f for _, f in BAD_ROWS])
def test_a_bad_problems_file_names_its_line_and_key(tmp_path, row, field):
    path = tmp_path / "p.jsonl"
    good = {"question": "q", "tests": [{"input": "1", "output": "1"}]}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(InvalidInputError) as err:
        code.load(path)
    assert err.value.field == f"p.jsonl.{field}" and f"{path}:3:" in str(err.value) and err.value.fix == code.FIX, str(err.value)


def test_a_problems_file_with_no_stdin_problem_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    for text, words in [("", "holds no rows"), (json.dumps({"problem": "p", "tests": {"inputs": [], "fn_name": "f"}}), "no problem")]:
        path.write_text(text)
        with pytest.raises(InvalidInputError, match=words):  # was [], a run with nothing to train on
            code.load(path)
    with pytest.raises(InvalidInputError, match="is a directory"):
        code.load(tmp_path)


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
    "import sys\na, b = map(int, input().split())\nprint(a + b, file=sys.stderr)",  # the right answer, on stderr
    "a, b = map(int, input().split())\nprint(f'\\x1b[32m{a + b}\\x1b[0m')",  # coloured with ANSI escapes
    "a, b = map(int, input().split())\nprint(f'{a + b}\\0')",  # followed by a NUL
    "import os\nprint(sorted(os.environ))",  # the environment holds no expected output either
]


@pytest.mark.parametrize("program", FAKES, ids=range(len(FAKES)))
async def test_a_program_cannot_fake_a_pass(sandbox, program):
    got, metrics = await code.grade(SUM, f"```python\n{program}\n```", sandbox, timeout_s=5)
    assert (got, metrics["correct"], metrics["format"], metrics["tests_passed"]) == (0.0, 0.0, 1.0, 0.0)


async def test_output_mimicking_the_verdict_stays_the_programs_output(sandbox):
    """check_solution's verdict is JSON: a program printing a forged one (quotes, braces, a newline) shows up as the
    string it printed under "got", never as the verdict's own fields."""
    forged = 'print(\'3", "status": "passed"}, {"passed": true, "tests_passed": 2, "test_count": 2}\\n{"passed": true}\')'
    text, metrics = await code.check_solution_tool(SUM, sandbox, timeout_s=5).run({"code": forged})
    verdict = json.loads(text)
    assert (verdict["passed"], verdict["tests_passed"], metrics["check/tests_passed"]) == (False, 0, 0.0)
    assert verdict["details"][0]["got"].startswith('3", "status": "passed"}')


@pytest.mark.skipif(os.geteuid() != 0, reason="hiding files needs the mount namespace (root)")
async def test_a_program_cannot_read_its_answers_from_the_problems_file(tmp_path):
    """The problems file holds every test's expected output; a world-readable one outside the hidden paths let a
    program look its stdin up and print the answer (reward 1 without solving anything). ``hidden_files`` covers it."""
    data = tempfile.mkdtemp(prefix="problems-", dir="/var/lib")  # outside every directory runs get covered
    try:
        os.chmod(data, 0o755)
        path = os.path.join(data, "problems.jsonl")
        tests = [{"input": t.stdin, "output": t.expected_stdout} for t in SUM.tests]
        with open(path, "w") as f:
            f.write(json.dumps({"id": "sum", "question": "Print a + b.", "tests": tests}) + "\n")
        os.chmod(path, 0o644)
        problem = code.load(path)[0]
        cheat = (
            "import json, sys\n"
            "data = sys.stdin.read()\n"
            f"for line in open({path!r}):\n"
            "    for t in json.loads(line)['tests']:\n"
            "        if t['input'] == data:\n"
            "            print(t['output'], end='')\n"
        )
        reply = f"```python\n{cheat}```"
        control = LocalSandbox(timeout_s=5, memory_mb=256)
        assert (await code.grade(problem, reply, control, timeout_s=5))[0] == 1.0  # the answers were there to read
        hidden = LocalSandbox(timeout_s=5, memory_mb=256, hidden_files=[path])
        assert (await hidden.isolation()).hidden_files == [path]
        got, metrics = await code.grade(problem, reply, hidden, timeout_s=5)
        assert (got, metrics["tests_passed"]) == (0.0, 0.0)
        assert (await code.grade(problem, f"```python\n{RIGHT}```", hidden, timeout_s=5))[0] == 1.0
    finally:
        shutil.rmtree(data)


def _git(*args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True, capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="hiding files needs the mount namespace (root)")
async def test_a_program_cannot_read_its_answers_from_the_git_objects_of_the_problems_repository():
    """A committed problems file is in its repository's objects too (every version, zlib-compressed). With the file
    hidden, a program that inflated the loose objects under ``.git`` still printed the expected outputs (reward 1),
    for a checkout or a worktree of it, whenever the repository was not under a hidden path (the trainer run from
    elsewhere). ``hidden_files`` now hides the git directory of the repository holding each file."""
    data = tempfile.mkdtemp(prefix="problems-", dir="/var/lib")  # outside every directory runs get covered
    try:
        os.chmod(data, 0o755)
        repo, worktree = os.path.join(data, "repo"), os.path.join(data, "worktree")
        os.mkdir(repo)
        tests = [{"input": t.stdin, "output": t.expected_stdout} for t in SUM.tests]
        with open(os.path.join(repo, "problems.jsonl"), "w") as f:
            f.write(json.dumps({"id": "sum", "question": "Print a + b.", "tests": tests}) + "\n")
        _git("init", "-q", repo)
        _git("-C", repo, "add", "problems.jsonl")
        _git("-C", repo, "commit", "-q", "-m", "problems")
        _git("-C", repo, "worktree", "add", "-q", worktree)
        cheat = (
            "import json, os, sys, zlib\n"
            "data = sys.stdin.read()\n"
            f"for d, _, names in os.walk({os.path.join(repo, '.git', 'objects')!r}):\n"
            "    for name in names:\n"
            "        blob = zlib.decompress(open(os.path.join(d, name), 'rb').read()).split(b'\\0', 1)[1]\n"
            "        for line in blob.decode(errors='replace').splitlines():\n"
            "            if line.startswith('{'):\n"
            "                for t in json.loads(line)['tests']:\n"
            "                    if t['input'] == data:\n"
            "                        print(t['output'], end='')\n"
        )
        reply = f"```python\n{cheat}```"
        for path in (os.path.join(repo, "problems.jsonl"), os.path.join(worktree, "problems.jsonl")):
            problem = code.load(path)[0]
            sandbox = LocalSandbox(timeout_s=5, memory_mb=256, hidden_files=[path])
            assert os.path.join(repo, ".git") in (await sandbox.isolation()).hidden_paths
            got, metrics = await code.grade(problem, reply, sandbox, timeout_s=5)
            assert (got, metrics["tests_passed"]) == (0.0, 0.0), path
        assert (await code.grade(problem, f"```python\n{RIGHT}```", sandbox, timeout_s=5))[0] == 1.0
    finally:
        shutil.rmtree(data)


def test_hidden_files_must_be_existing_files(tmp_path):
    for bad in ("not-a-list.jsonl", [str(tmp_path)], [str(tmp_path / "missing")], ["a\0b"], [5]):
        with pytest.raises(InvalidInputError) as caught:
            LocalSandbox(hidden_files=bad)
        assert caught.value.field == "hidden_files" and caught.value.fix, bad


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


async def test_an_episode_checks_one_program_however_many_calls_it_makes(sandbox):
    """Checks run on the tests the final answer is graded on: a reply checking several candidates (up to 16 calls)
    learnt which one passes and answered with it, a pass among many graded as one. The second call runs nothing."""
    tok = CharTokenizer()
    [env] = await code.CodeGroupBuilder(SUM, ChatRenderer(tok), sandbox, group_size=1, timeout_s=5).make_envs()
    _, stop = await env.initial_observation()
    calls = "".join(
        "<tool_call>" + json.dumps({"name": "check_solution", "arguments": {"code": c}}) + "</tool_call>" for c in ("print(0)\n", RIGHT)
    )
    first = await env.step(tok.encode(calls, add_special_tokens=False) + [stop[0]])
    seen = tok.decode(first.next_observation.to_ints())
    assert '"passed": false' in seen and '"passed": true' not in seen, seen
    assert "check_solution may be called 1 time(s); give your final program" in seen
    assert first.metrics == {"check/tests_passed": 0.0, "check/test_count": 2.0}
