"""Supervisor of one sandboxed run (stdlib only: it runs under the sandbox's interpreter as ``python -I -S -B``).

LocalSandbox starts it (as root where it can) with a JSON config in argv[1]. It

0. kills any process of the run's uid and clears what the uid keeps in the kernel (left by a host that died);
1. reads the program and its files from the working directory;
2. with ``namespaces``: enters fresh mount, network, IPC, UTS and PID namespaces -- no network interfaces but a
   down loopback, private SysV/POSIX IPC with capped sizes, the whole filesystem read-only, ``hidden_paths``
   covered by empty unreadable mounts, ``hidden_files`` by /dev/null, ``socket_dirs`` (/run, /var/tmp, ...) by empty root-owned tmpfs (/tmp
   and /dev/shm by empty writable ones of the run's own), any other host unix socket by /dev/null, /dev/pts a small devpts instance of its own, and the working directory a private
   size-capped tmpfs -- and writes the files back into the tmpfs;
3. becomes a child subreaper and forks a child that joins the run's cgroup (``cgroup_fds``) and, with
   namespaces, is pid 1 of the new PID namespace: in a mount namespace of its own it covers /sys, mounts a /proc
   of that namespace and forks the program's
   process (pid 2), reaping orphans until it exits. The program's process sets its rlimits, takes a session keyring
   of its own, sets no_new_privs, refuses new user namespaces, exotic socket families, io_uring, keyrings and other
   kernel surface (seccomp), empties its capability bounding set, drops to the sandbox uid, makes itself not
   dumpable (no core, whatever ``core_pattern`` says), installs the socket guard and runs the code;
4. waits for it (with ``memory_watch``: killing the run once its processes' memory sums past ``memory_mb``),
   kills and reaps everything the program left behind, clears what the uid keeps in the kernel (keyrings,
   SysV IPC objects), and writes one JSON line to the status fd:
   ``{"started", "exit_code" | "signal", "cpu_s", "stopped", "memory_exceeded"}``, or ``{"error"}``.

SIGTERM from the host means stop now (timeout, output cap): kill, reap, report. The supervisor stays root,
so the program cannot signal, trace or read it.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time
import traceback

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x4000000, 0x8000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x1, 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
_PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 4, 36, 24, 38
_KEYCTL_JOIN_SESSION_KEYRING, _KEYCTL_CLEAR, _KEYCTL_LINK, _KEYCTL_GET_PERSISTENT = 1, 7, 8, 22
_KEY_SPEC_SESSION_KEYRING, _KEY_SPEC_USER_KEYRING, _KEY_SPEC_USER_SESSION_KEYRING = -3, -4, -5
_IPC_RMID = 0
_MAX_PTYS = 16  # pseudo-terminals a run may hold at once
_M_ARENA_MAX = -8  # mallopt parameter
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, _CLONE_NEWUSER = 22, 2, 0x10000000
_SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK: network-namespaced, in every kernel
# Per architecture: the audit arch seccomp reports; the numbers of unshare, clone, clone3, socket, socketpair,
# setrlimit and prlimit64.
_SECCOMP_ARCH = {
    "x86_64": (0xC000003E, 272, 56, 435, 41, 53, 160, 302),
    "aarch64": (0xC00000B7, 97, 220, 435, 198, 199, 164, 261),
}
_ENOSYS, _EPERM = 38, 1
# Refused outright, per architecture: syscall number -> errno. io_uring (setup, enter, register) runs operations the
# filter never sees (IORING_OP_SOCKET makes an AF_VSOCK socket past the family check); bpf, perf_event_open,
# userfaultfd and request_key (an upcall to a host helper, as root) are kernel attack surface a grader never needs;
# so are add_key and keyctl, and keyrings are not namespaced: a key a run made readable by all ("other" permissions)
# was read by every run at the same time. memfd_secret (447): its pages are in no set size and in no mount.
_REFUSED = {
    "x86_64": {**dict.fromkeys((425, 426, 427, 447), _ENOSYS), **dict.fromkeys((321, 298, 323, 249, 248, 250), _EPERM)},
    "aarch64": {**dict.fromkeys((425, 426, 427, 447), _ENOSYS), **dict.fromkeys((280, 241, 282, 218, 217, 219), _EPERM)},
}
# memfd_create, refused (ENOSYS) where no cgroup counts a run's memory: a memfd's pages are in no process's set size
# and in no mount the memory watch can measure, and a run could hold 256 of workdir_mb each.
_MEMFD_CREATE = {"x86_64": 319, "aarch64": 279}
# RLIMIT_CORE of the program: 1 byte, which writes no core file (below the format's minimum) and which the kernel
# reads as "no core" for a pipe core_pattern too (it ignores the limit otherwise, and 0 means no limit there)
_CORE_LIMIT, _RLIMIT_CORE = 1, 4
# Private writable tmpfs (``workdir_mb`` each) among the socket dirs: multiprocessing's semaphores go in /dev/shm,
# ordinary programs' temp files in /tmp. The rest are covered read-only.
_PRIVATE_DIRS = ("/tmp", "/dev/shm")
_WATCH_INTERVAL_S = 0.02
_AF_UNIX = 1
_NETWORK_EVENTS = {
    "socket.bind",
    "socket.connect",
    "socket.sendto",
    "socket.sendmsg",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "socket.getnameinfo",
}
_libc = ctypes.CDLL(None, use_errno=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cgroups  # noqa: E402  (stdlib only, like this file)

del sys.path[0]


def _note_signal(signum, frame):
    """SIGTERM and SIGCHLD only wake the supervisor up (through the wakeup fd); nothing is raised mid-cleanup."""


def _call(name, *args):
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data):
    _call("mount", source, target.encode(), fstype, ctypes.c_ulong(flags), data)


def _host_socket_paths():
    """Pathname unix sockets bound in this network namespace (read before leaving it)."""
    try:
        with open("/proc/net/unix") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return []
    fields = [line.split(None, 7) for line in lines]
    return sorted({f[7] for f in fields if len(f) > 7 and f[7].startswith("/")})


def _limit_ipc(memory_mb):
    """Cap SysV shared memory, message queues and semaphores in the new IPC namespace (its sysctls are per namespace).
    ``kernel/sem`` is SEMMSL SEMMNS SEMOPM SEMMNI: the namespace's default allows 32,000 sets of 32,000 semaphores of
    64 bytes each, kernel memory that no set size shows; 64 sets of 250 take 1 MiB."""
    pages = max(1, (memory_mb << 20) // os.sysconf("SC_PAGE_SIZE"))
    for name, value in (
        ("kernel/shmmax", memory_mb << 20),
        ("kernel/shmall", pages),
        ("kernel/shmmni", 64),
        ("kernel/msgmni", 64),
        ("kernel/sem", "250 32000 32 64"),
    ):
        try:
            with open(f"/proc/sys/{name}", "w") as f:
                f.write(str(value))
        except OSError:  # a read-only /proc/sys: the namespace is still private and dies with the run
            pass


def _enter_namespaces(cfg, uid, gid):
    """Fresh mount, network, IPC, UTS and PID namespaces (the next child is pid 1 of the new one)."""
    sockets = _host_socket_paths()
    _call("unshare", _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS | _CLONE_NEWPID)
    _limit_ipc(cfg["memory_mb"])
    _call("mount", None, b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None)  # nothing propagates to the host
    attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    args = (ctypes.c_long(_AT_FDCWD), b"/", ctypes.c_long(_AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _call("syscall", ctypes.c_long(_SYS_MOUNT_SETATTR), *args)  # every mount read-only (Linux >= 5.12)
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    covered: list[str] = []
    # A path under one covered before it (sorted: /home before /home/me/repo, the default's current directory there)
    # has no mount point left, and one removed meanwhile nothing to hide: mounting on either failed with ENOENT, which
    # turned the namespaces off for good.
    for path in sorted(cfg["hidden_paths"]):
        if os.path.isdir(path) and not any(os.path.commonpath([path, c]) == c for c in covered):
            _mount(b"tmpfs", path, b"tmpfs", flags | _MS_RDONLY, b"size=4k,nr_inodes=2,mode=0")
            covered.append(path)
    # /run, /var/tmp, ...: empty, root-owned, not writable by the run; /tmp and /dev/shm empty and writable, the
    # run's own (gone with its mount namespace)
    private = f"size={cfg['workdir_mb']}m,nr_inodes=4096,mode=1777".encode()
    for path in cfg["socket_dirs"]:
        if not any(os.path.commonpath([path, c]) == c for c in covered):  # (one under a hidden path is hidden)
            _mount(b"tmpfs", path, b"tmpfs", flags, private if path in _PRIVATE_DIRS else b"size=64k,nr_inodes=64,mode=0755")
            covered.append(path)
    for path in sockets:  # any other socket the host has bound: covered by /dev/null, connect() is refused
        if not any(os.path.commonpath([path, c]) == c for c in covered):
            try:
                _mount(b"/dev/null", path, None, _MS_BIND, None)
            except OSError:  # gone meanwhile, or not reachable
                pass
    try:  # ptys from a small pool of the run's own (the host's, kernel.pty.max, is shared by everything on it)
        _mount(b"devpts", "/dev/pts", b"devpts", _MS_NOSUID | _MS_NOEXEC, f"newinstance,ptmxmode=0666,max={_MAX_PTYS}".encode())
    except OSError:  # no /dev/pts, or devpts refused: the host's pool, rather than no namespaces at all
        pass
    os.makedirs(cfg["workdir"], mode=0o755, exist_ok=True)  # inside a covered directory, if it was in one
    owner = "" if uid is None else f",uid={uid},gid={gid}"
    options = f"size={cfg['workdir_mb']}m,nr_inodes={cfg['workdir_inodes']},mode=0700{owner}"
    _mount(b"tmpfs", cfg["workdir"], b"tmpfs", flags, options.encode())


def _hide_files(cfg):
    """Cover ``hidden_files`` (a grader's test data) with /dev/null: they read as empty. One under a covered directory
    is out of sight already, and one removed meanwhile shows nothing."""
    covered = [*cfg["hidden_paths"], *cfg["socket_dirs"]]
    for path in cfg["hidden_files"]:
        if not any(os.path.commonpath([path, c]) == c for c in covered) and os.path.lexists(path):
            _mount(b"/dev/null", path, None, _MS_BIND, None)


def _mount_proc():
    """In the program's process, pid 1 of the new PID namespace: a /proc that shows that namespace only (the
    supervisor's too: its memory watch lists the run's processes there, not the host's), then a mount namespace of
    its own below the supervisor's with /sys (the host's: its cgroup tree, with the other runs' leaves, network
    interfaces, devices) covered by an empty directory. The supervisor keeps /sys, to read its run's cgroup."""
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    try:
        _mount(b"proc", "/proc", b"proc", flags, b"hidepid=invisible")
    except OSError:
        _mount(b"proc", "/proc", b"proc", flags, b"hidepid=2")  # kernels before 5.8
    _call("unshare", _CLONE_NEWNS)
    _mount(b"tmpfs", "/sys", b"tmpfs", flags | _MS_RDONLY, b"size=4k,nr_inodes=2,mode=0555")


