"""LocalSandbox: runs untrusted Python in a confined child process on this machine.

Layers (see docs/sandbox.md): a private working directory; a scrubbed environment and ``python -I -S -B``;
rlimits on CPU time, address space, processes, file size and open files; no core dumps; no_new_privs; a
seccomp filter refusing new user namespaces, socket families other than unix, inet, inet6 and netlink, io_uring and
other kernel surface; a wall-clock timeout and an output cap enforced here; when run as root, a dedicated unprivileged uid per run with an empty
capability bounding set, fresh mount, network, IPC, UTS and PID namespaces (read-only filesystem, host unix
sockets and temp dirs covered, hidden host directories, tmpfs working directory, /tmp and /dev/shm, a /proc of
the run's own processes), a cgroup leaf per run (or a memory watch over all of the run's processes), and the uid's keyrings
and IPC objects cleared before it is used again; an in-process socket guard; and a supervisor that kills and
reaps everything the program started.
"""

from __future__ import annotations

import contextlib
import functools
import grp
import json
import logging
import math
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath

import anyio
from anyio.abc import ByteReceiveStream, Process
from pydantic import BaseModel

from asyncsess.errors import InvalidInputError
from asyncsess.sandbox import _cgroups
from asyncsess.sandbox._uids import UidLease, acquire_uid
from asyncsess.sandbox.base import BaseSandbox, Files, PerLoop
from asyncsess.sandbox.inputs import check_files, check_limit, encode_text
from asyncsess.sandbox.results import ExecutionResult, ExecutionStatus

__all__ = ["Isolation", "LocalSandbox"]

log = logging.getLogger(__name__)

_FALLBACK_NOTE = (
    "memory over all of a run's processes is bounded by the supervisor, which sums their proportional set size "
    "every 20 ms and kills the run over memory_mb (allocations faster than that can overshoot briefly); "
    "processes by RLIMIT_NPROC per uid; CPU by RLIMIT_CPU per process"
)

CODE_FILE = "solution.py"
_BOOTSTRAP = Path(__file__).with_name("_bootstrap.py")
_UNSTARTED = "the sandbox could not run the program"  # a host-side OSError starting a run: its stderr begins so
_STOP_GRACE_S = 5.0  # how long the supervisor gets to kill and reap after SIGTERM before we SIGKILL it
_PATH = "/usr/local/bin:/usr/bin:/bin"
# Where hosts keep unix sockets and shared scratch files; each is covered by an empty tmpfs in a run's mounts.
_SOCKET_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/var/run", "/dev/mqueue")
_WORKDIR_INODES = 4096  # nr_inodes of the run's working directory (a tmpfs), its root included


class Isolation(BaseModel):
    """Which isolation layers a LocalSandbox applies on this host; ``notes`` explains each missing one."""

    privilege_drop: bool
    namespaces: bool
    cgroup: str | None
    """``"v2"`` or ``"v1"``: memory, processes (and with v2 CPU) limited per run by a cgroup leaf; ``None``: the
    fallback (the supervisor sums the memory of the run's processes and kills the run over budget)."""
    socket_guard: bool
    hidden_paths: list[str]
    hidden_files: list[str]
    socket_dirs: list[str]
    notes: list[str]


