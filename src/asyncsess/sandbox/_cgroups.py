"""A cgroup leaf per sandboxed run: memory, process and CPU limits over all of the run's processes.

cgroup v2 where this process's cgroup can delegate the ``memory`` controller (``memory.max``, swap off,
``memory.oom.group``, ``pids.max``, ``cpu.max``), else the v1 ``memory`` hierarchy where it is mounted and
writable (``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes``). The host creates the leaf and hands
the run an open fd of its ``cgroup.procs``; the program's process writes ``0`` to it (joins) before it drops
privileges, so everything it starts is inside.
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

    __slots__ = ("version", "path")

    def __init__(self, version: int, path: str) -> None:
        self.version = version
        self.path = path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunCgroup) and (self.version, self.path) == (other.version, other.path)

    def __repr__(self) -> str:
        return f"RunCgroup(version={self.version}, path={self.path!r})"

    def as_dict(self) -> dict:
        return {"version": self.version, "path": self.path}

    def open_procs(self) -> int:
        """A fresh fd of the leaf's ``cgroup.procs`` (the caller closes it). A process that writes ``b"0"`` to it is
        in the run's cgroup, and so is everything it starts. Open it before dropping privileges or entering a mount
        namespace (where /sys may be read-only)."""
        return os.open(os.path.join(self.path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)

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
        """Kill whatever is left in the leaf and remove it (a run's processes are all reaped by now)."""
        _kill_and_remove(self.path)


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
    # Memory only: processes are bounded by RLIMIT_NPROC of the run's own uid, and each extra hierarchy would cost
    # one more migration (an RCU grace period, 5-20 ms here) per run.
    mount = next((m for m, fstype, options in _mounts() if fstype == "cgroup" and "memory" in options), None)
    own = _own_cgroups().get("memory")
    if mount is None or own is None:
        return None
    leaf = _fresh_leaf(os.path.join(mount, own.lstrip("/")), name)
    try:
        _write(os.path.join(leaf, "memory.limit_in_bytes"), str(memory_bytes))
        if os.path.exists(os.path.join(leaf, "memory.memsw.limit_in_bytes")):  # no swapping past the limit
            _write(os.path.join(leaf, "memory.memsw.limit_in_bytes"), str(memory_bytes))
    except OSError:
        _kill_and_remove(leaf)
        raise
    return RunCgroup(1, leaf)
