"""LocalSandbox verdicts on known programs, limits, files, concurrency and cleanup."""

from __future__ import annotations

import glob
import grp
import math
import os
import pwd
import resource
import sys
import tempfile
from types import SimpleNamespace

import anyio
import pytest

from asyncsess.errors import InvalidInputError
from asyncsess.sandbox import Sandbox, TestCase
from asyncsess.sandbox.results import ExecutionResult

from .conftest import ROOT, TEST_UIDS, assert_healthy, cgroup_leaves, root_only

pytestmark = pytest.mark.anyio

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_TESTS = [
    TestCase(stdin="1 2\n", expected_stdout="3\n"),
    TestCase(stdin="10 -4\n", expected_stdout="6"),
    TestCase(stdin="0 0", expected_stdout="0\n"),
]


async def test_known_programs_get_the_right_status(make_sandbox):
    sandbox = make_sandbox(timeout_s=2.0)
    assert isinstance(sandbox, Sandbox)
    cases = {
        "print(input()[::-1])": ("ok", 0),
        "import sys\nsys.exit(3)": ("runtime_error", 3),
        "import sys\nsys.exit(100)": ("runtime_error", 100),  # any exit status is the program's own, not "memory"
        "raise ValueError('boom')": ("runtime_error", 1),
        "def broken(:\n  pass": ("runtime_error", 1),
        "while True:\n    pass": ("timeout", None),
        "import time\ntime.sleep(60)": ("timeout", None),
        "x = bytearray(1 << 30)": ("memory", None),
    }
    for code, (status, exit_code) in cases.items():
        result = await sandbox.run(code, stdin="abc\n")
        assert result.status == status, (code, result)
        if exit_code is not None:
            assert result.exit_code == exit_code, (code, result)
    ok = await sandbox.run("print(input()[::-1])", stdin="abc\n")
    assert ok.stdout == "cba\n" and ok.stderr == "" and ok.cpu_s is not None and ok.wall_s > 0
    err = await sandbox.run("raise ValueError('boom')")
    assert "ValueError: boom" in err.stderr and "solution.py" in err.stderr and "_bootstrap" not in err.stderr


async def test_signals_a_program_sends_itself_end_it_as_usual(make_sandbox):
    """With a PID namespace the program is not its init, so it has no init's immunity to its own signals."""
    sandbox = make_sandbox()
    cases = {
        "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nprint('alive')": -15,
        "import signal\nsignal.raise_signal(signal.SIGKILL)\nprint('alive')": -9,
        "import os\nos.abort()": -6,
    }
    for code, exit_code in cases.items():
        result = await sandbox.run(code)
        assert (result.status, result.exit_code, result.stdout) == ("runtime_error", exit_code, ""), (code, result)


async def test_run_tests_verdicts_pass_fail_and_timeout(make_sandbox):
    sandbox = make_sandbox(timeout_s=1.5)
    passing = await sandbox.run_tests(ADD, ADD_TESTS)
    assert passing.all_passed and (passing.passed, passing.total) == (3, 3)

    wrong = await sandbox.run_tests("a, b = map(int, input().split())\nprint(a - b)\n", ADD_TESTS)
    assert (wrong.passed, wrong.all_passed) == (1, False)  # only 0 0 agrees
    assert [r.passed for r in wrong.results] == [False, False, True]

    slow = await sandbox.run_tests("import time\nif input() == '1 2':\n    time.sleep(30)\nprint(6)", ADD_TESTS[:2])
    assert [r.result.status for r in slow.results] == ["timeout", "ok"]
    assert [r.passed for r in slow.results] == [False, True] and not slow.all_passed

    crashing = await sandbox.run_tests("print(3)\nraise SystemExit(1)", ADD_TESTS[:1])
    assert crashing.results[0].result.stdout == "3\n" and not crashing.all_passed  # right output, failing exit


