"""Sessions whose client stops heartbeating (killed, cut off) expire: ``asyncsess serve --session-timeout``.

The server here expires a session after 1 s without a heartbeat or request. The checks wait for the reaper with a
generous deadline (never a tight wall-clock bound) and read the mock backend's own registry of open sessions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import tinker
from tinker import types

from asyncsess_mock import MockBackend

from .conftest import API_KEY, Server, start_server

pytestmark = pytest.mark.tinker

OTHER_KEY = "tml-asyncsess-other"
BASE = "mock/bigram-tiny"
TIMEOUT = 1.0  # the server's --session-timeout in this module
DEADLINE = 30.0  # generous: how long a test waits for the reaper


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from start_server("mock://", api_keys={API_KEY, OTHER_KEY}, session_timeout=TIMEOUT)


def _wait_for(cond: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {DEADLINE} s: {what}")
        time.sleep(0.05)


class _Client:
    """A raw HTTP client holding one session with one model and one sampler, as the SDK would create them."""

    def __init__(self, server: Server, key: str) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": key}, timeout=30)
        self.sid = self.http.post("/create_session", json={"tags": [], "user_metadata": {}}).json()["session_id"]
        fut = self.http.post(
            "/create_model", json={"session_id": self.sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}}
        ).json()
        self.model_id = self.result(fut["request_id"])["model_id"]
        self.sampler_id = self.http.post(
            "/create_sampling_session", json={"session_id": self.sid, "sampling_session_seq_id": 0, "base_model": BASE}
        ).json()["sampling_session_id"]
        self.seq = 1

    def result(self, request_id: str) -> dict:
        resp = self.http.post("/retrieve_future", json={"request_id": request_id})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def optim_step(self) -> httpx.Response:
        body = {"model_id": self.model_id, "seq_id": self.seq, "adam_params": {"learning_rate": 1e-3}}
        self.seq += 1
        return self.http.post("/optim_step", json=body)

    def backend_ids(self) -> set[str]:
        door = self.server.door
        return {door.models[self.model_id].backend_id, door.samplers[self.sampler_id].backend_id}

    def heartbeat(self) -> httpx.Response:
        return self.http.post("/session_heartbeat", json={"session_id": self.sid, "type": "session_heartbeat"})


class _Heartbeats:
    """Heartbeat some clients every 0.2 s in a thread (the SDK's period is 10 s; the server here expires at 1 s)."""

    def __init__(self, *clients: _Client) -> None:
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.thread = threading.Thread(target=self._run, args=(clients,), daemon=True)

    def _run(self, clients: tuple[_Client, ...]) -> None:
        while not self.stop.wait(0.2):
            self.statuses += [c.heartbeat().status_code for c in clients]

    def __enter__(self) -> _Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def test_a_silent_session_is_reaped_and_heartbeating_ones_survive(server: Server) -> None:
    silent, alive, other = _Client(server, API_KEY), _Client(server, API_KEY), _Client(server, OTHER_KEY)
    assert silent.backend_ids() <= set(MockBackend.open_sessions())
    pending = silent.optim_step().json()["request_id"]  # a future of the silent session, never fetched
    probe = server.door.promises.new("probe", silent.model_id)  # one that never resolves, long-polled across the expiry
    polled: list[httpx.Response] = []
    poller = threading.Thread(target=lambda: polled.append(silent.http.post("/retrieve_future", json={"request_id": probe.request_id})))
    with _Heartbeats(alive, other) as beats:
        poller.start()
        _wait_for(lambda: not silent.backend_ids() & set(MockBackend.open_sessions()), "the silent session's model and sampler stop")
        poller.join(DEADLINE)
        # the waiting long-poll woke with the failure (the server holds polls 5 s; the session expired after 1 s)
        assert polled[0].status_code == 200 and "expired" in polled[0].json()["error"], polled[0].text
        assert polled[0].json()["category"] == "server"
        time.sleep(3 * TIMEOUT)  # the survivors outlive the timeout several times over
        assert alive.optim_step().status_code == 200 and other.optim_step().status_code == 200
    assert beats.statuses and set(beats.statuses) == {200}
    open_now = set(MockBackend.open_sessions())
    assert alive.backend_ids() <= open_now and other.backend_ids() <= open_now
    # the silent session's futures are dropped, and every later call naming it gets 410 naming session_id
    door = server.door
    assert door.promises.get(pending) is None
    assert not any(rid.startswith(silent.sid) for rid in door.promises._items)
    for resp in (
        silent.heartbeat(),
        silent.optim_step(),
        silent.http.post("/retrieve_future", json={"request_id": pending}),
        silent.http.post(
            "/asample",
            json={
                "sampling_session_id": silent.sampler_id,
                "seq_id": 1,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
                "sampling_params": {"max_tokens": 2},
            },
        ),
        silent.http.post("/create_model", json={"session_id": silent.sid, "model_seq_id": 1, "base_model": BASE}),
    ):
        assert resp.status_code == 410, resp.text
        assert resp.json()["field"] == "session_id" and "expired" in resp.json()["error"]
    # the run's record stays readable over REST (as Tinker keeps training runs after their session ends)
    assert silent.http.get(f"/training_runs/{silent.model_id}").json()["training_run_id"] == silent.model_id
    # finishing an expired session is harmless; the survivors finish normally
    for c in (silent, alive, other):
        assert c.http.post(f"/sessions/{c.sid}/finish", json={"reason": {"type": "success"}}).status_code == 200
    assert not (alive.backend_ids() | other.backend_ids()) & set(MockBackend.open_sessions())


def test_the_official_sdk_gets_a_clear_error_on_an_expired_session(server: Server) -> None:
    """The SDK heartbeats every 10 s, so on this server its session expires between beats: its next call raises
    ``APIStatusError`` 410 at once (the SDK retries 408/409/429/5xx, not 410) instead of retrying forever."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
        sampler = sc.create_sampling_client(base_model=BASE).result()
        session = server.door.sessions[tc.model_id.split(":", 1)[0]]
        backend_id = server.door.models[tc.model_id].backend_id
        _wait_for(lambda: session.expired, "the SDK's session expires")
        assert backend_id not in MockBackend.open_sessions()
        datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8]})
        with pytest.raises(tinker.APIStatusError) as err:
            tc.forward_backward([datum], "cross_entropy").result(timeout=DEADLINE)
        assert err.value.status_code == 410 and "expired" in str(err.value)
        with pytest.raises(tinker.APIStatusError) as err:
            sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result(timeout=DEADLINE)
        assert err.value.status_code == 410
    finally:
        sc.holder.close()


def test_session_timeout_zero_never_expires() -> None:
    import anyio

    from asyncsess.serve.tinker_api import TinkerDoor

    async def main() -> None:
        door = TinkerDoor(MockBackend(), session_timeout=0)
        async with door.running():
            sid = door.create_session({})["session_id"]
            door.sessions[sid].seen -= 10**6  # silent for eleven days
            assert await door.reap() == []
            await anyio.sleep(0.05)
            assert door.sessions[sid].finished is None

    anyio.run(main)


CHILD = """
import sys, time, tinker
from tinker import types
sc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
tc = sc.create_lora_training_client(base_model="mock/bigram-tiny", rank=4).result()
print(tc.model_id, flush=True)
inputs = {"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]}
datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs=inputs)
while True:  # busy, as a training loop is: each request keeps the session alive between the SDK's 10 s heartbeats
    tc.forward([datum], "cross_entropy").result()
    time.sleep(0.2)
"""


def test_asyncsess_serve_reaps_the_session_of_a_killed_sdk_process(tmp_path) -> None:
    """`asyncsess serve --session-timeout 2`; an official-SDK process trains, then is killed with SIGKILL (it cannot
    finish its session): the server expires the session, and a heartbeat on it answers 410."""
    import os
    import signal
    import subprocess
    import sys

    from .conftest import _free_port

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "ASYNCSESS_API_KEYS": API_KEY, "TINKER_TELEMETRY": "0"}
    serve = [sys.executable, "-m", "asyncsess", "serve", "--backend", "mock://", "--port", str(port), "--session-timeout", "2"]
    server = subprocess.Popen(serve, env=env)
    child = None
    try:
        _wait_for(lambda: _answers(url + "/api/v1/healthz"), "the server starts")
        child = subprocess.Popen([sys.executable, "-c", CHILD, url, API_KEY], env=env, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        session_id = child.stdout.readline().strip().split(":", 1)[0]
        assert session_id, "the SDK process did not create its model"
        beat = {"session_id": session_id, "type": "session_heartbeat"}
        headers = {"X-API-Key": API_KEY}
        time.sleep(3 * 2.0)  # the training process keeps its session past three timeouts
        assert child.poll() is None, "the SDK process stopped on its own"
        assert httpx.post(url + "/api/v1/session_heartbeat", json=beat, headers=headers).status_code == 200
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        # any call naming the session would keep it alive, so look once, after a generous wait (3 timeouts)
        time.sleep(3 * 2.0)
        gone = httpx.post(url + "/api/v1/session_heartbeat", json=beat, headers=headers)
        assert gone.status_code == 410 and "expired" in gone.json()["error"] and gone.json()["field"] == "session_id"
    finally:
        for proc in (child, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False


def test_a_sampling_only_tinker_client_keeps_its_session_alive(server: Server) -> None:
    """An asyncsess client on tinker:// that holds only a sampler still heartbeats its server session."""
    import anyio

    from asyncsess import SamplingParams, ServiceClient

    async def main() -> list[int]:
        url = server.url.replace("http://", "tinker://") + f"?api_key={API_KEY}"
        async with ServiceClient(url, heartbeat_interval=TIMEOUT / 5) as svc:
            sampler = await svc.create_sampling_client(base_model=BASE)
            await anyio.sleep(3 * TIMEOUT)  # three timeouts with no request but the heartbeats
            out = await sampler.sample([5, 6, 7], 1, SamplingParams(max_tokens=4, seed=0))
            return list(out.sequences[0].tokens)

    assert len(anyio.run(main)) >= 1