class LocalSandbox(BaseSandbox):
    """Runs untrusted Python in a child process, at most ``max_concurrency`` at a time (in each event loop).

    ``namespaces=None`` probes on first use whether mount, network, IPC and PID namespaces work (they need root)
    and degrades with a logged warning if not; ``True`` fails closed (every run is a ``sandbox_error``) if they
    don't. ``cgroups`` likewise for a cgroup leaf per run (v2, else v1; needs root): ``None`` uses one where the
    host allows it and else falls back to the supervisor's memory watch, ``True`` requires one, ``False`` always
    uses the fallback; ``cgroup_parent`` names a delegated cgroup v2 directory to make the leaves in (default:
    this process's own cgroup, which can delegate only if it is the root or holds no processes). ``uids`` is the pool of unprivileged uids runs are given when the sandbox runs as root.
    ``hidden_paths`` (default: /home, /root and the current directory, where project files such as ``.env``
    live) are covered by empty, unreadable directories inside the mount namespace; the rest of the host
    filesystem stays readable (read-only) wherever file permissions allow. ``hidden_files`` (a grader's test data,
    which a program could otherwise look its answers up in) read as empty inside the mount namespace.
    """

    def __init__(
        self,
        *,
        max_concurrency: int | None = None,
        timeout_s: float = 6.0,
        memory_mb: int = 1024,
        max_output_bytes: int = 1 << 20,
        max_processes: int = 32,
        workdir_mb: int = 64,
        python: str | None = None,
        namespaces: bool | None = None,
        cgroups: bool | None = None,
        cgroup_parent: str | None = None,
        cpus: float = 1.0,
        socket_guard: bool = True,
        uids: range = range(200_000, 204_096),
        hidden_paths: Sequence[str] | None = None,
        hidden_files: Sequence[str] = (),
    ) -> None:
        for field, value in (
            ("max_concurrency", 1 if max_concurrency is None else max_concurrency),
            ("timeout_s", timeout_s),
            ("memory_mb", memory_mb),
            ("max_output_bytes", max_output_bytes),
            ("max_processes", max_processes),
            ("workdir_mb", workdir_mb),
            ("cpus", cpus),
        ):
            check_limit(field, value)
        _check_uids(uids)
        self._root = os.geteuid() == 0
        self._timeout_s = timeout_s
        self._memory_mb = memory_mb
        self._max_output_bytes = max_output_bytes
        self._max_processes = max_processes
        self._workdir_mb = workdir_mb
        self._python = python or _default_python(self._root)
        if not (os.path.isfile(self._python) and os.access(self._python, os.X_OK)):
            raise InvalidInputError(
                f"{self._python!r} is not an executable file", field="python", fix="pass the path of a Python interpreter"
            )
        needed = [tempfile.gettempdir(), str(Path(os.path.realpath(self._python)).parent.parent)]
        if hidden_paths is None:
            self._hidden_paths = _hideable(["/home", "/root", os.getcwd()], needed, strict=False)
        else:
            self._hidden_paths = _hideable(hidden_paths, needed, strict=True)
        self._socket_dirs = _hideable([*_SOCKET_DIRS, tempfile.gettempdir()], needed[1:], strict=False)
        self._hidden_files = _check_hidden_files(hidden_files)
        # a committed file is in its repository's objects too, every version of it
        self._hidden_paths = sorted({*self._hidden_paths, *_hideable(_git_dirs(self._hidden_files), needed, strict=False)})
        self._namespaces = namespaces if self._root or namespaces else False
        self._cgroups = cgroups if self._root or cgroups else False
        self._cgroup_version: int | None = None
        self._cpus = cpus
        self._cgroup_parent = cgroup_parent
        self._socket_guard = socket_guard
        self._uids = uids
        self._kill = shutil.which("kill")
        limit = max_concurrency or os.cpu_count() or 4
        self._limiter = PerLoop(lambda: anyio.CapacityLimiter(limit))  # runs at once, per event loop
        self._probe_lock = PerLoop(anyio.Lock)
        self._notes: list[str] = []
        if not self._root:
            self._notes.append(
                "not root: the program runs as the calling user (no privilege drop, no namespaces); RLIMIT_NPROC "
                "counts all of that user's processes, and the program could signal its own supervisor"
            )
        elif namespaces is False:
            self._notes.append("namespaces turned off: network is blocked only by the socket guard")
        if self._root and self._cgroups is False:
            self._notes.append(_FALLBACK_NOTE)
        if not socket_guard:
            self._notes.append("socket guard turned off")

    async def isolation(self) -> Isolation:
        """The layers in force (probing namespaces and cgroups if that has not happened yet)."""
        namespaces = await self._namespaces_available()
        if self._cgroups is not False and self._cgroup_version is None:
            probe = await self._make_cgroup(f"probe-{os.getpid()}", self._memory_mb)
            if probe is not None:
                await anyio.to_thread.run_sync(probe.remove)
        return Isolation(
            privilege_drop=self._root,
            namespaces=namespaces,
            cgroup=f"v{self._cgroup_version}" if self._cgroups is not False and self._cgroup_version else None,
            socket_guard=self._socket_guard,
            hidden_paths=self._hidden_paths if namespaces else [],
            hidden_files=self._hidden_files if namespaces else [],
            socket_dirs=self._socket_dirs if namespaces else [],
            notes=list(self._notes),
        )

    async def run(
        self,
        code: str,
        *,
        stdin: str = "",
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        files: Files | None = None,
    ) -> ExecutionResult:
        timeout_s = self._timeout_s if timeout_s is None else check_limit("timeout_s", timeout_s)
        memory_mb = self._memory_mb if memory_mb is None else check_limit("memory_mb", memory_mb)
        contents = {CODE_FILE: self._check_code(code), **check_files(files, reserved=CODE_FILE)}
        _check_fits(contents, self._workdir_mb)
        stdin_bytes = encode_text("stdin", stdin)
        namespaces = await self._namespaces_available()
        async with self._limiter.get():
            return await self._execute(contents, stdin_bytes, timeout_s, memory_mb, namespaces)

    def _check_code(self, code: str) -> bytes:
        data = encode_text("code", code)
        if len(data) > self._workdir_mb << 20:
            raise InvalidInputError(
                f"is {len(data)} bytes, over the {self._workdir_mb} MiB working directory", field="code", fix="raise workdir_mb"
            )
        return data

    async def _namespaces_available(self) -> bool:
        if self._namespaces is not None:
            return self._namespaces
        async with self._probe_lock.get():
            if self._namespaces is None:
                async with self._limiter.get():
                    probe = await self._execute({CODE_FILE: b""}, b"", max(self._timeout_s, 10.0), self._memory_mb, True)
                if probe.status == "sandbox_error" and probe.stderr.startswith(_UNSTARTED):
                    return True  # the host could not start it (out of fds, say): nothing learnt; this run fails closed
                unavailable = "namespaces unavailable" in probe.stderr
                self._namespaces = not unavailable  # any other failure: keep them, so runs fail closed, loudly
                if unavailable:
                    reason = probe.stderr.strip().splitlines()[0]
                    note = f"{reason[reason.index('namespaces unavailable') :]}; network is blocked only by the socket guard"
                    self._notes.append(
                        note + ", the program can write wherever its uid may and read what it may (hidden paths and files included)"
                    )
                    log.warning("LocalSandbox: %s", note)
                elif not probe.ok:
                    log.error("LocalSandbox: the isolation probe failed (%s): %s", probe.status, probe.stderr.strip())
        return self._namespaces

    async def _make_cgroup(self, name: str, memory_mb: int) -> _cgroups.RunCgroup | None:
        """A cgroup leaf for one run, or None. With ``cgroups=None``, a failure before any leaf was made means the
        host does not allow them: cgroups are off for good (the fallback); after that, a failure fails the run."""
        make = functools.partial(
            _cgroups.create,
            name,
            memory_bytes=memory_mb << 20,
            max_processes=self._max_processes,
            cpus=self._cpus,
            parent=self._cgroup_parent,
        )
        cgroup, why = await anyio.to_thread.run_sync(make)
        if cgroup is not None:
            self._cgroup_version = cgroup.version
        elif self._cgroups is None and self._cgroup_version is None:
            self._cgroups = False
            self._notes.append(f"no cgroup per run ({why or 'no cgroup hierarchy with a memory controller'}): {_FALLBACK_NOTE}")
            log.warning("LocalSandbox: %s", self._notes[-1])
        return cgroup

    async def _execute(
        self, contents: Mapping[str, bytes], stdin: bytes, timeout_s: float, memory_mb: int, namespaces: bool
    ) -> ExecutionResult:
        """One run; a host-side failure to start it (no fds, no memory to fork, no interpreter) is a ``sandbox_error``
        result, with everything made for the run undone."""
        try:
            return await self._execute_once(contents, stdin, timeout_s, memory_mb, namespaces)
        except OSError as exc:
            log.warning("LocalSandbox: could not run the program: %s: %s", type(exc).__name__, exc)
            return ExecutionResult(status="sandbox_error", stderr=f"{_UNSTARTED}: {type(exc).__name__}: {exc}\n")

    async def _execute_once(
        self, contents: Mapping[str, bytes], stdin: bytes, timeout_s: float, memory_mb: int, namespaces: bool
    ) -> ExecutionResult:
        workdir = await anyio.to_thread.run_sync(_make_workdir, contents)
        proc: Process | None = None
        status_r = status_w = -1
        lease: UidLease | None = None
        cgroup: _cgroups.RunCgroup | None = None
        cgroup_fds: list[int] = []
        try:
            status_r, status_w = os.pipe()
            if self._root:
                try:
                    lease = acquire_uid(self._uids)
                except RuntimeError as exc:  # every uid of the pool is in use
                    return ExecutionResult(status="sandbox_error", stderr=f"{exc}\n")
            uid = lease.uid if lease else None
            if uid is None and self._cgroups:
                return ExecutionResult(status="sandbox_error", stderr="cgroups=True needs root\n")
            if uid is not None and self._cgroups is not False:
                cgroup = await self._make_cgroup(str(uid), memory_mb)
                if cgroup is None and self._cgroups is not False:  # required, or worked before: fail closed
                    return ExecutionResult(status="sandbox_error", stderr="no cgroup leaf could be made for this run\n")
                cgroup_fds = cgroup.open_procs() if cgroup else []
            cpu_s = max(1, math.ceil(timeout_s))
            config = {
                "workdir": workdir,
                "uid": uid,
                "gid": uid,
                "namespaces": namespaces,
                "workdir_mb": self._workdir_mb,
                "workdir_inodes": _WORKDIR_INODES,
                "memory_mb": memory_mb,
                "cpu_s": cpu_s,
                "max_processes": self._max_processes,
                "socket_guard": self._socket_guard,
                "hidden_paths": self._hidden_paths,
                "hidden_files": self._hidden_files,
                "socket_dirs": self._socket_dirs,
                "cgroup_fds": cgroup_fds,
                "cgroup": cgroup.as_dict() if cgroup else None,
                "memory_watch": cgroup is None,
                "status_fd": status_w,
                "code_file": CODE_FILE,
            }
            started = time.monotonic()
            proc = await anyio.open_process(
                [self._python, "-I", "-S", "-B", str(_BOOTSTRAP), json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env={"PATH": _PATH, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir},
                start_new_session=True,
                pass_fds=(status_w, *cgroup_fds),
            )
            os.close(status_w)
            status_w = -1
            for fd in cgroup_fds:
                os.close(fd)
            cgroup_fds = []
            try:
                stop_reason, out, err = await self._supervise(proc, stdin, timeout_s, uid)
            finally:
                with anyio.CancelScope(shield=True):
                    if proc.returncode is None:  # we were cancelled: stop the run as on a timeout
                        await self._stop(proc, uid)
                    await proc.aclose()
            wall_s = time.monotonic() - started
            report = _read_report(status_r)
            # Killed by our SIGTERM itself: it had not installed its handler yet, so it had not forked anything.
            early = stop_reason is not None and proc.returncode == -signal.SIGTERM
            if lease and not report and not early:  # it died: keep its uid out of use while its processes may linger
                log.warning("LocalSandbox: retiring uid %d after a run without a supervisor report", lease.uid)
                lease = None
            if early:
                report = {"started": False, "stopped": True}
            if cgroup is not None and cgroup.oom_kills():
                report["memory_exceeded"] = True
            return _verdict(report, stop_reason, out, err, wall_s, cpu_s)
        finally:
            for fd in (status_r, status_w, *cgroup_fds):
                if fd >= 0:
                    os.close(fd)
            with anyio.CancelScope(shield=True):
                if cgroup is not None:
                    await anyio.to_thread.run_sync(cgroup.remove)
                if lease:
                    lease.release()
                # Not started: the directory holds what we wrote, nothing a program made (links to follow)
                await anyio.to_thread.run_sync(_remove_workdir, workdir, contents if proc is None else ())

    async def _supervise(
        self, proc: Process, stdin: bytes, timeout_s: float, uid: int | None
    ) -> tuple[ExecutionStatus | None, bytearray, bytearray]:
        """Feed stdin, collect capped output, enforce the wall clock; returns why we stopped the run, if we did."""
        out, err = bytearray(), bytearray()
        reasons: list[ExecutionStatus] = []
        stopped = anyio.Event()

        def stop(reason: ExecutionStatus) -> None:
            if not reasons:
                reasons.append(reason)
                _terminate(proc)
                stopped.set()

        async def feed() -> None:
            assert proc.stdin is not None
            try:
                if stdin:
                    await proc.stdin.send(stdin)
                await proc.stdin.aclose()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

        async def pump(stream: ByteReceiveStream | None, buf: bytearray) -> None:
            assert stream is not None
            async for chunk in stream:
                room = self._max_output_bytes - len(buf)
                buf += chunk[: max(room, 0)]
                if len(chunk) > room:
                    stop("output_limit")

        async def watchdog() -> None:
            with anyio.move_on_after(timeout_s):
                await stopped.wait()
            stop("timeout")
            await self._stop(proc, uid)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watchdog)
            async with anyio.create_task_group() as io:
                io.start_soon(feed)
                io.start_soon(pump, proc.stdout, out)
                io.start_soon(pump, proc.stderr, err)
            await proc.wait()
            tg.cancel_scope.cancel()
        return (reasons[0] if reasons else None), out, err

    async def _stop(self, proc: Process, uid: int | None) -> None:
        """Ask the supervisor to kill, reap and report; if it has not exited after a grace period, kill it all."""
        _terminate(proc)
        with anyio.move_on_after(_STOP_GRACE_S):
            await proc.wait()
        if proc.returncode is not None:
            return
        log.warning("LocalSandbox: supervisor %d did not stop in %.0f s; killing it", proc.pid, _STOP_GRACE_S)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if uid is not None and self._kill:  # processes that left the group; they stay as zombies if init does not reap
            await anyio.run_process([self._kill, "-s", "KILL", "--", "-1"], user=uid, group=uid, extra_groups=[], check=False)


