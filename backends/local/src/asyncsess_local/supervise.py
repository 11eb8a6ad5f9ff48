"""``asyncsess-worker --supervise``: run the worker as a child process and start it again when it dies.

A worker that crashes (a segfault, an OOM kill, ``kill -9``) comes back on the same port and checkpoint root,
with the same API keys; it knows its tenants' checkpoints again (``<dir>/.owners.jsonl``), so the loops'
recovery (:class:`asyncsess.runs.checkpoints.RecoveryConfig`) reopens their runs from the last checkpoint. SIGTERM or
SIGINT stop the child and the supervisor; a clean exit of the child ends it too. More than ``max_restarts``
crashes within ``window_s`` seconds: it gives up (a worker that cannot start should not spin).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from types import FrameType

__all__ = ["supervise"]


def supervise(argv: list[str], *, api_key: str | None = None, max_restarts: int = 10, window_s: float = 600.0) -> int:
    """Run ``python -m asyncsess_local.server *argv`` until it exits cleanly or is stopped (0), or until it
    crashed too often (its last exit code). ``api_key`` goes to every child in ``$ASYNCSESS_API_KEY``, never on
    its command line (which any local user can read)."""
    crashes: deque[float] = deque()
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        env = {**os.environ, "ASYNCSESS_API_KEY": api_key} if api_key else None
        child = subprocess.Popen([sys.executable, "-m", "asyncsess_local.server", *argv], env=env)
        print(f"asyncsess-worker: worker pid {child.pid} started", flush=True)
        code = child.wait()
        if stopping or code == 0:
            return 0  # stopped on request, or a clean exit
        now = time.monotonic()
        crashes.append(now)
        while crashes and crashes[0] < now - window_s:
            crashes.popleft()
        if len(crashes) > max_restarts:
            print(f"asyncsess-worker: {len(crashes)} crashes in {window_s:g}s; giving up", flush=True)
            return code
        delay = min(30.0, 0.5 * 2 ** (len(crashes) - 1))
        print(f"asyncsess-worker: worker exited with {code}; restarting in {delay:g}s", flush=True)
        time.sleep(delay)
