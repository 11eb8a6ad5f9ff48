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

import anyio
import httpx
import pytest

pytest.importorskip("torch")

from local_helpers import sft_datum

from asyncsess import AdamParams, ServiceClient
from asyncsess.errors import DeadlineExceededError, RetriesExhaustedError
from asyncsess.retry import RetryPolicy

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
