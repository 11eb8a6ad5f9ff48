"""Escape classes of issue 11, each checked from the host side: host sockets, memory over many processes, state
left for the next run (SysV/POSIX IPC, keyrings), bad file names, privileges and host pids.

Where a layer is tested on its own, a control run without it shows the attack is real on this host.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import select
import shutil
import socket
import tempfile
import uuid

import anyio
import pytest

from asyncsess.errors import InvalidInputError
from asyncsess.sandbox import TestCase

from .conftest import TEST_UIDS, assert_healthy, processes_of, root_only

pytestmark = pytest.mark.anyio

_libc = ctypes.CDLL(None, use_errno=True)


# -- pathname unix sockets -------------------------------------------------------------------------------------------


@pytest.fixture
def host_sockets():
    """World-writable unix sockets listening on the host: one in the temp dir, one in a directory no run covers."""
    outside = tempfile.mkdtemp(prefix="sockets-", dir="/var/lib")
    os.chmod(outside, 0o755)
    servers = []
    for directory in (tempfile.gettempdir(), outside):
        path = os.path.join(directory, f"host-{uuid.uuid4().hex[:8]}.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen(8)
        server.setblocking(False)
        servers.append((path, server))

    def accepted() -> bool:
        return any(select.select([server], [], [], 0)[0] for _, server in servers)

    yield [path for path, _ in servers], accepted
    for path, server in servers:
        server.close()
        os.unlink(path)
    os.rmdir(outside)


def _unix_connect(path: str) -> str:
    return f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\nprint('connected')"


@root_only
async def test_host_pathname_sockets_are_reachable_without_the_mount_namespace(make_sandbox, host_sockets):
    paths, accepted = host_sockets
    control = make_sandbox(namespaces=False, socket_guard=False)  # the reported escape: connect() works
    for path in paths:
        result = await control.run(_unix_connect(path))
        assert (result.status, result.stdout) == ("ok", "connected\n"), result
    assert accepted()


@root_only
async def test_mount_namespace_hides_host_pathname_sockets(make_sandbox, host_sockets):
    paths, accepted = host_sockets
    sandbox = make_sandbox(socket_guard=False)  # the mount namespace alone
    present = {os.path.realpath(d) for d in ("/tmp", "/var/tmp", "/run", "/dev/shm") if os.path.isdir(d)}
    assert present <= set((await sandbox.isolation()).socket_dirs)
    for path in paths:
        result = await sandbox.run(_unix_connect(path))
        assert result.status == "runtime_error" and "connected" not in result.stdout, (path, result)
        # and from a fresh interpreter, out of reach of any in-process guard
        child = await make_sandbox().run(f"import subprocess\nsubprocess.run(['python3', '-c', {_unix_connect(path)!r}], check=True)")
        assert child.status == "runtime_error" and "connected" not in child.stdout, (path, child)
    assert not accepted()
    await assert_healthy(sandbox)


# -- memory over all of a run's processes ----------------------------------------------------------------------------

SEVEN_CHILDREN = (  # the reported escape: 7 x 80 MiB held under memory_mb=128
    "import os, sys, time\n"
    "pids = []\n"
    "for _ in range(7):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        block = b'x' * (80 << 20)\n"
    "        time.sleep(60)\n"
    "        os._exit(0)\n"
    "    pids.append(pid)\n"
    "for pid in pids:\n"
    "    os.waitpid(pid, 0)\n"
    "print('held')\n"
)


def _pss_of(uids: range) -> int:
    """Proportional set size in bytes of all processes of ``uids``, as the host sees them."""
    total = 0
    for pid, _, _ in processes_of(uids):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) << 10
        except (OSError, StopIteration):
            pass
    return total


@root_only
@pytest.mark.parametrize("cgroups", [None, False], ids=["cgroup-if-allowed", "fallback"])
async def test_memory_limit_holds_over_all_processes_of_a_run(make_sandbox, cgroups):
    sandbox = make_sandbox(memory_mb=128, timeout_s=20.0, max_processes=16, cgroups=cgroups)
    layer = (await sandbox.isolation()).cgroup
    assert (layer is None) if cgroups is False else True
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, _pss_of(TEST_UIDS))
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        result = await sandbox.run(SEVEN_CHILDREN)
        tg.cancel_scope.cancel()
    assert result.status == "memory" and "held" not in result.stdout, result
    # A cgroup holds the run to its limit (+ shared library pages it does not pay for). The fallback's watch samples
    # every 20 ms, so a burst can overshoot until the next sample (measured at load 9 on 2 cores: 130-144 MiB; once
    # 390 MiB before the supervisor ran at nice -10); either way the run never holds what it asked for (7 x 80 MiB).
    assert peak <= ((128 << 20) * 1.1 if layer else 7 * (80 << 20)), (layer, peak >> 20)
    assert peak > 64 << 20  # it did allocate, and the watcher saw it
    assert processes_of(TEST_UIDS) == [] and _pss_of(TEST_UIDS) == 0  # everything freed
    leaves = glob.glob("/sys/fs/cgroup/**/asyncsess-sandbox-*", recursive=True)
    assert not [leaf for leaf in leaves if leaf.rsplit("-", 1)[1].isdigit() and int(leaf.rsplit("-", 1)[1]) in TEST_UIDS]
    await assert_healthy(sandbox)


# -- state that outlives a run ---------------------------------------------------------------------------------------

_ARCH_KEY_CALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl
LEAVE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
left = []
for i in range(4):  # 4 x 32 MiB of SysV shared memory, filled, detached, not removed
    sid = libc.shmget(KEY + i, 32 << 20, 0o1666)
    addr = libc.shmat(sid, None, 0)
    ctypes.memset(addr, 0x41, 32 << 20)
    ctypes.memmove(addr, SECRET, len(SECRET))
    libc.shmdt(ctypes.c_void_p(addr))
    left.append(sid >= 0)
qid = libc.msgget(KEY, 0o1666)
msg = ctypes.create_string_buffer(ctypes.sizeof(ctypes.c_long) + len(SECRET))
ctypes.memmove(ctypes.addressof(msg), ctypes.byref(ctypes.c_long(1)), ctypes.sizeof(ctypes.c_long))
ctypes.memmove(ctypes.addressof(msg) + ctypes.sizeof(ctypes.c_long), SECRET, len(SECRET))
left.append(libc.msgsnd(qid, msg, len(SECRET), 0) == 0)
mq = libc.mq_open(MQ_NAME, os.O_CREAT | os.O_RDWR, 0o666, None)
left.append(mq >= 0 and libc.mq_send(mq, SECRET, len(SECRET), 0) == 0)
if CALLS:  # add_key to the user keyring (-4) and to the uid's persistent keyring: refused now (seccomp, EPERM)
    def c(*args):
        return [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    key = libc.syscall(*c(CALLS[0], b"user", b"answers", SECRET, len(SECRET), -4))
    libc.syscall(*c(CALLS[1], 8, -4, -3))  # KEYCTL_LINK the user keyring into the session one: now possessed
    persistent = libc.syscall(*c(CALLS[1], 22, -1, -4))
    kept = libc.syscall(*c(CALLS[0], b"user", b"kept", SECRET, len(SECRET), persistent))
    left += [key == persistent == kept == -1 and ctypes.get_errno() == 1]
print(left)
"""
FIND = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
found = []
found += [("shm", i) for i in range(4) if libc.shmget(KEY + i, 0, 0) >= 0]
found += [("msg",)] if libc.msgget(KEY, 0) >= 0 else []
found += [("mq",)] if libc.mq_open(MQ_NAME, os.O_RDONLY, 0, None) >= 0 else []
if CALLS:
    def keyctl(*args):
        return libc.syscall(ctypes.c_long(CALLS[1]), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    persistent = keyctl(22, -1, -3)  # KEYCTL_GET_PERSISTENT, linked into the session keyring (not to taint -4)
    for ring in (-4, -5, persistent):  # KEYCTL_READ of a keyring lists the ids of the keys in it
        ids = (ctypes.c_int32 * 64)()
        n = keyctl(11, ring, ids, ctypes.sizeof(ids))
        for key_id in ids[: max(0, n) // 4]:
            desc = ctypes.create_string_buffer(256)
            keyctl(6, key_id, desc, 256)  # KEYCTL_DESCRIBE: needs only view permission
            data = ctypes.create_string_buffer(256)
            size = keyctl(11, key_id, data, 256)  # KEYCTL_READ the payload, where permitted
            found.append(("key", ring, desc.value.decode(), data.raw[: max(0, size)]))
print(found)
"""


def _sysvipc_of(uids: range) -> list[str]:
    """The host IPC namespace's SysV objects owned or created by ``uids``."""
    found = []
    for kind, (uid_col, cuid_col) in {"shm": (7, 9), "msg": (7, 9), "sem": (4, 6)}.items():
        with open(f"/proc/sysvipc/{kind}") as f:
            for row in map(str.split, f.read().splitlines()[1:]):
                if int(row[uid_col]) in uids or int(row[cuid_col]) in uids:
                    found.append(f"{kind} {row[1]}")
    return found


def _shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Shmem:"))


async def _shmem_settles_below(limit: int) -> bool:
    """Whether the host's shared memory is below ``limit`` at one of 20 looks 50 ms apart (other processes on a
    shared host come and go; the run's 128 MiB either is freed or stays)."""
    for _ in range(20):
        if _shmem_bytes() < limit:
            return True
        await anyio.sleep(0.05)
    return False


@root_only
@pytest.mark.parametrize("namespaces", [None, False], ids=["ipc-namespace", "uid-cleanup-only"])
async def test_nothing_a_run_leaves_in_ipc_or_keyrings_reaches_the_next_run(make_sandbox, namespaces):
    uid = TEST_UIDS[-5]
    sandbox = make_sandbox(uids=range(uid, uid + 1), namespaces=namespaces, memory_mb=512)  # one uid: recycled
    secret = f"s3cr3t-{uuid.uuid4().hex}".encode()
    key = 0x5A000000 + int.from_bytes(os.urandom(2), "big") * 8
    mq_name = f"/answers-{uuid.uuid4().hex[:12]}".encode()
    prelude = f"KEY, SECRET, MQ_NAME, CALLS = {key}, {secret!r}, {mq_name!r}, {_ARCH_KEY_CALLS.get(os.uname().machine)}\n"
    baseline = _shmem_bytes()
    left = await sandbox.run(prelude + LEAVE)
    assert left.status == "ok" and "False" not in left.stdout, left  # every object was made (no key: refused)
    # from the host: no SysV object of the run in the host's namespace, its memory given back, no POSIX queue
    assert _sysvipc_of(range(uid, uid + 1)) == []
    assert await _shmem_settles_below(baseline + (64 << 20)), (_shmem_bytes() - baseline) >> 20  # 128 MiB were filled
    if namespaces is None:  # POSIX queues live on only in the IPC namespace, which died with the run
        assert _libc.mq_open(mq_name, os.O_RDONLY, 0, None) < 0 and ctypes.get_errno() == 2  # ENOENT
    # the next run, on the same uid, finds nothing
    found = await sandbox.run(prelude + FIND)
    assert found.status == "ok", found
    expected = [] if namespaces is None else [("mq",)]  # see docs/sandbox.md: POSIX queues need the namespace
    assert eval(found.stdout) == expected and secret.decode() not in found.stdout + found.stderr, found
    if namespaces is False:
        _libc.mq_unlink(mq_name)
    await assert_healthy(sandbox)


def _as_uid(uid: int, code: str) -> None:
    """Run ``code`` in a forked child of this (root) process with ``uid`` as its real and effective uid."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            exec(code, {})
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


@root_only
@pytest.mark.parametrize("namespaces", [None, False], ids=["namespaces", "no-namespaces"])
async def test_state_left_on_a_uid_by_a_host_that_died_is_cleared_before_the_next_run(make_sandbox, namespaces):
    """As if a host had died mid-run: its uid, free again for a new host process, still owns keys and SysV objects."""
    uid = TEST_UIDS[-6] if namespaces is None else TEST_UIDS[-7]
    secret = f"s3cr3t-{uuid.uuid4().hex}".encode()
    key = 0x5B000000 + int.from_bytes(os.urandom(2), "big") * 8
    mq_name = f"/answers-{uuid.uuid4().hex[:12]}".encode()
    prelude = f"KEY, SECRET, MQ_NAME, CALLS = {key}, {secret!r}, {mq_name!r}, {_ARCH_KEY_CALLS.get(os.uname().machine)}\n"
    no_queue = LEAVE.replace("mq = libc.mq_open", "mq = -1  # ").replace("left.append(mq", "0 and left.append(mq")
    _as_uid(uid, prelude + no_queue)  # (POSIX queues outlive a uid without namespaces: docs/sandbox.md)
    assert len(_sysvipc_of(range(uid, uid + 1))) == 5  # planted: 4 segments, 1 queue, and a key
    sandbox = make_sandbox(uids=range(uid, uid + 1), namespaces=namespaces)
    found = await sandbox.run(prelude + FIND)
    assert found.status == "ok" and eval(found.stdout) == [] and secret.decode() not in found.stdout, found
    assert _sysvipc_of(range(uid, uid + 1)) == []


# -- bad file names --------------------------------------------------------------------------------------------------

BAD_FILES = [  # (files, what the message must say)
    ({"solution.py/x": "x"}, "collides"),
    ({"a\0b.py": "x"}, "contains NUL"),
    ({"dir/\0": "x"}, "contains NUL"),
    ({"\udcff.py": "x"}, "UTF-8"),
    ({"": "x"}, "names no file"),
    ({".": "x"}, "names no file"),
    ({"a/": "x"}, "names no file"),
    ({"../x": "x"}, "'..'"),
    ({"a/../../x": "x"}, "'..'"),
    ({"/etc/passwd": "x"}, "absolute"),
    ({"x" * 256: "x"}, "part longer than 255"),
    ({"/".join(["d"] * 600): "x"}, "longer than 1024"),
    ({"a": "x", "a/b": "y"}, "collides"),
    ({"a/b": "y", "a": "x"}, "collides"),
    ({"./a": "x", "a": "y"}, "collides"),
    ({"solution.py": "x"}, "collides"),
    ({"./solution.py": "x"}, "collides"),
    ({5: "x"}, "is a int"),
    ({"ok.txt": 5}, "is a int"),
    ({"ok.txt": "\ud800"}, "UTF-8"),
]


@pytest.mark.parametrize(("files", "says"), BAD_FILES, ids=range(len(BAD_FILES)))
async def test_bad_file_names_are_typed_errors_with_nothing_left_behind(make_sandbox, monkeypatch, tmp_path, files, says):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a private temp dir, to see every leftover
    sandbox = make_sandbox()
    with pytest.raises(InvalidInputError) as caught:
        await sandbox.run("print(1)", files=files)
    assert caught.value.field == "files" and caught.value.fix and says in str(caught.value), caught.value
    assert list(tmp_path.iterdir()) == []


async def test_bad_code_and_stdin_text_are_typed_errors(make_sandbox):
    sandbox = make_sandbox()
    for kwargs, field in (({"code": "print('\ud800')"}, "code"), ({"code": "pass", "stdin": "\udfff"}, "stdin")):
        with pytest.raises(InvalidInputError) as caught:
            await sandbox.run(**kwargs)
        assert caught.value.field == field
    # run_tests refuses them as one InvalidInputError (it raised an ExceptionGroup from its task group)
    good = TestCase(stdin="1", expected_stdout="1")
    for code, tests, kwargs, field in (
        ("print('\ud800')", [good], {}, "code"),
        ("print(input())", [good, TestCase(stdin="\udfff", expected_stdout="")], {}, "tests[1].stdin"),
        ("print(input())", [good], {"timeout_s": math.nan}, "timeout_s"),
        ("print(input())", [good], {"memory_mb": 0}, "memory_mb"),
    ):
        with pytest.raises(InvalidInputError) as caught:
            await sandbox.run_tests(code, tests, **kwargs)
        assert caught.value.field == field
    ok = await sandbox.run("import os\nprint(sorted(os.listdir('d')))", files={"d/a b\n.txt": "1", "d/é.txt": b"\xff"})
    assert (ok.status, ok.stdout) == ("ok", "['a b\\n.txt', 'é.txt']\n"), ok


# -- privileges and host pids ----------------------------------------------------------------------------------------

PRIVILEGES = """
import os
status = dict(line.split(':', 1) for line in open('/proc/self/status'))
print({k: status[k].strip() for k in ('NoNewPrivs', 'CapBnd', 'CapPrm', 'CapEff', 'CapAmb')})
seen = {}
for pid in PIDS:
    try:
        os.kill(pid, 0)
        seen[pid] = 'alive'
    except ProcessLookupError:
        seen[pid] = 'no such process'
    except PermissionError:
        seen[pid] = 'exists'
print(seen)
"""


@root_only
async def test_no_new_privileges_no_capabilities_and_no_host_pids(make_sandbox):
    host_pids = [p for p in (os.getpid(), os.getppid()) if p != 1]  # 1 is the sandbox's own init inside its namespace
    code = f"PIDS = {host_pids}\n{PRIVILEGES}"
    control = await make_sandbox(namespaces=False).run(code)  # the reported gaps: pids of the host answer
    assert control.status == "ok" and eval(control.stdout.splitlines()[1]) == dict.fromkeys(host_pids, "exists")
    result = await make_sandbox().run(code)
    assert result.status == "ok", result
    privileges, seen = map(eval, result.stdout.splitlines())
    assert privileges == {"NoNewPrivs": "1", "CapBnd": "0" * 16, "CapPrm": "0" * 16, "CapEff": "0" * 16, "CapAmb": "0" * 16}
    assert seen == dict.fromkeys(host_pids, "no such process")
    # a set-user-ID program cannot raise privileges either
    su = await make_sandbox().run("import subprocess\nprint(subprocess.run(['su', '-c', 'id -u'], capture_output=True, input=b'').stdout)")
    assert "b'0\\n'" not in su.stdout


@root_only
async def test_a_checkout_under_home_or_a_hidden_path_gone_keeps_the_namespaces(make_sandbox, monkeypatch):
    """The default hides /home, /root and the current directory. Run from a checkout under /home (the usual place),
    the probe covered /home, then found no mount point for the checkout (ENOENT) and turned the namespaces off for
    good: the program read world-readable files under /home and the hidden files, and saw the host's /tmp. Likewise a
    hidden path removed before the first run. Both are out of sight already and skipped."""
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    checkout = tempfile.mkdtemp(prefix="checkout-", dir="/home")
    gone = tempfile.mkdtemp(prefix="gone-", dir="/var/lib")
    try:
        os.chmod(checkout, 0o755)
        env = os.path.join(checkout, ".env")
        with open(env, "w") as f:
            f.write(secret)
        os.chmod(env, 0o644)
        monkeypatch.chdir(checkout)
        sandbox = make_sandbox()
        report = await sandbox.isolation()
        assert report.namespaces and {"/home", checkout} <= set(report.hidden_paths), report
        result = await sandbox.run(f"print(open({env!r}).read())")
        assert result.status == "runtime_error" and secret not in result.stdout + result.stderr, result
        removed = make_sandbox(hidden_paths=[gone])
        os.rmdir(gone)
        assert (await removed.isolation()).namespaces
        await assert_healthy(removed)
    finally:
        shutil.rmtree(checkout)
        shutil.rmtree(gone, ignore_errors=True)


@root_only
async def test_a_hidden_path_above_a_socket_dir_keeps_the_namespaces(make_sandbox):
    sandbox = make_sandbox(hidden_paths=["/var"], namespaces=True)  # /var holds /var/tmp, a socket dir
    result = await sandbox.run("import os\nprint(os.listdir('/var'))")
    assert result.status == "runtime_error" and "PermissionError" in result.stderr, result
    await assert_healthy(sandbox)
