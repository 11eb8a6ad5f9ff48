"""Hostile programs as a model would write them: each ends with a typed result within its limits, changes nothing
on the host, and leaves no process behind (the ``make_sandbox`` fixture checks that at teardown)."""

from __future__ import annotations

import ast
import socket

import pytest

from asyncsess.sandbox.results import ExecutionResult

from .conftest import assert_healthy, root_only

pytestmark = pytest.mark.anyio

# (path, value): what a program might write to /proc to reach past its run
PROC_WRITES = [
    ("/proc/sys/kernel/core_pattern", "|/bin/sh -c id"),  # a host-wide crash handler, run as root
    ("/proc/sysrq-trigger", "h"),
    ("/proc/sys/vm/drop_caches", "3"),
    ("/proc/sys/kernel/hostname", "pwned"),
    ("/proc/self/oom_score_adj", "-1000"),  # unkillable by the OOM killer
    ("/proc/1/oom_score_adj", "1000"),
    ("/proc/self/loginuid", "0"),
    ("/proc/self/uid_map", "0 0 1"),
    ("/proc/self/setgroups", "allow"),
    ("/proc/self/make-it-fail", "1"),
]


async def test_writes_to_proc_are_refused(make_sandbox):
    code = (
        f"for path, value in {PROC_WRITES!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write(value)\n"
        "        print(path, 'WROTE')\n"
        "    except OSError as e:\n"
        "        print(path, 'refused')\n"
    )
    with open("/proc/sys/kernel/core_pattern") as f:
        core_pattern = f.read()
    hostname = socket.gethostname()
    result = await make_sandbox().run(code)
    assert result.status == "ok", result
    assert result.stdout.splitlines() == [f"{path} refused" for path, _ in PROC_WRITES], result
    with open("/proc/sys/kernel/core_pattern") as f:
        assert f.read() == core_pattern
    assert socket.gethostname() == hostname


@root_only
@pytest.mark.parametrize("namespaces", [None, False], ids=["namespaces", "without"])
async def test_signals_to_the_supervisor_and_init_are_refused(make_sandbox, namespaces):
    """Its parent (the run's init, or the supervisor) and pid 1 stay root: signalling them fails; killing its own
    process group kills only itself; a child that stops itself is cleaned up; a program that stops itself times
    out."""
    sandbox = make_sandbox(namespaces=namespaces, timeout_s=2.0)
    code = (
        "import os, signal\n"
        "for target in (os.getppid(), 1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "        print('signalled', flush=True)\n"
        "    except PermissionError:\n"
        "        print('refused', flush=True)\n"
        "if os.fork() == 0:\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "    os._exit(0)\n"
        "os.kill(0, signal.SIGKILL)\n"
    )
    result = await sandbox.run(code)
    assert (result.status, result.exit_code, result.stdout) == ("runtime_error", -9, "refused\nrefused\n"), result
    stopped = await sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\nprint('resumed')")
    assert (stopped.status, stopped.stdout) == ("timeout", ""), stopped
    await assert_healthy(sandbox)


async def test_sockets_of_every_family_but_the_namespaced_ones_are_refused(make_sandbox):
    """Native code (no socket guard), every address family and socket type: only unix, inet, inet6 and netlink
    sockets can be made (all confined by the network namespace)."""
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None)\n"
        "made = set()\n"
        "for family in range(64):\n"
        "    for kind in (1, 2, 3, 5):\n"  # stream, datagram, raw, seqpacket
        "        fd = libc.socket(family, kind, 0)\n"
        "        if fd >= 0:\n"
        "            made.add(family)\n"
        "            libc.close(fd)\n"
        "print(sorted(made))\n"
    )
    result = await make_sandbox(socket_guard=False).run(code)
    assert result.status == "ok", result
    made = set(ast.literal_eval(result.stdout))
    assert {1, 2} <= made <= {1, 2, 10, 16}, made


async def test_long_argv_and_environment_nul_bytes_and_unread_stdin_end_typed(make_sandbox):
    sandbox = make_sandbox(timeout_s=3.0)
    huge = await sandbox.run(
        "import os, subprocess\n"
        "try:\n"
        "    subprocess.run(['true', 'x' * (1 << 21)])\n"
        "except OSError as e:\n"
        "    print(e.errno)\n"
        "os.environ['BIG'] = 'y' * (1 << 21)\n"
        "subprocess.run(['true'])\n"
    )
    assert (huge.status, huge.stdout) == ("runtime_error", "7\n") and "Argument list too long" in huge.stderr, huge
    nul_source = await sandbox.run("print('a')\0")
    assert nul_source.status == "runtime_error" and "null bytes" in nul_source.stderr, nul_source
    nul_output = await sandbox.run("import sys\nprint('a\\0b')\nsys.stderr.write('\\0')")
    assert (nul_output.status, nul_output.stdout, nul_output.stderr) == ("ok", "a\0b\n", "\0"), nul_output
    assert ExecutionResult.model_validate_json(nul_output.model_dump_json()) == nul_output
    unread = await sandbox.run("print('ignored my input')", stdin="z" * (4 << 20))  # far past a pipe buffer
    assert (unread.status, unread.stdout) == ("ok", "ignored my input\n"), unread
    never = await sandbox.run("import time\ntime.sleep(60)", stdin="z" * (4 << 20))
    assert never.status == "timeout", never
    await assert_healthy(sandbox)