async def test_memory_limit_holds_for_gradual_growth(make_sandbox):
    sandbox = make_sandbox(memory_mb=128)
    result = await sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))")
    assert result.status == "memory" and "MemoryError" in result.stderr
    small = await sandbox.run("x = bytearray(64 << 20)\nprint(len(x))")
    assert (small.status, small.stdout) == ("ok", f"{64 << 20}\n")
    await assert_healthy(sandbox)


async def test_cpu_bound_program_is_stopped_by_the_limits(make_sandbox):
    sandbox = make_sandbox(timeout_s=1.0)
    result = await sandbox.run("n = 0\nwhile True:\n    n += 1")
    assert result.status == "timeout" and result.exit_code is not None and result.exit_code < 0
    assert result.cpu_s is not None and result.cpu_s > 0  # it did burn CPU until stopped (how much: load-dependent)


async def test_rlimits_are_set_in_the_program(make_sandbox):
    sandbox = make_sandbox(timeout_s=2.5, memory_mb=300, max_processes=12, workdir_mb=20)
    code = (
        "import resource as r\n"
        "for name in ('RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_NPROC', 'RLIMIT_FSIZE', 'RLIMIT_CORE', 'RLIMIT_RTPRIO', 'RLIMIT_NICE'):\n"
        "    print(name, *r.getrlimit(getattr(r, name)))\n"
    )
    result = await sandbox.run(code)
    assert result.status == "ok", result
    limits = {line.split()[0]: tuple(map(int, line.split()[1:])) for line in result.stdout.splitlines()}
    cpu = math.ceil(2.5)
    assert limits["RLIMIT_CPU"] == (cpu, cpu + 1)
    assert limits["RLIMIT_AS"] == (300 << 20, 300 << 20)
    assert limits["RLIMIT_FSIZE"] == (20 << 20, 20 << 20)
    assert limits["RLIMIT_CORE"] == (1, 1)  # no core for any core_pattern (test_sandbox_escapes)
    assert limits["RLIMIT_RTPRIO"] == limits["RLIMIT_NICE"] == (0, 0)  # (see the next test)
    if ROOT:  # as a normal user the limit is capped by the user's own hard limit
        assert limits["RLIMIT_NPROC"] == (12, 12)


def test_the_program_gets_no_real_time_or_raised_priority_whatever_the_host_allows(monkeypatch):
    """RLIMIT_RTPRIO and RLIMIT_NICE were the host's: where root's allow them (``ulimit -r``/``-e``, a container
    started with ``--ulimit rtprio=99``), a program took SCHED_FIFO and spun past cpu.max and every other process on
    its CPU. The bootstrap sets both to 0. (No process here may raise its hard limits, so the host is stubbed.)"""
    from asyncsess.sandbox import _bootstrap

    set_to: dict[int, tuple[int, int]] = {}
    host = {name: getattr(resource, name) for name in dir(resource) if name.startswith("RLIM")}
    host.update(getrlimit=lambda kind: (resource.RLIM_INFINITY,) * 2, setrlimit=lambda kind, value: set_to.update({kind: value}))
    monkeypatch.setattr(_bootstrap, "resource", SimpleNamespace(**host))
    monkeypatch.setattr(_bootstrap, "_libc", SimpleNamespace(mallopt=lambda *args: 1))
    _bootstrap._set_limits({"memory_mb": 256, "max_processes": 8, "workdir_mb": 16, "cpu_s": 2})
    assert set_to[resource.RLIMIT_RTPRIO] == set_to[resource.RLIMIT_NICE] == (0, 0), set_to


async def test_huge_output_is_capped(make_sandbox):
    sandbox = make_sandbox(max_output_bytes=10_000)
    result = await sandbox.run("while True:\n    print('x' * 999)")
    assert result.status == "output_limit"
    assert len(result.stdout) == 10_000 and set(result.stdout) <= {"x", "\n"}
    flood = await sandbox.run("import sys\nwhile True:\n    sys.stderr.write('e' * 4096)")
    assert flood.status == "output_limit" and len(flood.stderr) == 10_000
    under = await sandbox.run("print('y' * 5000)")
    assert (under.status, len(under.stdout)) == ("ok", 5001)
    await assert_healthy(sandbox)