def _keyctl(*args):
    number = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
    if number is None:
        return -1
    return _libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _assemble(program):
    """Classic BPF from ``(code, k, label if true, label if false)`` tuples, with ``"label"`` strings in between."""
    labels: dict = {}
    insns: list = []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(insns)
        else:
            insns.append(item)
    filters = (_SockFilter * len(insns))()
    for i, (code, k, jt, jf) in enumerate(insns):
        filters[i] = _SockFilter(code, labels[jt] - i - 1 if jt else 0, labels[jf] - i - 1 if jf else 0, k)
    return filters


def _seccomp(refuse_memfd):
    """A seccomp filter. ``unshare``/``clone`` asking for a new user namespace fail with EPERM (inside one, the
    program would hold every capability, whatever its bounding set); ``clone3``, whose flags a filter cannot read,
    fails with ENOSYS, so libc falls back to ``clone``. ``socket``/``socketpair`` of a family other than
    ``_SOCKET_FAMILIES`` fail with EAFNOSUPPORT (AF_VSOCK reaches the hypervisor past the network namespace).
    Setting RLIMIT_CORE (``setrlimit``, ``prlimit64``) succeeds without effect: lowered to 0 it would let a pipe
    ``core_pattern`` hand the program's core to a host helper again.
    The syscalls in ``_REFUSED`` (and, with ``refuse_memfd``, memfd_create) fail with their errno.
    A syscall of another ABI (x32, i386) fails with EPERM."""
    machine = os.uname().machine
    arch = _SECCOMP_ARCH.get(machine)
    if arch is None:
        return
    audit_arch, unshare, clone, clone3, socket, socketpair, setrlimit, prlimit64 = arch
    refused = dict(_REFUSED[machine])
    if refuse_memfd:
        refused[_MEMFD_CREATE[machine]] = _ENOSYS
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, errno = 0x7FFF0000, 0x50000
    program = [
        (ld, 4, None, None),  # the architecture
        (jeq, audit_arch, None, "deny"),
        (ld, 0, None, None),  # the syscall number
        (jge, 0x40000000, "deny", None),  # x32
        (jeq, clone3, "enosys", None),
        (jeq, unshare, "flags", None),
        (jeq, clone, "flags", None),
        (jeq, socket, "family", None),
        (jeq, socketpair, "family", None),
        (jeq, setrlimit, "setrlimit", None),
        (jeq, prlimit64, "prlimit64", None),
        *((jeq, number, {_EPERM: "deny", _ENOSYS: "enosys"}[err], None) for number, err in sorted(refused.items())),
        (ret, allow, None, None),
        "flags",
        (ld, 16, None, None),  # the low half of the first argument (both architectures are little-endian)
        (jset, _CLONE_NEWUSER, "deny", None),
        (ret, allow, None, None),
        "family",
        (ld, 16, None, None),
        *((jeq, family, "allow", None) for family in _SOCKET_FAMILIES),
        (ret, errno | 97, None, None),  # EAFNOSUPPORT
        "setrlimit",
        (ld, 16, None, None),  # the resource
        (jeq, _RLIMIT_CORE, "ignore", "allow"),
        "prlimit64",
        (ld, 24, None, None),  # the resource
        (jeq, _RLIMIT_CORE, None, "allow"),
        (ld, 32, None, None),  # the new limit's pointer, low half then high half: NULL only reads the limit
        (jeq, 0, None, "ignore"),
        (ld, 36, None, None),
        (jeq, 0, "allow", "ignore"),
        "allow",
        (ret, allow, None, None),
        "deny",
        (ret, errno | _EPERM, None, None),
        "enosys",
        (ret, errno | _ENOSYS, None, None),
        "ignore",
        (ret, errno | 0, None, None),  # returns 0: done, as far as the program can tell
    ]
    filters = _assemble(program)
    fprog = _SockFprog(len(filters), filters)
    _call("prctl", _PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(fprog), 0, 0)