def _terminate(proc: Process) -> None:
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass


_UID_MAX = (1 << 32) - 2  # (uid_t)-1 means "unchanged" to setresuid


def _check_uids(uids: object) -> None:
    """InvalidInputError unless ``uids`` is a non-empty range of uids (and gids) that no account or group owns.

    The supervisor kills every process of a run's uid with kill(-1) as that uid before and after each run: on
    uid 0 that would kill the whole host, on a user's uid all of that user's processes; a gid that names a group
    would hand the program that group's files.
    """
    fix = "pass a range of unused ids, like the default range(200_000, 204_096)"
    if not isinstance(uids, range) or not uids:
        raise InvalidInputError(f"must be a non-empty range, got {uids!r}", field="uids", fix=fix)
    taken = [(f"user {u.pw_name!r}", u.pw_uid) for u in pwd.getpwall() if u.pw_uid in uids]
    taken += [(f"group {g.gr_name!r}", g.gr_gid) for g in grp.getgrall() if g.gr_gid in uids]
    if taken:
        what, uid = min(taken, key=lambda t: t[1])
        raise InvalidInputError(f"{uids!r} holds id {uid}, owned by {what}", field="uids", fix=fix)
    if min(uids[0], uids[-1]) < 1 or max(uids[0], uids[-1]) > _UID_MAX:
        raise InvalidInputError(f"{uids!r} leaves 1..{_UID_MAX}", field="uids", fix=fix)


