"""Round two of hostile programs: kernel interfaces the seccomp filter must refuse (io_uring runs operations it
never sees; keyrings, shared by every run on the host), and memory a run can hold outside every process's set size
(tmpfs files, memfds, secret memfds, SysV semaphores), which the fallback memory watch must count, bound or refuse.
Each ends typed within its limits and leaves nothing behind (the ``make_sandbox`` fixture checks that no process of
the run's uids is left)."""

from __future__ import annotations

import os

import anyio
import pytest

from .conftest import TEST_UIDS, assert_healthy, processes_of, root_only

pytestmark = pytest.mark.anyio

# io_uring's IORING_OP_SOCKET (Linux >= 5.19) makes a socket without the socket() syscall, so past the filter's
# family check: AF_VSOCK reaches the VM's hypervisor. io_uring_setup is 425 and io_uring_enter 426 on every arch.
IO_URING_SOCKET = """
import ctypes, mmap, os, struct
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
ring_fd = libc.syscall(ctypes.c_long(425), ctypes.c_long(4), params)
if ring_fd < 0:
    print('io_uring_setup', os.strerror(ctypes.get_errno()))
    raise SystemExit
sq_entries, cq_entries = struct.unpack_from('2I', params, 0)
sq_head, sq_tail, sq_mask, _, _, _, sq_array = struct.unpack_from('7I', params, 40)
cq_head, _, cq_mask, _, _, cqes = struct.unpack_from('6I', params, 80)
size = max(sq_array + sq_entries * 4, cqes + cq_entries * 16)
ring = mmap.mmap(ring_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
sqes = mmap.mmap(ring_fd, sq_entries * 64, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0x10000000)
tail = struct.unpack_from('I', ring, sq_tail)[0]
slot = tail & struct.unpack_from('I', ring, sq_mask)[0]
sqe = bytearray(64)
struct.pack_into('BBHi', sqe, 0, 45, 0, 0, 40)  # IORING_OP_SOCKET, fd = domain AF_VSOCK
struct.pack_into('Q', sqe, 8, 1)  # off = type SOCK_STREAM
sqes[slot * 64 : slot * 64 + 64] = bytes(sqe)
struct.pack_into('I', ring, sq_array + slot * 4, slot)
struct.pack_into('I', ring, sq_tail, tail + 1)
libc.syscall(ctypes.c_long(426), ctypes.c_long(ring_fd), ctypes.c_long(1), ctypes.c_long(1), ctypes.c_long(1), None, ctypes.c_long(0))
head = struct.unpack_from('I', ring, cq_head)[0]
res = struct.unpack_from('i', ring, cqes + (head & struct.unpack_from('I', ring, cq_mask)[0]) * 16 + 8)[0]
print('vsock', 'made' if res >= 0 else os.strerror(-res))
"""

_NAMES = "bpf perf_event_open userfaultfd request_key add_key keyctl io_uring_setup io_uring_register memfd_secret".split()
KERNEL_SURFACE = {
    "x86_64": dict(zip(_NAMES, (321, 298, 323, 249, 248, 250, 425, 427, 447))),
    "aarch64": dict(zip(_NAMES, (280, 241, 282, 218, 217, 219, 425, 427, 447))),
}
NOT_IMPLEMENTED = ("io_uring_setup", "io_uring_register", "memfd_secret")  # ENOSYS; the others EPERM
CALL_EACH = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, number in CALLS.items():
    got = libc.syscall(ctypes.c_long(number), 0, 0, 0, 0, 0)
    print(name, got, os.strerror(ctypes.get_errno()))