async def test_output_that_is_not_utf8_or_a_closed_stdout_gets_a_typed_result(make_sandbox):
    sandbox = make_sandbox(timeout_s=2.0)
    code = (
        "import sys\n"
        "sys.stdout.buffer.write(b'\\xff\\xed\\xa0\\x80 bytes\\n')\n"  # not UTF-8; a UTF-8-encoded surrogate
        "sys.stdout.flush()\n"
        "sys.stderr.reconfigure(errors='surrogatepass')\n"
        "print('\\ud800 lone', file=sys.stderr)\n"
    )
    result = await sandbox.run(code)
    assert result.status == "ok" and result.stdout.endswith(" bytes\n") and result.stderr.endswith(" lone\n"), result
    assert "\ufffd" in result.stdout and "\ufffd" in result.stderr
    assert ExecutionResult.model_validate_json(result.model_dump_json()) == result  # valid text all the way
    report = await sandbox.run_tests(code, [TestCase(expected_stdout=" bytes\n")])
    assert (report.passed, report.total) == (0, 1)
    for code, status in (
        ("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", "timeout"),
        ("import os\nos.close(0)\nos.close(1)\nos.close(2)", "ok"),
        ("import sys\nsys.stdout.close()\nprint('x')", "runtime_error"),
    ):
        closed = await sandbox.run(code, stdin="x" * (1 << 20))
        assert (closed.status, closed.stdout) == (status, ""), (code, closed)
    await assert_healthy(sandbox)


async def test_large_stdin_and_output_round_trip(make_sandbox):
    sandbox = make_sandbox()
    data = "".join(f"{i}\n" for i in range(100_000))  # ~600 kB, far beyond a pipe buffer
    result = await sandbox.run("import sys\ntotal = sum(int(line) for line in sys.stdin)\nprint(total)", stdin=data)
    assert (result.status, result.stdout) == ("ok", f"{sum(range(100_000))}\n")
    echo = await sandbox.run("import sys\nsys.stdout.write(sys.stdin.read())", stdin=data)
    assert echo.status == "ok" and echo.stdout == data


async def test_files_are_placed_in_the_private_working_directory(make_sandbox):
    sandbox = make_sandbox()
    code = (
        "import os, helper\n"
        "print(open('data/in.txt').read().strip(), helper.VALUE, open('blob.bin', 'rb').read())\n"
        "open('scratch.txt', 'w').write('mine')\n"
        "print(open('scratch.txt').read(), os.getcwd())\n"
    )
    files = {"data/in.txt": "42\n", "helper.py": "VALUE = 'h'\n", "blob.bin": b"\x00\x01"}
    result = await sandbox.run(code, files=files)
    assert result.status == "ok", result
    first, second = result.stdout.splitlines()
    assert first == "42 h b'\\x00\\x01'"
    word, cwd = second.split()
    assert word == "mine" and os.path.basename(cwd).startswith("asyncsess-sandbox-")
    assert not os.path.exists(cwd)  # deleted after the run
    with pytest.raises(InvalidInputError, match="files"):
        await sandbox.run("pass", files={"../evil.py": "x"})
    with pytest.raises(InvalidInputError, match="files"):
        await sandbox.run("pass", files={"/etc/evil": "x"})


async def test_fifty_executions_in_parallel_complete(make_sandbox):
    sandbox = make_sandbox(max_concurrency=8)
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        results[i] = await sandbox.run("n = int(input())\nprint(n * n)", stdin=f"{i}\n")

    async with anyio.create_task_group() as tg:
        for i in range(50):
            tg.start_soon(one, i)
    assert len(results) == 50
    for i, result in results.items():
        assert (result.status, result.stdout) == ("ok", f"{i * i}\n"), (i, result)