def _hideable(paths: Sequence[str], needed: Sequence[str], *, strict: bool) -> list[str]:
    """The existing directories among ``paths``, minus those holding something a run needs (``needed``)."""
    hidden = set()
    for path in paths:
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            continue
        if any(os.path.commonpath([os.path.realpath(n), real]) == real for n in needed):
            if strict:
                raise InvalidInputError(
                    f"{path!r} holds the temp directory or the interpreter, which runs need",
                    field="hidden_paths",
                    fix="hide narrower directories",
                )
            continue
        hidden.add(real)
    return sorted(hidden)


def _check_hidden_files(paths: object) -> list[str]:
    """The real paths of ``paths``, each an existing regular file, or InvalidInputError."""
    fix = "pass the paths of existing files (hide directories with hidden_paths)"
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
        raise InvalidInputError(f"must be a sequence of paths, got {paths!r}", field="hidden_files", fix=fix)
    real = set()
    for path in paths:
        if not isinstance(path, str) or not os.path.isfile(path):  # (NUL, lone surrogates: not a file)
            raise InvalidInputError(f"{path!r} is not an existing file", field="hidden_files", fix=fix)
        real.add(os.path.realpath(path))
    return sorted(real)


def _git_dirs(files: Sequence[str]) -> list[str]:
    """The git directory of each repository holding one of ``files``: its ``.git``, or for a worktree (a ``.git`` file
    naming ``gitdir: <repo>/.git/worktrees/<name>``) the repository's common one, which holds the objects."""
    found = []
    for path in files:
        for parent in Path(path).parents:
            dotgit = parent / ".git"
            try:
                if dotgit.is_dir():
                    found.append(str(dotgit))
                elif dotgit.is_file():
                    gitdir = parent / dotgit.read_text().partition("gitdir:")[2].strip()
                    common = gitdir / "commondir"
                    found.append(os.path.realpath(gitdir / common.read_text().strip() if common.is_file() else gitdir))
                else:
                    continue
            except (OSError, UnicodeDecodeError):
                pass
            break
    return found


