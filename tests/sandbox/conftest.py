"""Fixtures for the sandbox tests: a LocalSandbox factory whose runs must leave no process behind."""

from __future__ import annotations

import os

import pytest

from asyncsess.sandbox import LocalSandbox

ROOT = os.geteuid() == 0
root_only = pytest.mark.skipif(
    not ROOT, reason="privilege drop and namespaces need root; as a normal user LocalSandbox runs degraded (docs/sandbox.md)"
)
# A pool of this test process's own (leases are exclusive anyway; a private pool keeps the leftover-process checks
# below from seeing a concurrent test run's or application's sandboxes).
TEST_UIDS = range(300_000 + (os.getpid() % 10_000) * 64, 300_000 + (os.getpid() % 10_000 + 1) * 64)


def processes_of(uids: range) -> list[tuple[int, int, str]]:
    """(pid, uid, state) of every process, zombies included, whose real uid is in ``uids``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # exited meanwhile
            continue
        uid = int(fields["Uid"].split()[0])
        if uid in uids:
            found.append((int(entry), uid, fields["State"].strip()))
    return found


@pytest.fixture
def make_sandbox():
    """Build LocalSandboxes on the test uid pool; afterwards, no process of that pool may exist (not even a zombie)."""

    def make(**kwargs) -> LocalSandbox:
        kwargs.setdefault("uids", TEST_UIDS)
        kwargs.setdefault("timeout_s", 5.0)
        kwargs.setdefault("memory_mb", 256)
        return LocalSandbox(**kwargs)

    yield make
    assert processes_of(TEST_UIDS) == []


async def assert_healthy(sandbox: LocalSandbox) -> None:
    """The sandbox still runs an ordinary program correctly."""
    result = await sandbox.run("print(sum(map(int, input().split())))", stdin="2 3\n")
    assert (result.status, result.stdout) == ("ok", "5\n"), result


def cgroup_leaves(uids: range) -> list[str]:
    """The cgroup leaves (``asyncsess-sandbox-<uid>``, v2 or v1 memory) of ``uids`` that exist under this process's
    own cgroups."""
    with open("/proc/self/mountinfo") as f:
        mounts = [(line.split()[4], line.split(" - ", 1)[1].split()) for line in f]
    with open("/proc/self/cgroup") as f:
        own = {controllers: path for _, controllers, path in (line.rstrip("\n").split(":", 2) for line in f)}
    parents = [os.path.join(m, own[""].lstrip("/")) for m, (fstype, *_) in mounts if fstype == "cgroup2" and "" in own]
    for m, (fstype, _, options) in mounts:
        memory = next((c for c in own if "memory" in c.split(",")), None)
        if fstype == "cgroup" and "memory" in options.split(",") and memory:
            parents.append(os.path.join(m, own[memory].lstrip("/")))
    return [p for parent in parents for uid in uids if os.path.isdir(p := os.path.join(parent, f"asyncsess-sandbox-{uid}"))]
