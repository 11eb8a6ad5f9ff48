"""A worker that dies (SIGKILL) or stops answering (SIGSTOP) surfaces as a typed error within the op's
deadline, never a hang; the worker here is a real process that the tests start, signal and stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip("torch")

from asyncsess import AdamParams, ServiceClient
from asyncsess.errors import DeadlineExceededError, RetriesExhaustedError
from asyncsess.retry import RetryPolicy
from asyncsess.runs.metrics import read_metrics

from .helpers import sft_datum

pytestmark = [pytest.mark.local, pytest.mark.anyio]
KEY = "crash-key"
# Each try may take 2 s, the op at most 8 s: the numbers the typed error must arrive within.
POLICY = RetryPolicy(max_attempts=50, initial_backoff=0.05, max_backoff=0.5, jitter=0.05, attempt_timeout=2.0, deadline=8.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """``asyncsess-worker`` in a child process, on a fixed port and checkpoint root (so it can be restarted)."""

    def __init__(self, model: str, root: Path) -> None:
        self.model, self.root, self.port = model, root, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "asyncsess_local.server", "--model", self.model, "--port", str(self.port)]
        cmd += ["--api-key", KEY, "--dir", str(self.root), "--device", "cpu"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        for _ in range(600):  # polls until it answers; the bound only keeps a broken build from hanging
            assert self.proc.poll() is None, "the worker exited during start-up"
            try:
                if httpx.get(f"{self.url}/v1/capabilities", headers={"X-API-Key": KEY}, timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("the worker did not start")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def worker(tiny: str, tmp_path: Path) -> Iterator[Worker]:
    w = Worker(tiny, tmp_path / "ckpt")
    w.start()
    yield w
    w.stop()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
async def test_a_lost_worker_is_a_typed_error_within_the_deadline(worker: Worker, tiny: str, sig: int) -> None:
    datum = sft_datum(list(range(3, 40)))
    async with ServiceClient(worker.url, api_key=KEY, retry=POLICY, heartbeat_interval=0) as svc:
        tc = await svc.create_lora_training_client(tiny, rank=4, seed=0)
        await tc.forward_backward([datum], "cross_entropy")
        await tc.optim_step(AdamParams(learning_rate=1e-3))
        worker.signal(sig)
        with anyio.fail_after(120), pytest.raises((DeadlineExceededError, RetriesExhaustedError)) as info:  # fail_after: a hang guard
            await tc.forward_backward([datum], "cross_entropy")
        assert info.value.operation == "forward_backward" and info.value.seq == 3
        worker.stop()  # the session is gone with the worker; stopping it at exit must not hang either


def _share_of_even_ids(problem: Any, text: str) -> tuple[float, dict[str, float]]:
    """A reward that moves on the tiny random model: the share of digits in the reply."""
    return sum(c.isdigit() for c in text) / max(1, len(text)), {}


class _HeldBuilder:
    """A group builder whose envs wait for ``released``: holds the run's rollouts at a chosen batch."""

    def __init__(self, inner: Any, released: anyio.Event) -> None:
        self.inner, self.released = inner, released

    async def make_envs(self) -> Any:
        await self.released.wait()
        return await self.inner.make_envs()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _HeldFrom:
    """A dataset whose batches from ``first`` on wait for ``released``, so the kill below lands mid-run however
    fast the run is (before, a quick run could finish steps 3 and 4 before the kill, and nothing recovered)."""

    def __init__(self, inner: Any, first: int, released: anyio.Event) -> None:
        self.inner, self.first, self.released = inner, first, released

    def get_batch(self, index: int) -> list[Any]:
        batch = self.inner.get_batch(index)
        return batch if index < self.first else [_HeldBuilder(b, self.released) for b in batch]

    def __len__(self) -> int:
        return len(self.inner)