async def test_concurrency_is_bounded_by_max_concurrency(make_sandbox):
    sandbox = make_sandbox(max_concurrency=3)
    code = "import time\nprint(time.time())\ntime.sleep(0.4)\nprint(time.time())"
    spans = []

    async def one() -> None:
        result = await sandbox.run(code)
        assert result.status == "ok", result
        start, end = map(float, result.stdout.split())
        spans.append((start, end))

    async with anyio.create_task_group() as tg:
        for _ in range(9):
            tg.start_soon(one)
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert 2 <= most <= 3  # runs overlap, but never more than the limit


@pytest.mark.parametrize("loops", [("asyncio", "asyncio"), ("asyncio", "trio"), ("trio", "asyncio")])
def test_one_sandbox_serves_event_loops_one_after_another(make_sandbox, monkeypatch, loops):
    """The limit holds in each of two event loops run one after the other (the sync facade's, a test's), whatever
    their backends; the limiter used to belong to the first loop's backend. No program runs: ``_execute`` is a
    stand-in that records how many runs are inside the limit at once."""
    sandbox = make_sandbox(max_concurrency=2, namespaces=False, cgroups=False)
    inside: list[int] = []
    peaks: list[int] = []

    async def execute(*args):
        inside.append(1)
        peaks.append(len(inside))
        await anyio.sleep(0.01)
        inside.pop()
        return ExecutionResult(status="ok", stdout="done\n")

    monkeypatch.setattr(sandbox, "_execute", execute)

    async def five_at_once() -> list[str]:
        out: list[str] = []

        async def one() -> None:
            out.append((await sandbox.run("print('done')")).stdout)

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(one)
        return out

    for backend in loops:
        peaks.clear()
        assert anyio.run(five_at_once, backend=backend) == ["done\n"] * 5
        assert max(peaks) == 2 and len(peaks) == 5, (backend, peaks)


async def test_cancelled_run_is_cleaned_up(make_sandbox):
    sandbox = make_sandbox()
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '300'])\nprint('started', flush=True)\ntime.sleep(300)"
    with anyio.move_on_after(1.0) as scope:
        await sandbox.run(code)
    assert scope.cancelled_caught
    await assert_healthy(sandbox)  # and the fixture checks that nothing of the run is left


async def test_invalid_limits_are_rejected(make_sandbox):
    with pytest.raises(InvalidInputError, match="timeout_s"):
        make_sandbox(timeout_s=0)
    sandbox = make_sandbox()
    with pytest.raises(InvalidInputError, match="memory_mb"):
        await sandbox.run("pass", memory_mb=-1)
    bad = {
        "timeout_s": [math.inf, math.nan, -0.0, 1e308, "5", True, None],
        "memory_mb": [math.inf, math.nan, 1.5, 10**30, -(2**63), True, "64"],
        "max_processes": [0, 2**64, 8.0],
        "cpus": [math.nan, math.inf, 0],
    }
    for field, values in bad.items():
        for value in values:
            with pytest.raises(InvalidInputError) as caught:
                make_sandbox(**{field: value})
            assert caught.value.field == field, (field, value)
    for field in ("timeout_s", "memory_mb"):
        for value in bad[field]:
            if value is None:  # None means the sandbox's default in run()
                continue
            with pytest.raises(InvalidInputError) as caught:
                await sandbox.run("pass", **{field: value})
            assert caught.value.field == field, (field, value)
    # subnormal but positive: a valid limit, usually over before the program starts (then its verdict is unknown)
    uid = TEST_UIDS[-10]  # a uid of its own: other tests retire some of the last ones on purpose
    one_uid = make_sandbox(uids=range(uid, uid + 1))
    for _ in range(3):
        tiny = await one_uid.run("while True:\n    pass", timeout_s=5e-324)
        assert tiny.status in ("timeout", "sandbox_error"), tiny
    await assert_healthy(one_uid)  # and its one uid was not retired