def _harden(root, refuse_memfd):
    """No privilege gain through exec (setuid binaries, file capabilities), no user namespaces, exotic sockets or
    io_uring, and (as root) no capabilities to gain."""
    _call("prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _seccomp(refuse_memfd)
    if not root:
        return
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _call("prctl", _PR_CAPBSET_DROP, cap, 0, 0, 0)


def _clear_uid_state(uid):
    """What a run's uid keeps in the kernel after its processes are gone: its keyrings, its SysV IPC objects.

    Done as that uid (real and effective; root stays the saved uid, to come back), once all of its processes are
    dead: after each run, and before each run in the host's IPC namespace (for a host process that died before
    clearing). The run's IPC namespace, when there is one, frees its objects itself when it dies.
    """
    os.setresgid(uid, uid, 0)
    os.setresuid(uid, uid, 0)
    try:
        # A session keyring of the uid's own with its user keyring linked in: what is reachable from there is
        # "possessed", and only possession grants the right to clear the persistent keyring.
        _keyctl(_KEYCTL_JOIN_SESSION_KEYRING, 0)
        _keyctl(_KEYCTL_LINK, _KEY_SPEC_USER_KEYRING, _KEY_SPEC_SESSION_KEYRING)
        persistent = _keyctl(_KEYCTL_GET_PERSISTENT, -1, _KEY_SPEC_SESSION_KEYRING)
        if persistent > 0:
            _keyctl(_KEYCTL_CLEAR, persistent)
        for spec in (_KEY_SPEC_USER_KEYRING, _KEY_SPEC_USER_SESSION_KEYRING):
            _keyctl(_KEYCTL_CLEAR, spec)
    finally:
        os.setresuid(0, 0, 0)
        os.setresgid(0, 0, 0)
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                rows = [line.split() for line in f.read().splitlines()[1:]]
        except OSError:
            continue
        uid_col, cuid_col = {"shm": (7, 9), "msg": (7, 9), "sem": (4, 6)}[kind]  # owner, creator
        for row in rows:
            if len(row) > cuid_col and uid in (int(row[uid_col]), int(row[cuid_col])):
                if kind == "sem":
                    _libc.semctl(int(row[1]), 0, _IPC_RMID)
                else:
                    getattr(_libc, f"{kind}ctl")(int(row[1]), _IPC_RMID, None)


def _read_tree(root):
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


def _write_tree(root, files):
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def _chown_tree(root, uid, gid):
    for dirpath, _, names in os.walk(root):
        os.chown(dirpath, uid, gid)
        for name in names:
            os.chown(os.path.join(dirpath, name), uid, gid)


def _prepare(cfg):
    """Steps 1-2; returns the program's source."""
    workdir, uid, gid = cfg["workdir"], cfg["uid"], cfg["gid"]
    files = _read_tree(workdir)
    if cfg["namespaces"]:
        try:
            _enter_namespaces(cfg, uid, gid)
        except OSError as exc:  # the host degrades on this message only, never on other setup failures
            raise RuntimeError(f"namespaces unavailable: {exc}") from exc
        _hide_files(cfg)  # (a failure here fails the run, and never turns the namespaces off)
        _write_tree(workdir, files)
    if uid is not None:
        _chown_tree(workdir, uid, gid)
    return files[cfg["code_file"]].decode()


def _set_limit(kind, value):
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def _set_limits(cfg):
    _set_limit(resource.RLIMIT_AS, cfg["memory_mb"] << 20)
    # glibc reserves 64 MiB of address space per malloc arena, one per thread up to 8 per CPU: under RLIMIT_AS that
    # left room for 5 threads at 256 MiB. Two arenas are plenty for the program's threads (its GIL serialises them).
    mallopt = getattr(_libc, "mallopt", None)
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, 2)
    _set_limit(resource.RLIMIT_NPROC, cfg["max_processes"])
    _set_limit(resource.RLIMIT_FSIZE, cfg["workdir_mb"] << 20)
    _set_limit(resource.RLIMIT_NOFILE, 256)
    _set_limit(resource.RLIMIT_CORE, _CORE_LIMIT)
    _set_limit(resource.RLIMIT_MSGQUEUE, 1 << 20)  # POSIX message queue bytes
    # Not the host's: where those allow it (``ulimit -r``/``-e``), SCHED_FIFO would spin past cpu.max and starve
    # every other process on its CPU, and a negative nice would outrank them.
    _set_limit(resource.RLIMIT_RTPRIO, 0)
    _set_limit(resource.RLIMIT_NICE, 0)
    cpu = cfg["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later


def _socket_guard(event, args):
    if event in _NETWORK_EVENTS or (event == "socket.__new__" and args[1] != _AF_UNIX):
        raise PermissionError(f"network access is disabled in this sandbox ({event})")


def _child(cfg, source, sync_w, exit_w):
    """The supervisor's child: joins the run's cgroup; with namespaces it is pid 1 of the new PID namespace, mounts
    its /proc and becomes the init of the program's process (pid 2), else it becomes the program's process."""
    try:
        for fd in cfg["cgroup_fds"]:  # first: all it starts is inside
            os.write(fd, b"0")
            os.close(fd)
        if cfg["namespaces"]:
            _mount_proc()
            pid = os.fork()
        else:
            pid = 0
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    if pid == 0:
        os.close(exit_w)
        _program(cfg, source, sync_w)
    else:
        os.close(sync_w)
        _init(pid, exit_w)


def _init(pid, exit_w):
    """Pid 1 of the run (stays root, so the program cannot signal it; it ignores signals from inside anyway).

    The program runs as pid 2, so signals it sends itself behave as usual. Reaps every orphan until the program
    exits, then reports the program's exit on ``exit_w`` and exits, which kills whatever is left in the namespace.
    """
    while True:
        try:
            done, wait_status, rusage = os.wait4(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if done == pid:
            os.write(exit_w, json.dumps(_exit_fields(wait_status, rusage)).encode())
            os._exit(0)


def _program(cfg, source, sync_w):
    """The program's process: confine itself, tell the supervisor it is ready, run the code."""
    try:
        _set_limits(cfg)
        _keyctl(_KEYCTL_JOIN_SESSION_KEYRING, 0)  # a fresh, empty session keyring, not the host's (before the filter)
        _harden(root=cfg["uid"] is not None, refuse_memfd=cfg["cgroup"] is None)
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        # No core dump of this process whatever fs.suid_dumpable says (exec makes a program dumpable again: there
        # RLIMIT_CORE stops the dump); not traceable by other processes of the uid either.
        _call("prctl", _PR_SET_DUMPABLE, 0, 0, 0, 0)
        os.chdir(cfg["workdir"])
        if cfg["namespaces"] and "/tmp" in cfg["socket_dirs"]:
            os.environ["TMPDIR"] = "/tmp"  # its own, private /tmp (else the working directory, set by the host)
        if cfg["socket_guard"]:
            sys.addaudithook(_socket_guard)
        os.write(sync_w, b"1")  # the pipe stays open: a MemoryError is said there too
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    sys.argv = [cfg["code_file"]]
    sys.path.insert(0, cfg["workdir"])
    scope = {"__name__": "__main__", "__file__": os.path.join(cfg["workdir"], cfg["code_file"]), "__builtins__": __builtins__}
    program = os.getpid()
    try:
        exec(compile(source, cfg["code_file"], "exec"), scope)
    except SystemExit:
        raise
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__ and exc.__traceback__.tb_next)  # hide this frame
        if isinstance(exc, MemoryError):  # said on the pipe, so that every exit status stays the program's own
            if os.getpid() == program:  # (not in a fork of it)
                os.write(sync_w, b"M")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)
        sys.exit(1)


