"""Escape attempts against LocalSandbox. Each must fail, leave the host untouched and the sandbox healthy.

Where a layer is tested on its own, a control run with that layer off shows the attack is real.
"""

from __future__ import annotations

import os
import resource
import select
import shutil
import socket
import tempfile
import uuid

import anyio
import pytest

from .conftest import ROOT, TEST_UIDS, assert_healthy, processes_of, root_only

pytestmark = pytest.mark.anyio


@pytest.fixture
def listener():
    """A TCP server on the host's loopback; yields (port, accepted) where accepted() says whether anyone connected."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)

    def accepted() -> bool:
        return bool(select.select([server], [], [], 0)[0])

    yield server.getsockname()[1], accepted
    server.close()


def _connect(port: int) -> str:
    return f"import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\ns.settimeout(3)\ns.connect(('127.0.0.1', {port}))\nprint('connected')"


# -- network ---------------------------------------------------------------------------------------------------------


async def test_network_connection_fails(make_sandbox, listener):
    port, accepted = listener
    sandbox = make_sandbox()
    for code in (
        _connect(port),
        "import socket\nsocket.getaddrinfo('example.com', 80)",
        "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=3)",
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 53))",
    ):
        result = await sandbox.run(code)
        assert result.status == "runtime_error" and "connected" not in result.stdout, (code, result)
    assert not accepted()
    await assert_healthy(sandbox)


async def test_socket_guard_alone_blocks_python_sockets(make_sandbox, listener):
    port, accepted = listener
    guarded = make_sandbox(namespaces=False)
    result = await guarded.run(_connect(port))
    assert result.status == "runtime_error" and "network access is disabled" in result.stderr
    assert not accepted()
    control = await make_sandbox(namespaces=False, socket_guard=False).run(_connect(port))
    assert (control.status, control.stdout) == ("ok", "connected\n") and accepted()
    await assert_healthy(guarded)


async def test_socket_families_outside_the_network_namespace_are_refused(make_sandbox):
    """AF_VSOCK reaches the VM's hypervisor whatever the network namespace; AF_ALG, AF_PACKET and the rest are
    kernel code (or module autoloads) a grader never needs. Native code gets past the socket guard, so seccomp
    refuses every family but unix, inet, inet6 and netlink (all namespaced)."""
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for family in (40, 38, 17, 1, 2, 10, 16):\n"  # vsock, alg, packet; unix, inet, inet6, netlink
        "    fd = libc.socket(family, 2 if family in (17, 16) else 1, 0)\n"
        "    print(family, 'made' if fd >= 0 else os.strerror(ctypes.get_errno()))\n"
        "pair = (ctypes.c_int * 2)()\n"
        "print('pair', libc.socketpair(40, 1, 0, pair), os.strerror(ctypes.get_errno()))\n"
    )
    result = await make_sandbox(socket_guard=False).run(code)
    refused = "Address family not supported by protocol"
    assert result.status == "ok", result
    assert result.stdout.splitlines() == [
        f"40 {refused}",
        f"38 {refused}",
        f"17 {refused}",
        "1 made",
        "2 made",
        "10 made",
        "16 made",
        f"pair -1 {refused}",
    ], result


@root_only
async def test_network_namespace_alone_blocks_connections_even_past_the_guard(make_sandbox, listener):
    port, accepted = listener
    sandbox = make_sandbox(socket_guard=False)
    assert (await sandbox.isolation()).namespaces
    result = await sandbox.run(_connect(port))
    assert result.status == "runtime_error" and "unreachable" in result.stderr.lower(), result
    # a fresh interpreter is not under the in-process guard; only the namespace stops it
    guarded = make_sandbox()
    escaped = await guarded.run(f"import subprocess, sys\nsubprocess.run(['python3', '-c', {_connect(port)!r}], check=True)")
    assert escaped.status == "runtime_error" and "connected" not in escaped.stdout, escaped
    assert not accepted()
    await assert_healthy(guarded)


# -- filesystem ------------------------------------------------------------------------------------------------------


@root_only
async def test_writing_outside_the_working_directory_fails(make_sandbox, tmp_path):
    sandbox = make_sandbox()
    token = uuid.uuid4().hex
    targets = [
        f"/var/tmp/escape-{token}",  # world-writable (1777) on the host
        f"/work/escape-{token}",
        f"/root/escape-{token}",
        str(tmp_path / f"escape-{token}"),
        os.path.join(os.path.dirname(os.path.abspath(__file__)), f"escape-{token}"),
    ]
    for target in targets:
        result = await sandbox.run(f"open({target!r}, 'w').write('pwned')\nprint('wrote')")
        assert result.status == "runtime_error" and "wrote" not in result.stdout, (target, result)
        assert not os.path.exists(target), target
    rename = await sandbox.run("import os\nos.mkdir('d')\nos.rename('d', '../escape-dir')")
    assert rename.status == "runtime_error"
    # /tmp and /dev/shm (POSIX semaphores and shared memory) are writable, but tmpfs of the run's own
    for private in ("/tmp", "/dev/shm"):
        code = f"import os\nopen('{private}/escape-{token}', 'w').write('x')\nprint('escape-{token}' in os.listdir({private!r}))"
        written = await sandbox.run(code)
        assert (written.status, written.stdout) == ("ok", "True\n"), written
        assert not os.path.exists(f"{private}/escape-{token}")
    await assert_healthy(sandbox)


async def test_multiprocessing_works(make_sandbox):
    """A correct program that uses a process pool must not fail for the sandbox's sake: its locks are POSIX
    semaphores in /dev/shm."""
    code = (
        "import multiprocessing\n"
        "if __name__ == '__main__':\n"
        "    with multiprocessing.Pool(2) as pool:\n"
        "        print(sum(pool.map(abs, [-1, -2, -3])))\n"
        "    queue = multiprocessing.Queue()\n"
        "    worker = multiprocessing.Process(target=queue.put, args=(42,))\n"
        "    worker.start()\n"
        "    print(queue.get())\n"
        "    worker.join()\n"
    )
    result = await make_sandbox(timeout_s=10.0).run(code)
    assert (result.status, result.stdout) == ("ok", "6\n42\n"), result


@root_only
async def test_symlinks_a_run_leaves_in_its_directory_do_not_steer_the_hosts_cleanup(make_sandbox, tmp_path):
    """Without the mount namespace the host removes what the program wrote in its working directory, as root: links
    to host files and directories (made where the run cannot look, which a symlink does not need) stay links."""
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep.txt").write_text("keep")
    code = (
        "import os\n"
        f"os.symlink({str(canary)!r}, 'dir-link')\n"
        f"os.symlink({str(canary / 'keep.txt')!r}, 'file-link')\n"
        "os.makedirs('d/e')\n"
        f"os.symlink({str(canary)!r}, 'd/e/deep-link')\n"
        "os.chmod('d', 0)\n"
        "print(sorted(os.listdir('.')))\n"
    )
    result = await make_sandbox(namespaces=False).run(code)
    assert (result.status, result.stdout) == ("ok", "['d', 'dir-link', 'file-link', 'solution.py']\n"), result
    assert (canary / "keep.txt").read_text() == "keep"


@root_only
async def test_each_run_gets_a_private_bounded_tmp_that_is_gone_after_it(make_sandbox):
    """Ordinary programs write temp files. /tmp is an empty tmpfs of the run's own (``TMPDIR`` too): bounded by
    ``workdir_mb``, never the host's, and empty again for the next run on the same uid. A link planted there
    points nowhere the host ever follows."""
    sandbox = make_sandbox(uids=range(TEST_UIDS[0], TEST_UIDS[0] + 1), workdir_mb=4)
    name = f"planted-{uuid.uuid4().hex}"
    listing = "sorted(n for n in os.listdir('/tmp') if not n.startswith('asyncsess-sandbox-'))"  # but its workdir
    code = (
        "import os, tempfile\n"
        f"print({listing})\n"
        "with tempfile.TemporaryFile() as f:\n"
        "    f.write(b'data')\n"
        "    f.seek(0)\n"
        "    print(f.read().decode(), tempfile.gettempdir())\n"
        f"open('/tmp/{name}', 'w').write('hint')\n"
        "os.symlink('/etc/passwd', '/tmp/link-' + 'x' * 8)\n"
        "try:\n"
        "    with open('/tmp/big', 'wb') as f:\n"
        "        for _ in range(8):\n"
        "            f.write(b'x' * (1 << 20))\n"
        "except OSError as e:\n"
        "    print('full', e.errno)\n"
        "os.unlink('/tmp/big')\n"
        f"print({listing})\n"
    )
    first = await sandbox.run(code)
    assert first.status == "ok", first
    assert first.stdout.splitlines() == ["[]", "data /tmp", "full 28", f"['link-xxxxxxxx', '{name}']"], first
    assert not os.path.lexists(f"/tmp/{name}") and not os.path.lexists("/tmp/link-xxxxxxxx")
    second = await sandbox.run(f"import os\nprint({listing})")
    assert (second.status, second.stdout) == ("ok", "[]\n"), second


@root_only
async def test_filling_the_disk_stops_at_the_working_directory_size(make_sandbox):
    sandbox = make_sandbox(workdir_mb=4)
    code = (
        "import os\n"
        "written, block = 0, b'x' * (1 << 20)\n"
        "try:\n"
        "    for i in range(64):\n"
        "        with open(f'f{i}', 'wb') as f:\n"
        "            f.write(block)\n"
        "        written += 1\n"
        "except OSError as e:\n"
        "    print(type(e).__name__, e.errno)\n"
        "print(written)\n"
    )
    result = await sandbox.run(code)
    assert (result.status, result.stdout) == ("ok", "OSError 28\n3\n"), result  # ENOSPC: the tmpfs is full
    await assert_healthy(sandbox)


@root_only
async def test_world_writable_dirs_are_writable_without_the_mount_namespace(make_sandbox):
    """Control: the mount namespace is what keeps writes to /tmp off the host's, which the sandbox uid could otherwise
    use."""
    target = os.path.join(tempfile.gettempdir(), f"escape-{uuid.uuid4().hex}")
    try:
        result = await make_sandbox(namespaces=False).run(f"open({target!r}, 'w').write('x')\nprint('wrote')")
        assert result.stdout == "wrote\n" and os.stat(target).st_uid in TEST_UIDS
    finally:
        if os.path.exists(target):
            os.unlink(target)
    private = await make_sandbox().run(f"open({target!r}, 'w').write('x')")  # a /tmp of the run's own
    assert private.status == "ok" and not os.path.exists(target), private


@root_only
async def test_runs_cannot_see_each_others_working_directories(make_sandbox):
    sandbox = make_sandbox(max_concurrency=2)
    results = {}

    async def victim() -> None:
        results["victim"] = await sandbox.run(
            "import os, time\n"
            "open('secret.txt', 'w').write('v-secret')\n"
            "open('/tmp/secret.txt', 'w').write('v-secret')\n"
            "print(os.getcwd(), flush=True)\n"
            "time.sleep(2)"
        )

    async def thief() -> None:
        await anyio.sleep(1.0)
        code = (
            "import glob, os\n"
            "for d in glob.glob(os.path.join(os.path.dirname(os.getcwd()), 'asyncsess-sandbox-*')):\n"
            "    if d != os.getcwd():\n"
            "        try:\n"
            "            print(open(os.path.join(d, 'secret.txt')).read())\n"
            "        except OSError as e:\n"
            "            print('denied', type(e).__name__)\n"
            "print(os.path.exists('/tmp/secret.txt'))\n"
        )
        results["thief"] = await sandbox.run(code)

    async with anyio.create_task_group() as tg:
        tg.start_soon(victim)
        tg.start_soon(thief)
    assert results["victim"].status == "ok"
    assert results["thief"].status == "ok" and "v-secret" not in results["thief"].stdout
    assert results["thief"].stdout.endswith("False\n"), results  # nor each other's /tmp


NEW_USER_NAMESPACE = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "CLONE_NEWUSER, SIGCHLD = 0x10000000, 17\n"
    "pid = libc.syscall({'x86_64': 56, 'aarch64': 220}[os.uname().machine], CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)\n"
    "if pid == 0:\n"
    "    os._exit(0)  # the child, in a user namespace of its own\n"
    "print('clone', pid if pid < 0 else 'made one', os.strerror(ctypes.get_errno()) if pid < 0 else '')\n"
    "if pid > 0:\n"
    "    os.waitpid(pid, 0)\n"
    "got = libc.unshare(CLONE_NEWUSER)\n"
    "print('unshare', got, os.strerror(ctypes.get_errno()) if got else 'made one')\n"
)


async def test_a_new_user_namespace_is_refused(make_sandbox):
    """A user namespace would give the program every capability inside it (the bounding set does not carry over):
    new network, mount and PID namespaces, the kernel code behind them. seccomp refuses it; forks, threads and
    subprocesses still work (glibc falls back from clone3 to clone)."""
    sandbox = make_sandbox()
    result = await sandbox.run(NEW_USER_NAMESPACE)
    assert result.status == "ok", result
    assert result.stdout == "clone -1 Operation not permitted\nunshare -1 Operation not permitted\n", result
    ordinary = (
        "import os, subprocess, threading\n"
        "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
        "print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())\n"
        "pid = os.fork()\nif pid == 0:\n    os._exit(7)\nprint(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    works = await sandbox.run(ordinary)
    assert (works.status, works.stdout) == ("ok", "thread\nchild\n7\n"), works
    await assert_healthy(sandbox)


@root_only
async def test_pseudo_terminals_come_from_a_small_pool_of_the_runs_own(make_sandbox):
    """The host's pty pool is kernel.pty.max (4096) for every process on it: 32 processes x 127 ptys each would
    drain it for as long as the run lasts. A run gets a devpts instance of its own, capped."""
    sandbox = make_sandbox()
    code = (
        "import os\n"
        "others = sorted(os.listdir('/dev/pts'))\n"
        "ptys = []\n"
        "while len(ptys) < 40:\n"
        "    try:\n"
        "        ptys.append(os.openpty())\n"
        "    except OSError:\n"
        "        break\n"
        "print(others, len(ptys), os.ttyname(ptys[0][1]))\n"
    )
    result = await sandbox.run(code)
    assert (result.status, result.stdout) == ("ok", "['ptmx'] 16 /dev/pts/0\n"), result
    await assert_healthy(sandbox)


@root_only
async def test_a_run_cannot_signal_another_running_at_the_same_time(make_sandbox):
    """kill(-1) signals every process the caller may signal: without a uid and a PID namespace per run, the
    concurrent run too."""
    sandbox = make_sandbox(max_concurrency=2)
    results = {}

    async def victim() -> None:
        results["victim"] = await sandbox.run("import time\ntime.sleep(1.5)\nprint('survived')")

    async def killer() -> None:
        await anyio.sleep(0.5)
        code = (
            "import os, signal\n"
            "for sig in (signal.SIGKILL, signal.SIGSTOP):\n"
            "    try:\n"
            "        os.kill(-1, sig)\n"
            "    except ProcessLookupError:\n"  # no process it may signal (Linux spares the caller)
            "        print('none to signal')\n"
        )
        results["killer"] = await sandbox.run(code)

    async with anyio.create_task_group() as tg:
        tg.start_soon(victim)
        tg.start_soon(killer)
    assert (results["victim"].status, results["victim"].stdout) == ("ok", "survived\n"), results
    assert results["killer"].stdout == "none to signal\n" * 2, results


PLANT = (
    "import os, socket, time\n"
    "for d in ('/tmp', '/dev/shm', '/var/tmp', '/run', '.'):\n"
    "    try:\n"
    "        open(os.path.join(d, NAME), 'w').write('hint')\n"
    "    except OSError:\n"
    "        pass\n"
    "server = socket.socket(socket.AF_UNIX)\n"
    "server.bind('\\0asyncsess-planted')\n"
    "server.listen()\n"
    "if os.fork() == 0:\n"  # a daemon that keeps the socket open, in a session of its own
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        time.sleep(60)\n"
    "    os._exit(0)\n"
    "print('planted')\n"
)
FIND = (
    "import os, socket\n"
    "found = [d for d in ('/tmp', '/dev/shm', '/var/tmp', '/run', '.') if os.path.exists(os.path.join(d, NAME))]\n"
    "client = socket.socket(socket.AF_UNIX)\n"
    "try:\n"
    "    client.connect('\\0asyncsess-planted')\n"
    "    found.append('abstract socket')\n"
    "except OSError:\n"
    "    pass\n"
    "print(found)\n"
)


@root_only
@pytest.mark.parametrize("namespaces", [None, False], ids=["namespaces", "control-without"])
async def test_nothing_a_run_leaves_in_files_sockets_or_daemons_reaches_the_next_run_on_its_uid(make_sandbox, namespaces):
    # one uid: the next run gets the same; no socket guard: the namespaces are what must hold
    sandbox = make_sandbox(uids=range(TEST_UIDS[0], TEST_UIDS[0] + 1), socket_guard=False, namespaces=namespaces)
    name = f"planted-{uuid.uuid4().hex}"
    try:
        planted = await sandbox.run(f"NAME = {name!r}\n" + PLANT)
        assert (planted.status, planted.stdout) == ("ok", "planted\n"), planted
        assert processes_of(TEST_UIDS) == []  # the daemon is gone
        found = await sandbox.run(f"NAME = {name!r}\n" + FIND)
    finally:
        for d in ("/tmp", "/dev/shm", "/var/tmp"):
            if os.path.exists(os.path.join(d, name)):
                os.unlink(os.path.join(d, name))
    # without the namespaces the world-writable dirs carry a hint from run to run (the working directory does not)
    expected = "[]\n" if namespaces is None else "['/tmp', '/dev/shm', '/var/tmp']\n"
    assert (found.status, found.stdout) == ("ok", expected), found


# -- secrets ---------------------------------------------------------------------------------------------------------


async def test_host_environment_is_not_visible(make_sandbox, monkeypatch):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("ASYNCSESS_TEST_SECRET", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    result = await make_sandbox().run("import os\nprint(sorted(os.environ))\nprint(os.environ.get('ASYNCSESS_TEST_SECRET'))")
    assert result.status == "ok"
    assert secret not in result.stdout
    assert eval(result.stdout.splitlines()[0]) == ["HOME", "LANG", "PATH", "TMPDIR"]


@root_only
async def test_host_secrets_in_files_and_proc_are_unreadable(make_sandbox, monkeypatch, tmp_path):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("ASYNCSESS_TEST_SECRET", secret)
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    sandbox = make_sandbox()
    attempts = [
        f"print(open({str(secret_file)!r}).read())",
        "print(open('/root/.bashrc').read())",
        "import os\nprint(os.listdir('/root'))",
        f"print(open('/proc/{os.getpid()}/environ', 'rb').read())",
        "print(open('/proc/1/environ', 'rb').read())",
        "print(open('/etc/shadow').read())",
    ]
    for code in attempts:
        result = await sandbox.run(code)
        assert result.status == "runtime_error", (code, result)
        assert secret not in result.stdout + result.stderr
    # the host's processes are not even listed: the program is pid 2 of a PID namespace of its own (its init, pid 1,
    # runs as root and is hidden from it)
    listing = await sandbox.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert listing.status == "ok" and eval(listing.stdout) == [2], listing
    await assert_healthy(sandbox)


@root_only
async def test_sysfs_is_covered_for_the_program(make_sandbox):
    """/sys is the host's: before, a run listed the host's network interfaces and read the cgroup tree, with the
    leaves and the memory use of the runs beside it. The program now sees an empty /sys (its own mount namespace,
    below the supervisor's, which still reads the run's cgroup); ordinary Python does not need it."""
    assert os.listdir("/sys/class/net")  # the host's, as a run saw it
    code = "import os\nprint(os.listdir('/sys'), os.path.exists('/sys/fs/cgroup'), os.cpu_count() >= 1)"
    result = await make_sandbox().run(code)
    assert (result.status, result.stdout) == ("ok", "[] False True\n"), result


@root_only
async def test_hidden_paths_cover_world_readable_host_files(make_sandbox):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    project = tempfile.mkdtemp(prefix="project-", dir="/var/lib")  # outside the temp and socket dirs runs cover
    try:
        os.chmod(project, 0o755)
        with open(os.path.join(project, ".env"), "w") as f:
            f.write(f"API_KEY={secret}\n")
        os.chmod(os.path.join(project, ".env"), 0o644)  # the common mistake: a world-readable .env
        code = f"print(open({os.path.join(project, '.env')!r}).read())"
        control = await make_sandbox(hidden_paths=[]).run(code)
        assert control.status == "ok" and secret in control.stdout  # readable unless hidden
        sandbox = make_sandbox(hidden_paths=[project])
        assert (await sandbox.isolation()).hidden_paths == [project]
        hidden = await sandbox.run(code)
        assert hidden.status == "runtime_error" and secret not in hidden.stdout + hidden.stderr
        listing = await sandbox.run(f"import os\nprint(os.listdir({project!r}))")
        assert listing.status == "runtime_error" and "PermissionError" in listing.stderr
    finally:
        shutil.rmtree(project)
    # by default the current directory (here the repository) is hidden; under a directory that runs get an
    # empty tmpfs for (a checkout in /tmp, say) it does not even exist there
    default = await make_sandbox().run(f"import os\nprint(os.listdir({os.getcwd()!r}))")
    assert default.status == "runtime_error" and ("PermissionError" in default.stderr or "FileNotFoundError" in default.stderr)


# -- crashes ---------------------------------------------------------------------------------------------------------


async def test_a_crashing_program_is_a_runtime_error_and_dumps_no_core(make_sandbox):
    """A pipe ``core_pattern`` (systemd-coredump, apport) ignores RLIMIT_CORE 0 and hands the core to a helper on
    the host. The program is not dumpable, and RLIMIT_CORE is 1 (no core for any pattern: the kernel refuses a pipe
    dump at 1, a file is under the minimum) where it cannot lower it to 0: not in a fork, not in an exec'd program
    (dumpable again), not through setrlimit or prlimit, which succeed without effect for RLIMIT_CORE only."""
    sandbox = make_sandbox()
    for code, signum in (("import ctypes\nctypes.string_at(0)", 11), ("import os\nos.abort()", 6)):
        crash = await sandbox.run(code)
        assert (crash.status, crash.exit_code) == ("runtime_error", -signum), crash
    code = (
        "import ctypes, os, resource, signal, subprocess\n"
        "print('dumpable', ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))\n"  # PR_GET_DUMPABLE
        "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
        "resource.prlimit(0, resource.RLIMIT_CORE, (0, 0))\n"
        "print('core', resource.getrlimit(resource.RLIMIT_CORE), resource.prlimit(0, resource.RLIMIT_CORE))\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 200))\n"  # other limits: as usual
        "print('nofile', resource.getrlimit(resource.RLIMIT_NOFILE))\n"
        "statuses = []\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "statuses.append(os.waitpid(pid, 0)[1])\n"
        "for sig in ('SEGV', 'ABRT'):\n"
        "    child = subprocess.Popen(['sh', '-c', 'kill -%s $$' % sig])\n"
        "    statuses.append(os.waitpid(child.pid, 0)[1])\n"
        "print([(os.WTERMSIG(s), os.WCOREDUMP(s)) for s in statuses])\n"
        "print([n for n in os.listdir('.') if 'core' in n])\n"
    )
    result = await sandbox.run(code)
    assert result.status == "ok", result
    assert result.stdout.splitlines() == [
        "dumpable 0",
        "core (1, 1) (1, 1)",
        "nofile (100, 200)",
        "[(11, False), (11, False), (6, False)]",
        "[]",
    ], result
    await assert_healthy(sandbox)


# -- time and memory -------------------------------------------------------------------------------------------------


async def test_time_and_memory_escapes_fail_and_the_sandbox_recovers(make_sandbox):
    sandbox = make_sandbox(timeout_s=1.5, memory_mb=128)
    attempts = {
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass": "timeout",
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)": "timeout",
        "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\nx = bytearray(1 << 30)": "runtime_error",
        "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (-1, -1))": "runtime_error",
        "x = ' ' * (1 << 30)": "memory",
    }
    for code, status in attempts.items():
        result = await sandbox.run(code)
        assert result.status == status, (code, result)
    await assert_healthy(sandbox)


# -- processes -------------------------------------------------------------------------------------------------------


BOUNDED_FORKS = (
    "import os, time\n"
    "made = 0\n"
    "for _ in range(40):\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        continue\n"
    "    if pid == 0:\n"
    "        time.sleep(1)\n"
    "        os._exit(0)\n"
    "    made += 1\n"
    "print(made)\n"
)


@root_only
async def test_bounded_fork_loop_hits_the_process_limit(make_sandbox):
    """A bounded loop first: it shows RLIMIT_NPROC holds before anything unbounded is tried."""
    result = await make_sandbox(max_processes=8).run(BOUNDED_FORKS)
    assert result.status == "ok", result
    assert 0 < int(result.stdout) < 8  # the program itself is one of the 8


@root_only
async def test_fork_bomb_stays_bounded_and_is_cleaned_up(make_sandbox):
    sandbox = make_sandbox(max_processes=8, timeout_s=2.0)
    probe = await sandbox.run(BOUNDED_FORKS)
    assert probe.status == "ok" and 0 < int(probe.stdout) < 8, probe  # the limit holds: only now go unbounded
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len([p for p in processes_of(TEST_UIDS) if p[2][0] != "Z"]))
            await anyio.sleep(0.02)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        bomb = await sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
        tg.cancel_scope.cancel()
    assert bomb.status == "timeout"
    assert 2 <= peak <= 8 + 1  # it forked, and never past the limit (+1: the supervisor's killer, briefly)
    assert processes_of(TEST_UIDS) == []
    await assert_healthy(sandbox)


@pytest.mark.parametrize("namespaces", [None, False], ids=["pid-namespace", "subreaper-only"])
async def test_background_processes_are_gone_after_the_run(make_sandbox, namespaces):
    sandbox = make_sandbox(namespaces=namespaces)
    code = (
        "import os, subprocess, sys, time\n"
        "print(subprocess.Popen(['sleep', '300']).pid)\n"
        "print(subprocess.Popen(['sleep', '300'], start_new_session=True).pid)\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"  # a classic double-forked daemon in its own session
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.write(w, str(os.getpid()).encode())\n"
        "        os.close(w)\n"
        "        time.sleep(300)\n"
        "    os._exit(0)\n"
        "os.close(w)\n"
        "print(os.read(r, 32).decode())\n"
    )
    result = await sandbox.run(code)
    assert result.status == "ok", result
    pids = [int(line) for line in result.stdout.split()]
    assert len(pids) == 3
    assert processes_of(TEST_UIDS) == []  # killed and reaped, not even a zombie
    if not (await sandbox.isolation()).namespaces:  # the pids are the host's (else the run's namespace's)
        for pid in pids:
            assert not os.path.exists(f"/proc/{pid}"), pid
    await assert_healthy(sandbox)


@root_only
async def test_runs_get_distinct_unprivileged_uids(make_sandbox):
    sandbox = make_sandbox(max_concurrency=4)
    seen = []

    async def one() -> None:
        result = await sandbox.run("import os, time\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())\ntime.sleep(0.5)")
        seen.append(result.stdout.strip())

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(one)
    uids = {line.split()[0] for line in seen}
    assert len(uids) == 4 and all(int(u) in TEST_UIDS for u in uids)
    assert all(line.endswith("[]") for line in seen)


async def test_isolation_report_names_the_layers(make_sandbox):
    report = await make_sandbox().isolation()
    assert report.privilege_drop == ROOT and report.socket_guard
    assert report.namespaces == ROOT  # this host supports them as root
    degraded = await make_sandbox(namespaces=False, socket_guard=False).isolation()
    assert not degraded.namespaces and not degraded.socket_guard and len(degraded.notes) >= 2


@root_only
async def test_without_cap_sys_admin_the_sandbox_degrades_and_says_so(make_sandbox, tmp_path):
    """As in a container without CAP_SYS_ADMIN: namespaces fail, the probe degrades (or, if asked, fails closed)."""
    wrapper = tmp_path / "python-without-sys-admin"
    wrapper.write_text('#!/bin/sh\nexec setpriv --bounding-set=-sys_admin /usr/bin/python3 "$@"\n')
    wrapper.chmod(0o755)
    sandbox = make_sandbox(python=str(wrapper))
    report = await sandbox.isolation()
    assert report.privilege_drop and not report.namespaces and report.hidden_paths == []
    assert any("namespaces unavailable" in note for note in report.notes)
    ok = await sandbox.run("import os\nprint(os.getuid())")
    assert ok.status == "ok" and int(ok.stdout) in TEST_UIDS  # still an unprivileged uid
    strict = await make_sandbox(python=str(wrapper), namespaces=True).run("print(1)")
    assert strict.status == "sandbox_error" and "namespaces unavailable" in strict.stderr


@root_only
async def test_a_probe_the_host_cannot_start_decides_nothing(make_sandbox, tmp_path):
    """Out of file descriptors when the first run probes for namespaces: that run fails, but the sandbox does not
    settle on namespaces it does not have (every later run would fail), nor on none."""
    wrapper = tmp_path / "python-without-sys-admin"
    wrapper.write_text('#!/bin/sh\nexec setpriv --bounding-set=-sys_admin /usr/bin/python3 "$@"\n')
    wrapper.chmod(0o755)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = {int(fd) for fd in os.listdir("/proc/self/fd")}
    first = next(fd for fd in range(len(used) + 1) if fd not in used)
    for limit in range(first, first + 64):
        sandbox = make_sandbox(python=str(wrapper), uids=range(TEST_UIDS[-12], TEST_UIDS[-12] + 1))  # undecided
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        try:
            result = await sandbox.run("print('ran')")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert result.status in ("ok", "sandbox_error"), (limit, result)
        assert not (await sandbox.isolation()).namespaces, (limit, result)
        after = await sandbox.run("print('ran')")
        assert (after.status, after.stdout) == ("ok", "ran\n"), (limit, after)
        if result.ok:
            break
    assert result.ok, result


@root_only
async def test_a_probe_failing_for_another_reason_fails_closed(make_sandbox):
    sandbox = make_sandbox(python="/bin/false", uids=range(TEST_UIDS[-3], TEST_UIDS[-1]))
    assert (await sandbox.isolation()).namespaces  # not silently degraded
    assert (await sandbox.run("print(1)")).status == "sandbox_error"