def _usable_by_anyone(executable: str) -> bool:
    """Whether an unprivileged user can run this interpreter and read its standard library (``<prefix>/lib``)."""
    real = Path(os.path.realpath(executable))
    for path, need in ((real, stat.S_IROTH | stat.S_IXOTH), (real.parent.parent / "lib", stat.S_IROTH | stat.S_IXOTH)):
        try:
            if any(not os.stat(d).st_mode & stat.S_IXOTH for d in path.parents) or os.stat(path).st_mode & need != need:
                return False
        except OSError:
            return False
    return True


def _default_python(root: bool) -> str:
    if not root:
        return sys.executable
    candidates = [sys.executable, getattr(sys, "_base_executable", None), "/usr/bin/python3", "/usr/local/bin/python3"]
    for candidate in candidates:
        if candidate and _usable_by_anyone(candidate):
            return candidate
    raise InvalidInputError(
        "no Python interpreter that an unprivileged user can run was found",
        field="python",
        fix="install a system python3 or pass python=<an interpreter readable and executable by all users>",
    )


def _check_fits(contents: Mapping[str, bytes], workdir_mb: int) -> None:
    """InvalidInputError(field="files") unless the code and files fit the run's working directory, a tmpfs of
    ``workdir_mb`` MiB and ``_WORKDIR_INODES`` inodes: each file takes whole pages, each file and directory an inode."""
    page = os.sysconf("SC_PAGE_SIZE")
    size = sum(-(-len(data) // page) * page for data in contents.values())
    if size > workdir_mb << 20:
        raise InvalidInputError(
            f"code and files take {size} bytes in whole {page}-byte pages, over the {workdir_mb} MiB working directory",
            field="files",
            fix="raise workdir_mb or pass fewer, larger files",
        )
    directories = {str(parent) for name in contents for parent in PurePosixPath(name).parents}  # "." included
    inodes = len(contents) + len(directories)
    if inodes > _WORKDIR_INODES:
        raise InvalidInputError(
            f"code and files need {inodes} files and directories, over the working directory's {_WORKDIR_INODES}",
            field="files",
            fix="pass fewer files",
        )


def _make_workdir(contents: Mapping[str, bytes]) -> str:
    """A fresh private directory holding ``contents``; removed again if any file cannot be written."""
    workdir = tempfile.mkdtemp(prefix="asyncsess-sandbox-")
    try:
        for name, data in contents.items():
            path = os.path.join(workdir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    except BaseException:
        _remove_workdir(workdir, contents)
        raise
    return workdir


def _remove_workdir(workdir: str, written: Iterable[str]) -> None:
    """Remove a run's working directory. Where that fails for want of a file descriptor (listing a directory takes
    one), remove the files ``written`` there and their directories by name, which takes none: only pass them while
    no program can have replaced a directory of theirs with a link."""
    shutil.rmtree(workdir, ignore_errors=True)
    if not os.path.lexists(workdir):
        return
    directories: set[str] = set()
    for name in written:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(workdir, name))
        directories.update(str(parent) for parent in PurePosixPath(name).parents if str(parent) != ".")
    for directory in sorted(directories, key=len, reverse=True):  # deepest first
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(workdir, directory))
    with contextlib.suppress(OSError):
        os.rmdir(workdir)
    if os.path.lexists(workdir):
        log.warning("LocalSandbox: could not remove the working directory %s", workdir)


def _read_report(fd: int) -> dict:
    """The supervisor's JSON report; every writer is gone by now, so this never blocks."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    except BlockingIOError:
        pass
    lines = data.decode(errors="replace").splitlines()
    try:
        return json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return {}


def _verdict(
    report: dict, stop_reason: ExecutionStatus | None, out: bytearray, err: bytearray, wall_s: float, cpu_limit: int
) -> ExecutionResult:
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    if not report.get("started"):
        why = report.get("error") or ("stopped before the program started" if report.get("stopped") else "no report from the supervisor")
        return ExecutionResult(status="sandbox_error", stdout=stdout, stderr=f"{why}\n{stderr}".rstrip() + "\n", wall_s=wall_s)
    sig = report.get("signal")
    exit_code = -sig if sig else report.get("exit_code")
    cpu_s = report.get("cpu_s")
    status: ExecutionStatus
    if stop_reason is not None:
        status = stop_reason
    elif exit_code is None:
        status = "sandbox_error"
    elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s is not None and cpu_s >= cpu_limit):
        status = "timeout"
    elif report.get("memory_exceeded"):
        status = "memory"
    else:
        status = "ok" if exit_code == 0 else "runtime_error"
    return ExecutionResult(status=status, exit_code=exit_code, stdout=stdout, stderr=stderr, wall_s=wall_s, cpu_s=cpu_s)
