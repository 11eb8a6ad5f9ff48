"""Choosing a cgroup for a run (v2, else v1, else the fallback), on fake hierarchies; and LocalSandbox on a host
that allows none."""

from __future__ import annotations

import errno

import pytest

from asyncsess.sandbox import _cgroups

from .conftest import assert_healthy, root_only
from .test_sandbox_containment import SEVEN_CHILDREN

pytestmark = pytest.mark.anyio


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """Builds fake cgroup hierarchies under tmp_path and points _cgroups at them."""

    def build(*, v2_controllers=None, v2_enabled=(), v2_can_enable=True, v1_memory=False):
        mounts = []
        if v2_controllers is not None:
            own = tmp_path / "unified" / "trainer"
            own.mkdir(parents=True)
            (own / "cgroup.controllers").write_text(" ".join(v2_controllers) + "\n")
            (own / "cgroup.subtree_control").write_text(" ".join(v2_enabled) + "\n")
            mounts.append((str(tmp_path / "unified"), "cgroup2", {"rw"}))
        if v1_memory:
            (tmp_path / "memory" / "trainer").mkdir(parents=True)
            mounts.append((str(tmp_path / "memory"), "cgroup", {"rw", "memory"}))
        mounts.append((str(tmp_path / "cpu"), "cgroup", {"rw", "cpu"}))
        monkeypatch.setattr(_cgroups, "_mounts", lambda: mounts)
        monkeypatch.setattr(_cgroups, "_own_cgroups", lambda: {"": "/trainer", "memory": "/trainer", "cpu": "/"})
        if not v2_can_enable:  # a cgroup with processes in it cannot delegate controllers (EBUSY)
            real_write = _cgroups._write

            def write(path: str, value: str) -> None:
                if path.endswith("cgroup.subtree_control"):
                    raise OSError(errno.EBUSY, "Device or resource busy")
                real_write(path, value)

            monkeypatch.setattr(_cgroups, "_write", write)
        return tmp_path

    return build


def test_v2_with_memory_delegated_is_used(fake_host):
    root = fake_host(v2_controllers=["cpu", "memory", "pids"], v2_enabled=["memory", "pids"], v1_memory=True)
    cgroup, why = _cgroups.create("7", memory_bytes=128 << 20, max_processes=8, cpus=1.0)
    assert cgroup == _cgroups.RunCgroup(2, str(root / "unified" / "trainer" / "asyncsess-sandbox-7")) and why == ""
    assert (root / "unified" / "trainer" / "asyncsess-sandbox-7" / "memory.max").read_text() == str(128 << 20)


def test_v2_that_cannot_delegate_memory_falls_back_to_v1(fake_host):
    root = fake_host(v2_controllers=["cpu", "memory"], v2_enabled=[], v2_can_enable=False, v1_memory=True)
    cgroup, _ = _cgroups.create("7", memory_bytes=64 << 20, max_processes=8, cpus=1.0)
    leaf = root / "memory" / "trainer" / "asyncsess-sandbox-7"
    assert cgroup == _cgroups.RunCgroup(1, str(leaf))
    assert (leaf / "memory.limit_in_bytes").read_text() == str(64 << 20)


def test_no_memory_controller_anywhere_means_no_cgroup_and_says_why(fake_host):
    fake_host(v2_controllers=["cpu", "hugetlb"], v1_memory=False)
    cgroup, why = _cgroups.create("7", memory_bytes=64 << 20, max_processes=8, cpus=1.0)
    assert cgroup is None and "memory controller is not available" in why


def test_a_delegated_parent_is_used_and_nothing_else(fake_host, tmp_path):
    fake_host(v2_controllers=["memory"], v2_enabled=[], v1_memory=True)
    delegated = tmp_path / "delegated"
    delegated.mkdir()
    (delegated / "cgroup.controllers").write_text("cpu memory pids\n")
    (delegated / "cgroup.subtree_control").write_text("cpu memory pids\n")
    cgroup, _ = _cgroups.create("9", memory_bytes=32 << 20, max_processes=4, cpus=0.5, parent=str(delegated))
    assert cgroup == _cgroups.RunCgroup(2, str(delegated / "asyncsess-sandbox-9"))
    assert (delegated / "asyncsess-sandbox-9" / "memory.max").read_text() == str(32 << 20)
    (delegated / "cgroup.controllers").write_text("cpu pids\n")
    (delegated / "cgroup.subtree_control").write_text("cpu pids\n")
    cgroup, why = _cgroups.create("10", memory_bytes=32 << 20, max_processes=4, cpus=0.5, parent=str(delegated))
    assert cgroup is None and str(delegated) in why  # no silent move to v1 when a parent was named


@pytest.mark.parametrize(
    ("version", "name", "text", "kills"),
    [
        (2, "memory.events", "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 1\n", 1),
        (2, "memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n", 0),
        (1, "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n", 3),
        (1, "memory.oom_control", "oom_kill_disable 0\nunder_oom 1\n", 1),  # kernels before 4.13
    ],
)
def test_oom_kills_are_read_from_either_version(tmp_path, version, name, text, kills):
    (tmp_path / name).write_text(text)
    assert _cgroups.RunCgroup(version, str(tmp_path)).oom_kills() == kills
    assert _cgroups.RunCgroup(version, str(tmp_path / "gone")).oom_kills() == 0


@root_only
async def test_a_host_without_cgroups_gets_the_fallback_and_says_so(make_sandbox, monkeypatch):
    monkeypatch.setattr(_cgroups, "create", lambda *a, **k: (None, "cgroup v2: not delegated"))
    sandbox = make_sandbox(memory_mb=128, timeout_s=20.0, max_processes=16)
    report = await sandbox.isolation()
    assert report.cgroup is None and any("no cgroup per run (cgroup v2: not delegated)" in n for n in report.notes)
    result = await sandbox.run(SEVEN_CHILDREN)  # the memory watch still ends it
    assert result.status == "memory" and "held" not in result.stdout, result
    await assert_healthy(sandbox)
    strict = make_sandbox(cgroups=True)
    failed = await strict.run("print(1)")
    assert failed.status == "sandbox_error" and "no cgroup" in failed.stderr