"""


@pytest.mark.skipif(os.uname().machine not in KERNEL_SURFACE, reason="the seccomp filter knows x86_64 and aarch64")
async def test_io_uring_and_other_kernel_surface_are_refused(make_sandbox):
    """Native code, no socket guard: io_uring cannot even be set up (it made an AF_VSOCK socket past the filter's
    family check); bpf, perf_event_open, userfaultfd and the keyring calls fail with EPERM whatever the host's
    sysctls; memfd_secret with ENOSYS (its pages are in no set size and no mount: without a cgroup a 128 MiB run
    held 384 MiB in secret memfds, mapping 4 MiB at a time under RLIMIT_MEMLOCK)."""
    sandbox = make_sandbox(socket_guard=False)
    uring = await sandbox.run(IO_URING_SOCKET)
    assert (uring.status, uring.stdout) == ("ok", "io_uring_setup Function not implemented\n"), uring
    calls = KERNEL_SURFACE[os.uname().machine]
    result = await sandbox.run(f"CALLS = {calls!r}\n{CALL_EACH}")
    assert result.status == "ok", result
    errors = {name: "Function not implemented" if name in NOT_IMPLEMENTED else "Operation not permitted" for name in calls}
    assert result.stdout.splitlines() == [f"{name} -1 {errors[name]}" for name in calls], result
    await assert_healthy(sandbox)


# Keyrings are not namespaced: a key whose permissions grant "other" view and read (KEYCTL_SETPERM) was listed in
# /proc/keys and read by every other run at the same time, and /proc/key-users shows each uid's key count to all.
PUBLISH_KEY = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
key = libc.syscall(ctypes.c_long(ADD_KEY), b'user', b'answers', SECRET, ctypes.c_size_t(len(SECRET)), ctypes.c_long(-3))
if key < 0:
    print('add_key', os.strerror(ctypes.get_errno()))
    raise SystemExit
libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(5), ctypes.c_long(key), ctypes.c_long(0x3F3F3F3F))  # SETPERM: all, to all
print('published', flush=True)
time.sleep(3)
"""
READ_KEYS = """
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
seen = b''
for _ in range(40):  # for 2 s: every key /proc/keys lists, read where permitted
    for line in open('/proc/keys').read().splitlines():
        data = ctypes.create_string_buffer(256)
        size = libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(11), ctypes.c_long(int(line.split()[0], 16)), data, ctypes.c_long(256))
        seen += data.raw[: max(0, size)]
    if SECRET in seen:
        break
    time.sleep(0.05)
print(SECRET in seen)
"""


@pytest.mark.skipif(os.uname().machine not in KERNEL_SURFACE, reason="the seccomp filter knows x86_64 and aarch64")
async def test_two_runs_at_once_share_nothing_through_keyrings(make_sandbox):
    """A run publishing a key to all (a channel between concurrent runs, e.g. two tests of one program, or two
    episodes) is refused: add_key and keyctl fail with EPERM, as under Docker's default seccomp profile."""
    numbers = KERNEL_SURFACE[os.uname().machine]
    prelude = f"ADD_KEY, KEYCTL, SECRET = {numbers['add_key']}, {numbers['keyctl']}, {os.urandom(8).hex().encode()!r}\n"
    sandbox = make_sandbox(max_concurrency=2)
    results = {}

    async def run(name: str, code: str) -> None:
        results[name] = await sandbox.run(prelude + code)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "publisher", PUBLISH_KEY)
        tg.start_soon(run, "reader", READ_KEYS)
    publisher, reader = results["publisher"], results["reader"]
    assert (publisher.status, publisher.stdout) == ("ok", "add_key Operation not permitted\n"), publisher
    assert (reader.status, reader.stdout) == ("ok", "False\n"), reader
    await assert_healthy(sandbox)


# Semaphores are kernel memory in no set size. A new IPC namespace allows 32,000 sets of 32,000 (64 bytes each).
HOLD_SEMAPHORES = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
per_set = int(open('/proc/sys/kernel/sem').read().split()[0])  # SEMMSL
held = 0
for i in range(100):
    if libc.semget(0x5E000 + i, per_set, 0o1600) < 0:  # IPC_CREAT
        break
    held += per_set