def _exit_fields(wait_status, rusage):
    fields = {"cpu_s": rusage.ru_utime + rusage.ru_stime}
    if os.WIFSIGNALED(wait_status):
        fields["signal"] = os.WTERMSIG(wait_status)
    else:
        fields["exit_code"] = os.WEXITSTATUS(wait_status)
    return fields


def _children():
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(pid) for pid in f.read().split()]
    except FileNotFoundError:  # kernel without CONFIG_PROC_CHILDREN
        return []


def _kill_uid(uid, in_pid_namespace):
    """SIGKILL every process of ``uid`` at once (kill(-1) is atomic against fork), as that uid.

    In a PID namespace the run cannot see us, so we take the uid ourselves for a moment (a fork would fail once
    the namespace's init is gone). Outside one, a process of the run could signal us while we held its uid, so a
    child of ours does it.
    """
    if not in_pid_namespace:
        killer = os.fork()
        if killer != 0:
            os.waitpid(killer, 0)
            return
    os.setresuid(uid, uid, 0)
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        if not in_pid_namespace:
            os._exit(0)
        os.setresuid(0, 0, 0)


def _memory_in_use(uid):
    """Proportional set size (shared pages split among their users), in bytes, of all processes of ``uid``."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) << 10
                        break
        except (OSError, ValueError):  # exited meanwhile
            continue
    return total


def _reap_all(main_pid, uid, report, in_pid_namespace, set_up):
    """Kill the program and everything it started, and reap it all (``set_up``: the program's process said it was
    ready, so it runs as the run's uid).

    We are a subreaper, so a living descendant always has us as an ancestor of its parent chain: when wait4(-1)
    reports no children left, nothing the program started is left either.
    """
    if "cpu_s" not in report and not set_up:  # stopped during its set-up: not reaped, so its pid is still ours
        # First, as root: the program's process may not have dropped to the uid yet, out of kill(-1)'s reach (it would
        # go on to run the program, which nothing would stop). Dying, it can fork no more; with a PID namespace it is
        # the init, whose death kills everything in the namespace. (Once set up, the init reports the program's
        # exit and CPU time, so it is left to do that.)
        try:
            os.kill(main_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if uid is not None:
        _kill_uid(uid, in_pid_namespace)  # all of them are doomed now; we only wait
    flags = 0 if uid is not None else os.WNOHANG  # without a uid, keep killing what shows up
    while True:
        for pid in _children():  # orphans of the program, re-parented to us (a hint: this file may lag)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            pid, wait_status, rusage = os.wait4(-1, flags)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.005)
        elif pid == main_pid and "cpu_s" not in report:
            report.update(_exit_fields(wait_status, rusage))


def _shared_memory_in_use(cfg):
    """Bytes the run holds in shared memory that no process may map, so that no set size counts it: files in its
    private tmpfs mounts (working directory, /tmp, /dev/shm; open and unlinked ones too) and its SysV segments.
    Mapped pages count again in the processes' set sizes (an overcount, on the safe side)."""
    total = 0
    if cfg["namespaces"]:
        seen = set()
        for path in (cfg["workdir"], *(d for d in _PRIVATE_DIRS if d in cfg["socket_dirs"])):
            try:
                device = os.stat(path).st_dev
                if device not in seen:
                    seen.add(device)
                    fs = os.statvfs(path)
                    total += (fs.f_blocks - fs.f_bfree) * fs.f_frsize
            except OSError:
                continue
    try:  # the run's own IPC namespace, or the host's (then its uid's segments only)
        with open("/proc/sysvipc/shm") as f:
            rows = [line.split() for line in f.read().splitlines()[1:]]
    except OSError:
        return total
    for row in rows:
        if len(row) > 14 and (cfg["namespaces"] or cfg["uid"] in (int(row[7]), int(row[9]))):
            total += int(row[14])
    return total


def _over_budget(cfg):
    """Whether the run went over its memory: the cgroup's OOM killer acted, or (no cgroup) what its processes and
    its shared memory hold together."""
    if cfg["cgroup"]:
        return _cgroups.RunCgroup(**cfg["cgroup"]).oom_kills() > 0
    return _memory_in_use(cfg["uid"]) + _shared_memory_in_use(cfg) > cfg["memory_mb"] << 20


def _wait(pid, wake_r, report, cfg):
    """Until the program exits (its status goes into ``report``), goes over its memory, or the host sends SIGTERM.

    Memory is checked every 20 ms: a cgroup's OOM kill ends the whole run (cgroup v1 would kill only the largest
    process); without a cgroup, this is the memory limit over all of the run's processes.
    """
    watch = cfg["uid"] is not None and (cfg["cgroup"] or cfg["memory_watch"])
    while True:
        done, wait_status, rusage = os.wait4(pid, os.WNOHANG)
        if done:
            report.update(_exit_fields(wait_status, rusage))
            return
        ready, _, _ = select.select([wake_r], [], [], _WATCH_INTERVAL_S if watch else None)
        if ready and signal.SIGTERM in os.read(wake_r, 256):  # else: a SIGCHLD, or time to check memory
            report["stopped"] = True
            return
        if watch and _over_budget(cfg):
            report["memory_exceeded"] = True
            return


def _read_available(fd):
    """What ``fd`` (non-blocking) holds now."""
    data = b""
    try:
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    except BlockingIOError:
        pass
    return data


def _supervise(pid, sync_r, wake_r, exit_r, cfg):
    report: dict = {}
    _wait(pid, wake_r, report, cfg)
    os.set_blocking(sync_r, False)
    said = _read_available(sync_r)  # b"1" once set up (as the run's uid), then b"M" on a MemoryError
    _reap_all(pid, cfg["uid"], report, cfg["namespaces"], set_up=said[:1] == b"1")
    os.set_blocking(exit_r, False)
    try:  # with namespaces ``pid`` was the init; the program's own exit, as its init saw it
        report.update(json.loads(os.read(exit_r, 4096) or b"{}"))
    except BlockingIOError:
        pass
    if cfg["uid"] is not None:
        _clear_uid_state(cfg["uid"])
    said += _read_available(sync_r)  # every writer is gone by now
    report["started"] = said[:1] == b"1"
    if b"M" in said[1:]:
        report["memory_exceeded"] = True
    if not report["started"] and not report.get("stopped"):
        report["error"] = "the program's process failed to set up (see stderr)"
    return report


def _emit(fd, report):
    os.write(fd, (json.dumps(report) + "\n").encode())


def main():
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, _note_signal)
    signal.signal(signal.SIGCHLD, _note_signal)
    try:
        if cfg["uid"] is not None:  # whatever a run on this uid left behind that the last supervisor did not clear
            _kill_uid(cfg["uid"], in_pid_namespace=False)
            _clear_uid_state(cfg["uid"])
        source = _prepare(cfg)
        _call("prctl", _PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        sync_r, sync_w = os.pipe()
        exit_r, exit_w = os.pipe()
        pid = os.fork()
    except Exception as exc:
        _emit(status_fd, {"started": False, "error": f"sandbox setup failed: {type(exc).__name__}: {exc}"})
        return
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (status_fd, sync_r, exit_r, wake_r, wake_w):
            os.close(fd)
        _child(cfg, source, sync_w, exit_w)
        return
    for fd in [sync_w, exit_w, *cfg["cgroup_fds"]]:
        os.close(fd)
    try:  # on a loaded host, the memory watch must still get its turn when its timer fires
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except OSError:  # not root
        pass
    _emit(status_fd, _supervise(pid, sync_r, wake_r, exit_r, cfg))
    os._exit(0)  # all is reported: skip the interpreter's clean-up (the program's process returns instead)


if __name__ == "__main__":
    main()