async def test_a_killed_worker_is_restarted_and_the_run_recovers(tiny: str, tmp_path: Path, monkeypatch) -> None:
    """kill -9 of the worker after the checkpoint at step 2, with the rollouts of step 3 held until a restarted
    worker (same root) is up; it still knows the run's checkpoints as this key's, and the loop reopens from the
    last one and finishes."""
    from asyncsess.rl import Problem, RLConfig, problem_datasets, train_rl
    from asyncsess.runs.checkpoints import last_checkpoint

    monkeypatch.setenv("ASYNCSESS_API_KEY", KEY)
    problems = [Problem(f"what is {i} plus 1? the answer is", str(i + 1)) for i in range(8)]
    base = RLConfig(base_model=tiny, groups_per_batch=2, group_size=4, max_tokens=6, lora_rank=4, learning_rate=1e-2, max_steps=4)
    base = base.model_copy(update={"save_every": 2, "seed": 3, "max_recoveries": 2, "recovery_wait_s": 120.0})
    released = anyio.Event()

    def datasets(tokenizer: Any) -> Any:
        train, test = problem_datasets(problems, [], _share_of_even_ids, base)(tokenizer)
        return _HeldFrom(train, 3, released), test

    crashed = Worker(tiny, tmp_path / "crashed")
    crashed.start()
    try:
        cfg = base.model_copy(update={"url": crashed.url})
        async with anyio.create_task_group() as tg:
            outcome: dict[str, Any] = {}

            async def run() -> None:
                outcome["result"] = await train_rl(cfg, datasets, tmp_path / "run-a", progress=False)

            tg.start_soon(run)
            with anyio.fail_after(600):  # a hang guard only
                while (rec := last_checkpoint(tmp_path / "run-a")) is None or rec.step < 2:
                    await anyio.sleep(0.05)
            assert "result" not in outcome  # step 3's rollouts are held: the run cannot have finished
            crashed.signal(signal.SIGKILL)
            crashed.start()  # what a supervisor (asyncsess-worker --supervise, systemd) does
            released.set()
        result = outcome["result"]
        assert result.steps == 4
        records = read_metrics(tmp_path / "run-a")
        assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
        assert any(r.get("recovery/count") == 1 for r in records)

        # the run's own final state is on the restarted worker, owned by the same key
        async with ServiceClient(crashed.url, api_key=KEY, heartbeat_interval=0) as svc:
            tc = await svc.create_training_client_from_state_with_optimizer(result.final_checkpoint.state_path)
            assert (await tc.optim_step(AdamParams(learning_rate=0.0))).metrics is not None
    finally:
        crashed.stop()


def test_a_supervised_worker_comes_back_after_kill_9(tiny: str, tmp_path: Path) -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "asyncsess_local.server", "--supervise", "--model", tiny, "--port", str(port)]
    cmd += ["--api-key", KEY, "--dir", str(tmp_path / "ckpt"), "--device", "cpu"]
    sup = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert sup.stdout is not None
    url = f"http://127.0.0.1:{port}"

    def child_started() -> int:
        for line in sup.stdout:  # type: ignore[union-attr]  # the supervisor's line, among the worker's logs
            if "worker pid" in line:
                return int(line.split("worker pid ")[1].split()[0])
        raise AssertionError("the supervisor ended")

    def wait_ready() -> None:
        for _ in range(600):  # polls until it answers; the bound only keeps a broken build from hanging
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("the worker did not become ready")

    try:
        first = child_started()
        wait_ready()
        os.kill(first, signal.SIGKILL)
        second = child_started()
        assert second != first
        wait_ready()
        r = httpx.post(f"{url}/v1/sessions", json={"base_model": tiny, "rank": 4}, headers={"X-API-Key": KEY}, timeout=60)
        assert r.status_code == 200  # same port, same key
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=60) == 0  # a requested stop is a clean end
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(timeout=30)


@pytest.mark.parametrize("from_env", [True, False])
def test_a_supervised_workers_key_is_never_on_a_command_line(monkeypatch, capsys, from_env: bool) -> None:
    """A key from $ASYNCSESS_API_KEY, or one the worker made up, was passed to the child as ``--api-key``:
    readable by every local user in /proc/<pid>/cmdline. It goes in the child's environment."""
    from asyncsess_local import server, supervise

    started: list[tuple[list[str], dict[str, str] | None]] = []

    class Child:
        pid = 1

        def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
            started.append((args, env))

        def wait(self) -> int:
            return 0  # a clean exit ends the supervisor

    monkeypatch.setattr(supervise.subprocess, "Popen", Child)
    monkeypatch.setattr(supervise.signal, "signal", lambda *a: None)
    if from_env:
        monkeypatch.setenv("ASYNCSESS_API_KEY", "secret-from-env")
    else:
        monkeypatch.delenv("ASYNCSESS_API_KEY", raising=False)
    with pytest.raises(SystemExit) as done:
        server.main(["--supervise", "--port", "1"])
    assert done.value.code == 0
    [(args, env)] = started
    key = "secret-from-env" if from_env else capsys.readouterr().out.split("ASYNCSESS_API_KEY to reuse): ")[1].split()[0]
    assert not any(key in a for a in args) and "--api-key" not in args, args
    assert env is not None and env["ASYNCSESS_API_KEY"] == key
