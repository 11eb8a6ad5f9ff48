"""A cgroup leaf per sandboxed run: memory, process and CPU limits over all of the run's processes.

cgroup v2 where this process's cgroup can delegate the ``memory`` controller (``memory.max``, swap off,
``memory.oom.group``, ``pids.max``, ``cpu.max``), else the v1 ``memory`` hierarchy where it is mounted and
writable (``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes``), with a leaf in the v1 ``cpu``
hierarchy too where there is one (``cpu.cfs_quota_us``). The host creates the leaves and hands the run an open fd
of each ``cgroup.procs``; the program's process writes ``0`` to them (joins) before it drops privileges, so
everything it starts is inside.
Needs root; :func:`create` returns ``None`` (with the reason) where the host allows neither.
"""

from __future__ import annotations

import errno
import os
import signal
import time

__all__ = ["RunCgroup", "create"]

_PREFIX = "asyncsess-sandbox-"
_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


class RunCgroup:
    """The leaf directory of one run. (A plain class: the supervisor imports this module, and ``dataclasses``
    would add tens of milliseconds to every run's start-up.)"""

    __slots__ = ("version", "path", "cpu_path")

    def __init__(self, version: int, path: str, cpu_path: str | None = None) -> None:
        self.version = version
        self.path = path
        self.cpu_path = cpu_path
        """v1 only: the run's leaf in the cpu hierarchy (v2 has one hierarchy; ``path`` holds every limit)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunCgroup) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return f"RunCgroup(version={self.version}, path={self.path!r}, cpu_path={self.cpu_path!r})"

    def as_dict(self) -> dict:
        return {"version": self.version, "path": self.path, "cpu_path": self.cpu_path}

    def open_procs(self) -> list[int]:
        """Fresh fds of the leaves' ``cgroup.procs`` (the caller closes them). A process that writes ``b"0"`` to each
        is in the run's cgroups, and so is everything it starts. Open them before dropping privileges or entering a
        mount namespace (where /sys may be read-only)."""
        fds: list[int] = []
        try:
            for leaf in filter(None, (self.path, self.cpu_path)):
                fds.append(os.open(os.path.join(leaf, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def oom_kills(self) -> int:
        """How many processes of the run the kernel killed for going over the memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            fields = dict(line.split() for line in _read(os.path.join(self.path, name)).splitlines())
        except OSError:
            return 0
        if "oom_kill" in fields:
            return int(fields["oom_kill"])
        return int(fields.get("under_oom", 0))

    def remove(self) -> None:
        """Kill whatever is left in the leaves and remove them (a run's processes are all reaped by now)."""
        _kill_and_remove(self.path)
        if self.cpu_path:
            _kill_and_remove(self.cpu_path)


def create(name: str, *, memory_bytes: int, max_processes: int, cpus: float, parent: str | None = None) -> tuple[RunCgroup | None, str]:
    """A fresh leaf named ``asyncsess-sandbox-<name>`` with these limits, or ``(None, why not)``.

    ``parent``: a delegated cgroup v2 directory to make it in (only there); else under this process's cgroup.
    Raises OSError when out of file descriptors or memory, which says nothing about the host's cgroups.
    """
    reasons = []
    for make in (_create_v2,) if parent else (_create_v2, _create_v1):
        try:
            cgroup = make(_PREFIX + name, memory_bytes, max_processes, cpus, parent)
        except OSError as exc:
            if exc.errno in _EXHAUSTED:  # this process is short of something, not the host of cgroups: raised
                raise
            reasons.append(f"{make.__doc__}: {exc}")
            continue
        if cgroup is not None:
            return cgroup, ""
    return None, "; ".join(reasons)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of every mount."""
    found = []
    for line in _read("/proc/self/mountinfo").splitlines():
        left, right = line.split(" - ", 1)
        fstype, _, options = right.split(" ", 2)
        found.append((left.split()[4], fstype, set(options.split(","))))
    return found


def _own_cgroups() -> dict[str, str]:
    """Controller (``""`` for v2) -> this process's cgroup path."""
    paths = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _fresh_leaf(parent: str, name: str) -> str:
    leaf = os.path.join(parent, name)
    if os.path.isdir(leaf):  # left by a run whose host died; its uid is leased to us now
        _kill_and_remove(leaf)
    os.mkdir(leaf)
    return leaf