async def test_code_too_big_for_the_working_directory_is_one_typed_error(make_sandbox, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a private temp dir, to see every leftover
    sandbox = make_sandbox(workdir_mb=1)
    big = "x = 1\n" + "#" * (1 << 20)
    with pytest.raises(InvalidInputError) as caught:
        await sandbox.run(big)
    assert caught.value.field == "code" and "1 MiB" in str(caught.value) and caught.value.fix
    with pytest.raises(InvalidInputError) as caught:  # before any run starts: not an ExceptionGroup of each test's
        await sandbox.run_tests(big, [TestCase(expected_stdout=""), TestCase(expected_stdout="")])
    assert caught.value.field == "code"
    with pytest.raises(InvalidInputError) as caught:  # code that fits, with files that do not
        await sandbox.run("pass", files={"data.bin": b"x" * (1 << 20)})
    assert caught.value.field == "files"
    assert list(tmp_path.iterdir()) == []


async def test_files_that_overfill_the_working_directory_are_typed_errors_not_sandbox_errors(make_sandbox):
    """The working directory is a tmpfs of workdir_mb MiB and 4096 inodes. Before, files within the byte budget that
    needed more pages (every file takes whole pages) or more inodes failed the supervisor's set-up: a sandbox_error
    ("No space left on device") for the caller's own input, on every retry."""
    sandbox = make_sandbox(workdir_mb=1)  # 256 pages: the code takes one
    fits = await sandbox.run("import os; print(len(os.listdir('.')))", files={f"f{i}": b"x" for i in range(255)})
    assert (fits.status, fits.stdout) == ("ok", "256\n"), fits
    with pytest.raises(InvalidInputError) as caught:
        await sandbox.run("pass", files={f"f{i}": b"x" for i in range(256)})
    assert caught.value.field == "files" and "1 MiB" in str(caught.value), caught.value
    empty = {f"d/f{i}": b"" for i in range(4093)}  # with d, solution.py and the root: 4096 inodes
    fits = await sandbox.run("import os; print(len(os.listdir('d')))", files=empty)
    assert (fits.status, fits.stdout) == ("ok", "4093\n"), fits
    with pytest.raises(InvalidInputError) as caught:
        await sandbox.run("pass", files={**empty, "one-more": b""})
    assert caught.value.field == "files" and "4096" in str(caught.value), caught.value


def test_uids_of_root_accounts_groups_or_out_of_range_are_refused(make_sandbox):
    """The supervisor kill(-1)s as a run's uid before and after it: uids=range(0, 1) once killed every process on
    the host. Ids that an account or group owns, or that are no uid at all, are refused before anything runs."""
    user = max(pwd.getpwall(), key=lambda u: u.pw_uid)  # e.g. nobody
    group = max(grp.getgrall(), key=lambda g: g.gr_gid)
    bad = {
        "range(0, 1)": range(0, 1),
        "range(5, -1, -1)": range(5, -1, -1),
        "range(-3, 0)": range(-3, 0),
        "range(0)": range(0),
        "a list": [200_000, 200_001],
        "range(2**32 - 1, 2**32)": range(2**32 - 1, 2**32),
        "range(2**40, 2**40 + 1)": range(2**40, 2**40 + 1),
        "a user's uid": range(user.pw_uid, user.pw_uid + 1),
        "a group's gid": range(group.gr_gid - 1, group.gr_gid + 2),
        "a wide range over every account": range(0, 1 << 31),
    }
    for what, uids in bad.items():
        with pytest.raises(InvalidInputError) as caught:
            make_sandbox(uids=uids)
        assert caught.value.field == "uids", what
    with pytest.raises(InvalidInputError, match=r"range\(0, 1\) holds id 0, owned by user 'root'"):
        make_sandbox(uids=range(0, 1))
    make_sandbox(uids=range(200_000, 204_096, 7))  # the default's kind: unused ids


async def test_a_broken_interpreter_is_a_sandbox_error(make_sandbox):
    last_uid = TEST_UIDS[-1]
    broken = make_sandbox(python="/bin/false", namespaces=False, uids=range(last_uid, last_uid + 1))
    result = await broken.run("print(1)")
    assert result.status == "sandbox_error" and "no report" in result.stderr and result.exit_code is None
    if ROOT:  # the uid of a run whose supervisor vanished is retired, so this one-uid pool is now empty
        again = await broken.run("print(1)")
        assert again.status == "sandbox_error" and "in use" in again.stderr


def _lowest_free_fd() -> int:
    used = {int(fd) for fd in os.listdir("/proc/self/fd")}
    return next(fd for fd in range(len(used) + 1) if fd not in used)


async def test_host_failures_to_start_a_run_are_sandbox_errors_with_nothing_left_behind(make_sandbox):
    """Out of file descriptors at each step of starting a run (working directory, status pipe, uid lease, cgroup,
    the supervisor's pipes): every run is a ``sandbox_error`` saying why, or runs; none raises, and none leaves a
    working directory, a cgroup leaf or a leased uid behind (the pool has one uid: the last run needs it)."""
    one_uid = range(TEST_UIDS[-11], TEST_UIDS[-11] + 1)  # of its own: other tests retire some of the last ones
    sandbox = make_sandbox(uids=one_uid)
    await assert_healthy(sandbox)  # probes namespaces and cgroups with every fd available
    workdirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "asyncsess-sandbox-*")))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    first = _lowest_free_fd()  # a limit of ``first`` leaves no fd at all to open
    results = []
    for limit in range(first, first + 64):
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        try:
            result = await sandbox.run("print('ran')")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        results.append(result)
        assert set(glob.glob(os.path.join(tempfile.gettempdir(), "asyncsess-sandbox-*"))) == workdirs, limit
        assert cgroup_leaves(one_uid) == [], limit
        if result.ok:
            break
        assert result.status == "sandbox_error" and result.exit_code is None, (limit, result)
        assert "Too many open files" in result.stderr or "no cgroup leaf" in result.stderr, (limit, result)
    assert "could not run the program: OSError: [Errno 24] Too many open files" in results[0].stderr, results[0]
    assert len(results) > 3 and (results[-1].status, results[-1].stdout) == ("ok", "ran\n"), results
    await assert_healthy(sandbox)


