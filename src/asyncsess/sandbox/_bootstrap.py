"""Supervisor of one sandboxed run (stdlib only: it runs under the sandbox's interpreter as ``python -I -S -B``).

LocalSandbox starts it (as root where it can) with a JSON config in argv[1]. It

1. reads the program and its files from the working directory;
2. with ``namespaces``: enters fresh network and mount namespaces -- no network interfaces but a down loopback,
   the whole filesystem read-only, ``hidden_paths`` covered by empty unreadable mounts, the working directory
   a private size-capped tmpfs, and /proc showing only the viewer's own processes -- and writes the files
   back into the tmpfs;
3. becomes a child subreaper and forks the program's process, which sets its rlimits, drops to the sandbox
   uid, installs the socket guard and runs the code;
4. waits for it, kills and reaps everything the program left behind, and writes one JSON line to the status fd:
   ``{"started", "exit_code" | "signal", "cpu_s", "stopped"}``, or ``{"error"}`` when setup failed.

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

_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 0x1, 0x2, 0x4, 0x8, 0x4000, 0x40000
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
_PR_SET_CHILD_SUBREAPER = 36
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


def _note_signal(signum, frame):
    """SIGTERM and SIGCHLD only wake the supervisor up (through the wakeup fd); nothing is raised mid-cleanup."""


def _call(name, *args):
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data):
    _call("mount", source, target.encode(), fstype, ctypes.c_ulong(flags), data)


def _enter_namespaces(workdir, size_mb, uid, gid, hidden_paths):
    _call("unshare", _CLONE_NEWNS | _CLONE_NEWNET)
    _call("mount", None, b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None)  # nothing propagates to the host
    attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    args = (ctypes.c_long(_AT_FDCWD), b"/", ctypes.c_long(_AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _call("syscall", ctypes.c_long(_SYS_MOUNT_SETATTR), *args)  # every mount read-only (Linux >= 5.12)
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    try:
        _mount(b"proc", "/proc", b"proc", flags, b"hidepid=invisible")
    except OSError:
        _mount(b"proc", "/proc", b"proc", flags, b"hidepid=2")  # kernels before 5.8
    for path in hidden_paths:
        _mount(b"tmpfs", path, b"tmpfs", flags | _MS_RDONLY, b"size=4k,nr_inodes=2,mode=0")
    owner = "" if uid is None else f",uid={uid},gid={gid}"
    _mount(b"tmpfs", workdir, b"tmpfs", flags, f"size={size_mb}m,nr_inodes=4096,mode=0700{owner}".encode())


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
            _enter_namespaces(workdir, cfg["workdir_mb"], uid, gid, cfg["hidden_paths"])
        except OSError as exc:  # the host degrades on this message only, never on other setup failures
            raise RuntimeError(f"namespaces unavailable: {exc}") from exc
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
    _set_limit(resource.RLIMIT_NPROC, cfg["max_processes"])
    _set_limit(resource.RLIMIT_FSIZE, cfg["workdir_mb"] << 20)
    _set_limit(resource.RLIMIT_NOFILE, 256)
    _set_limit(resource.RLIMIT_CORE, 0)
    cpu = cfg["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later


def _socket_guard(event, args):
    if event in _NETWORK_EVENTS or (event == "socket.__new__" and args[1] != _AF_UNIX):
        raise PermissionError(f"network access is disabled in this sandbox ({event})")


def _child(cfg, source, sync_w):
    """The program's process: confine itself, tell the supervisor it is ready, run the code."""
    try:
        _set_limits(cfg)
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        os.chdir(cfg["workdir"])
        if cfg["socket_guard"]:
            sys.addaudithook(_socket_guard)
        os.write(sync_w, b"1")
        os.close(sync_w)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    sys.argv = [cfg["code_file"]]
    sys.path.insert(0, cfg["workdir"])
    scope = {"__name__": "__main__", "__file__": os.path.join(cfg["workdir"], cfg["code_file"]), "__builtins__": __builtins__}
    try:
        exec(compile(source, cfg["code_file"], "exec"), scope)
    except SystemExit:
        raise
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__ and exc.__traceback__.tb_next)  # hide this frame
        if isinstance(exc, MemoryError):
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(cfg["exit_memory"])
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


def _kill_uid(uid):
    """SIGKILL every process of ``uid`` at once (kill(-1) is atomic against fork)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _reap_all(main_pid, uid, report):
    """Kill the program and everything it started, and reap it all.

    We are a subreaper, so a living descendant always has us as an ancestor of its parent chain: when wait4(-1)
    reports no children left, nothing the program started is left either.
    """
    if uid is not None:
        _kill_uid(uid)  # all of them are doomed now; we only wait
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


def _wait(pid, wake_r, report):
    """Until the program exits (its status goes into ``report``) or the host sends SIGTERM."""
    while True:
        done, wait_status, rusage = os.wait4(pid, os.WNOHANG)
        if done:
            report.update(_exit_fields(wait_status, rusage))
            return
        select.select([wake_r], [], [])  # a SIGCHLD or SIGTERM arrived (the bytes are signal numbers)
        if signal.SIGTERM in os.read(wake_r, 256):
            report["stopped"] = True
            return


def _supervise(pid, sync_r, wake_r, cfg):
    report: dict = {}
    _wait(pid, wake_r, report)
    _reap_all(pid, cfg["uid"], report)
    report["started"] = os.read(sync_r, 1) == b"1"  # every writer is gone, so this cannot block
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
        source = _prepare(cfg)
        _call("prctl", _PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        sync_r, sync_w = os.pipe()
        pid = os.fork()
    except Exception as exc:
        _emit(status_fd, {"started": False, "error": f"sandbox setup failed: {type(exc).__name__}: {exc}"})
        return
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (status_fd, sync_r, wake_r, wake_w):
            os.close(fd)
        _child(cfg, source, sync_w)
        return
    os.close(sync_w)
    _emit(status_fd, _supervise(pid, sync_r, wake_r, cfg))


if __name__ == "__main__":
    main()