print(held)
"""


@root_only
async def test_sysv_semaphores_are_bounded_in_the_runs_ipc_namespace(make_sandbox):
    """Without a cgroup nothing counted them: a 128 MiB run held 100 sets of 32,000 semaphores (200 MiB of kernel
    memory; the namespace's defaults allow 64 GiB). Its IPC namespace now allows 64 sets of 250 (1 MiB in all)."""
    sandbox = make_sandbox(memory_mb=128, cgroups=False)
    result = await sandbox.run(HOLD_SEMAPHORES)
    assert result.status == "ok" and 0 < int(result.stdout) <= 16_000, result
    await assert_healthy(sandbox)


FILL_TMPFS = """
import os, time
held = 0
for directory in ('/tmp', '/dev/shm', '.'):
    try:
        for i in range(64):
            with open(f'{directory}/fill-{i}', 'wb') as f:
                f.write(b'x' * (1 << 20))
            held += 1
    except OSError:
        pass
print(held, 'MiB held', flush=True)
time.sleep(60)
"""
HOLD_MEMFDS = """
import os, time
held = 0
try:
    for _ in range(40):
        fd = os.memfd_create('hold')
        for _ in range(16):
            os.write(fd, b'x' * (1 << 20))
        held += 16
except OSError as e:
    print('refused', e.strerror, held)
    raise SystemExit
print(held, 'MiB held', flush=True)
time.sleep(60)
"""


@root_only
@pytest.mark.parametrize("cgroups", [None, False], ids=["cgroup-if-allowed", "fallback"])
async def test_memory_held_in_files_and_memfds_counts_against_the_run(make_sandbox, cgroups):
    """Files in the run's tmpfs mounts (working directory, /tmp, /dev/shm: 3 x 64 MiB) and memfds (40 x 16 MiB) are
    memory in no process's set size. A cgroup charges them to the run; the fallback's watch counts the tmpfs
    mounts, and memfd_create, which it cannot see, is refused there. Either way the run never holds them past
    ``memory_mb`` (before, the fallback let a 128 MiB run hold 191 MiB of files and 640 MiB of memfds)."""
    sandbox = make_sandbox(memory_mb=128, timeout_s=20.0, cgroups=cgroups)
    layer = (await sandbox.isolation()).cgroup
    assert (layer is None) if cgroups is False else True
    files = await sandbox.run(FILL_TMPFS)
    assert files.status == "memory", files
    memfds = await sandbox.run(HOLD_MEMFDS)
    if layer:
        assert memfds.status == "memory", memfds
    else:
        assert (memfds.status, memfds.stdout) == ("ok", "refused Function not implemented 0\n"), memfds
    small = await sandbox.run("import os\nfd = os.memfd_create('x')\nos.write(fd, b'x' * 4096)\nprint('ok')")
    assert small.stdout == ("ok\n" if layer else ""), small  # with a cgroup, memfds work as usual
    await assert_healthy(sandbox)


SPIN_IN_SESSIONS = """
import os
for _ in range(40):
    try:
        if os.fork() == 0:
            os.setsid()  # a session, so an autogroup, of its own: one more full share of the CPUs
            break
    except OSError:
        break
while True:
    pass
"""
NEEDS_ONE_CPU_SECOND = "import time\nwhile time.process_time() < 1.0:\n    pass\nprint('done')"


@root_only
async def test_a_run_spinning_in_many_sessions_does_not_starve_another(make_sandbox):
    """32 spinning processes, each in a session of its own, got 32 shares of the CPUs against a concurrent run's one:
    an innocent program needing 1 s of CPU timed out after 10 s. The run's cgroup holds all of them to ``cpus``
    (v2 cpu.max, v1 cpu.cfs_quota_us), and one share."""
    sandbox = make_sandbox(max_concurrency=2, timeout_s=10.0, max_processes=32)
    if (await sandbox.isolation()).cgroup is None:
        pytest.skip("no cgroup per run on this host")
    results = {}

    async def spin() -> None:
        results["spin"] = await sandbox.run(SPIN_IN_SESSIONS, timeout_s=60.0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(spin)
        while len(processes_of(TEST_UIDS)) < 30 and "spin" not in results:  # until it spins in full (or ended)
            await anyio.sleep(0.01)
        assert "spin" not in results, results
        victim = await sandbox.run(NEEDS_ONE_CPU_SECOND)
        tg.cancel_scope.cancel()  # stops the spinning run (as a cancelled run is stopped)
    assert (victim.status, victim.stdout) == ("ok", "done\n"), victim
    assert "spin" not in results
    await assert_healthy(sandbox)


async def test_a_correct_program_can_use_a_pool_of_sixteen_threads(make_sandbox):
    """glibc reserves 64 MiB of address space per malloc arena (one per thread, up to 8 per CPU): under RLIMIT_AS at
    256 MiB only 5 threads could start, and a correct program with a thread pool failed. Threads stay bounded by
    RLIMIT_NPROC and the address space (8 MiB of stack each)."""
    code = (
        "import threading\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "barrier = threading.Barrier(16)\n"
        "with ThreadPoolExecutor(16) as pool:\n"
        "    print(sum(pool.map(lambda x: barrier.wait() * 0 + x * x, range(16))))\n"  # 16 threads at once
        "go = threading.Event()\n"
        "started = 0\n"
        "try:\n"
        "    for _ in range(1000):\n"
        "        threading.Thread(target=go.wait, daemon=True).start()\n"
        "        started += 1\n"
        "except RuntimeError:\n"
        "    pass\n"
        "go.set()\n"
        "print(16 <= started < 1000)\n"
    )
    result = await make_sandbox(memory_mb=256).run(code)
    assert (result.status, result.stdout) == ("ok", "1240\nTrue\n"), result