def _kill_and_remove(leaf: str) -> None:
    """Remove ``leaf``, killing what is still in it; gives up (leaving it to the next run of its uid) after ~1 s."""
    for _ in range(500):
        try:
            os.rmdir(leaf)
            return
        except FileNotFoundError:
            return
        except OSError:  # still populated
            try:
                if os.path.exists(os.path.join(leaf, "cgroup.kill")):
                    _write(os.path.join(leaf, "cgroup.kill"), "1")
                else:
                    for pid in _read(os.path.join(leaf, "cgroup.procs")).split():
                        os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
            time.sleep(0.002)


def _create_v2(name: str, memory_bytes: int, max_processes: int, cpus: float, parent: str | None) -> RunCgroup | None:
    """cgroup v2"""
    if parent is None:
        mount = next((m for m, fstype, _ in _mounts() if fstype == "cgroup2"), None)
        own = _own_cgroups().get("")
        if mount is None or own is None:
            return None
        parent = os.path.join(mount, own.lstrip("/"))
    enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
    if "memory" not in enabled:
        if "memory" not in _read(os.path.join(parent, "cgroup.controllers")).split():
            raise OSError(f"the memory controller is not available in {parent}")
        # Fails (EBUSY) unless this cgroup is the root or holds no processes: then the host must delegate one.
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
    for optional in ("pids", "cpu"):
        if optional not in enabled:
            try:
                _write(os.path.join(parent, "cgroup.subtree_control"), f"+{optional}")
            except OSError:
                pass
    leaf = _fresh_leaf(parent, name)
    try:
        _write(os.path.join(leaf, "memory.max"), str(memory_bytes))
        for optional, value in (
            ("memory.swap.max", "0"),
            ("memory.oom.group", "1"),
            ("pids.max", str(max_processes)),
            ("cpu.max", f"{int(cpus * 100_000)} 100000"),
        ):
            if os.path.exists(os.path.join(leaf, optional)):
                _write(os.path.join(leaf, optional), value)
    except OSError:
        _kill_and_remove(leaf)
        raise
    return RunCgroup(2, leaf)


def _create_v1(name: str, memory_bytes: int, max_processes: int, cpus: float, parent: str | None) -> RunCgroup | None:
    """cgroup v1"""
    # Memory and CPU: processes are bounded by RLIMIT_NPROC of the run's own uid, and each extra hierarchy costs one
    # more migration (an RCU grace period, 5-20 ms here) per run. CPU is worth it: without a group of its own, a
    # run's 32 processes (in 32 sessions, so 32 autogroups) outweigh every other run on the host, which then time out.
    mounts = _mounts()
    mount = next((m for m, fstype, options in mounts if fstype == "cgroup" and "memory" in options), None)
    own = _own_cgroups()
    if mount is None or own.get("memory") is None:
        return None
    leaf = _fresh_leaf(os.path.join(mount, own["memory"].lstrip("/")), name)
    try:
        _write(os.path.join(leaf, "memory.limit_in_bytes"), str(memory_bytes))
        if os.path.exists(os.path.join(leaf, "memory.memsw.limit_in_bytes")):  # no swapping past the limit
            _write(os.path.join(leaf, "memory.memsw.limit_in_bytes"), str(memory_bytes))
        cpu_mount = next((m for m, fstype, options in mounts if fstype == "cgroup" and "cpu" in options), None)
        cpu_leaf = _v1_cpu_leaf(os.path.join(cpu_mount, own["cpu"].lstrip("/")), name, cpus) if cpu_mount and "cpu" in own else None
    except OSError:
        _kill_and_remove(leaf)
        raise
    return RunCgroup(1, leaf, cpu_leaf)


def _v1_cpu_leaf(parent: str, name: str, cpus: float) -> str | None:
    """A leaf in the v1 cpu hierarchy with a quota of ``cpus`` CPUs (and the default share, as every other run), or
    None where the hierarchy cannot have one (raises when this process is out of file descriptors or memory)."""
    try:
        leaf = _fresh_leaf(parent, name)
    except OSError as exc:
        if exc.errno in _EXHAUSTED:
            raise
        return None
    try:
        _write(os.path.join(leaf, "cpu.cfs_period_us"), "100000")
        _write(os.path.join(leaf, "cpu.cfs_quota_us"), str(max(1000, int(cpus * 100_000))))
    except OSError as exc:
        _kill_and_remove(leaf)
        if exc.errno in _EXHAUSTED:
            raise
        return None
    return leaf