@root_only
async def test_running_out_of_fds_on_a_first_run_does_not_turn_cgroups_off(make_sandbox):
    """A fresh sandbox decides on its first run whether the host allows a cgroup per run; a run that fails for want
    of a file descriptor must not decide "no" (the weaker fallback, for good)."""
    one_uid = range(TEST_UIDS[-11], TEST_UIDS[-11] + 1)
    expected = (await make_sandbox(uids=one_uid).isolation()).cgroup
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    first = _lowest_free_fd()
    for limit in range(first, first + 64):
        sandbox = make_sandbox(uids=one_uid, namespaces=False)  # nothing decided yet
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        try:
            result = await sandbox.run("print('ran')")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert (await sandbox.isolation()).cgroup == expected, (limit, result)
        if result.ok:
            break
    assert result.ok, result


async def test_a_missing_interpreter_is_a_typed_error(make_sandbox, tmp_path):
    with pytest.raises(InvalidInputError) as caught:
        make_sandbox(python=str(tmp_path / "no-python"))
    assert caught.value.field == "python"
    link = tmp_path / "python"
    link.symlink_to(os.path.realpath(sys.executable))
    one_uid = range(TEST_UIDS[-11], TEST_UIDS[-11] + 1)  # of its own: other tests retire some of the last ones
    sandbox = make_sandbox(python=str(link), uids=one_uid, namespaces=False)
    link.unlink()  # gone by the time it runs
    workdirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "asyncsess-sandbox-*")))
    result = await sandbox.run("print(1)")
    assert result.status == "sandbox_error" and "FileNotFoundError" in result.stderr, result
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "asyncsess-sandbox-*"))) == workdirs
    assert cgroup_leaves(one_uid) == []
    report = await sandbox.run_tests("print(1)", [TestCase(expected_stdout="1")])  # one result each, no ExceptionGroup
    assert [r.result.status for r in report.results] == ["sandbox_error"]
