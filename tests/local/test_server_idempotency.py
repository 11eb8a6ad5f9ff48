"""Idempotent creates over http:// (``Idempotency-Key``): a create whose reply was lost after the worker made the
session is retried by the client and answered with that session, not a second one (before, the retry made a second
session, which held its LoRA and optimizer state until the idle timeout). A key reused for another body is a 409,
another tenant's same key is its own create, and a garbage key is a 400 naming the header."""

from __future__ import annotations

import json

import httpx
import pytest

torch = pytest.importorskip("torch")

from asyncsess import ServiceClient  # noqa: E402

from .server_helpers import KEY, MINE, THEIRS, assert_refused, start_worker  # noqa: E402

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    w = start_worker(tiny, str(tmp_path_factory.mktemp("idempotency-ckpt")))
    yield w
    w.stop()


class LoseFirstReply(httpx.AsyncBaseTransport):
    """Forwards every request to the worker; the first reply to a POST on each of ``paths`` is read and then lost (a
    ReadError: the connection dropped after the worker answered). Records each request's path and Idempotency-Key."""

    def __init__(self, *paths: str) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.to_lose = set(paths)
        self.sent: list[tuple[str, str | None]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.url.path, request.headers.get("idempotency-key")))
        response = await self.inner.handle_async_request(request)
        if request.method == "POST" and request.url.path in self.to_lose:
            self.to_lose.discard(request.url.path)
            await response.aread()  # the worker answered in full
            await response.aclose()
            raise httpx.ReadError("the connection dropped after the worker answered", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.anyio
async def test_a_create_whose_reply_is_lost_is_retried_into_the_same_session(worker, tiny):
    engine = worker.backend.engine
    lose = LoseFirstReply("/v1/sessions", "/v1/samplers")
    async with ServiceClient(worker.url, api_key=KEY, transport=lose, heartbeat_interval=0) as svc:
        sessions, samplers = set(engine.sessions), set(engine.samplers)
        tc = await svc.create_lora_training_client(tiny, rank=2, seed=0)
        sc = await svc.create_sampling_client(base_model=tiny)
        assert set(engine.sessions) - sessions == {tc.model_id}, "the retry made no second session"
        assert set(engine.samplers) - samplers == {sc.sampler_id}, "nor a second sampler"
        assert svc.retries == 2 and not lose.to_lose  # each reply was lost once, and each create retried
        for path in ("/v1/sessions", "/v1/samplers"):
            keys = [k for p, k in lose.sent if p == path]
            assert len(keys) == 2 and keys[0] == keys[1] and keys[0], keys  # one key per create, on both tries
        again = await svc.create_lora_training_client(tiny, rank=2, seed=0)  # a new create: a new key, a new session
        assert again.model_id != tc.model_id and again.model_id in engine.sessions
        assert len({k for p, k in lose.sent if p == "/v1/sessions"}) == 2


def _create(c: httpx.Client, path: str, body: dict, headers: dict, key: str | bytes | None) -> httpx.Response:
    return c.post(path, json=body, headers={**headers, **({"Idempotency-Key": key} if key is not None else {})})


def test_a_key_is_one_create_per_tenant_and_another_body_under_it_is_a_409(c, worker, tiny):
    engine = worker.backend.engine
    body = {"base_model": tiny, "rank": 2, "seed": 0}
    before = set(engine.sessions)
    first = _create(c, "/v1/sessions", body, MINE, "create-1")
    assert first.status_code == 200, first.text
    sid = first.json()["model_id"]
    again = _create(c, "/v1/sessions", {"seed": 0, "rank": 2, "base_model": tiny}, MINE, "create-1")  # the same body, reordered
    assert again.status_code == 200 and again.json() == first.json()
    assert set(engine.sessions) - before == {sid}
    for path, other in [("/v1/sessions", {**body, "rank": 4}), ("/v1/samplers", {"base_model": tiny})]:
        err = assert_refused(_create(c, path, other, MINE, "create-1"), "Idempotency-Key", status=409)
        assert err["type"] == "ConflictError" and "create-1" in err["message"], err
    theirs = _create(c, "/v1/sessions", body, THEIRS, "create-1")  # another tenant's key of the same text
    assert theirs.status_code == 200 and theirs.json()["model_id"] not in (sid, *before)
    plain = [_create(c, "/v1/sessions", body, MINE, None) for _ in range(2)]  # no key: every create is a new one
    assert len({r.json()["model_id"] for r in plain}) == 2
    assert set(engine.sessions) - before == {sid, theirs.json()["model_id"], *(r.json()["model_id"] for r in plain)}
    smp = [_create(c, "/v1/samplers", {"base_model": tiny}, MINE, "sampler-1") for _ in range(2)]
    assert smp[0].status_code == 200 and smp[0].json() == smp[1].json()
    for r in (first, theirs, *plain, smp[0]):
        oid = r.json().get("model_id") or r.json()["sampler_id"]
        c.delete(f"/v1/sessions/{oid}", headers=THEIRS if r is theirs else MINE)


@pytest.mark.parametrize(
    "key",
    ["", "-leading-dash", "a b", "k" * 256, "key/../x", "k\\ey", b"cl\xe9", ["a", "b"]],
    ids=["empty", "dash", "inner-space", "256-chars", "slash", "backslash", "latin-1", "twice"],
)
def test_a_garbage_idempotency_key_is_a_400_naming_it_and_makes_nothing(c, worker, tiny, key):
    engine = worker.backend.engine
    before = (set(engine.sessions), set(engine.samplers))
    headers = [*MINE.items(), *(("Idempotency-Key", k) for k in (key if isinstance(key, list) else [key]))]
    for path, body in [("/v1/sessions", {"base_model": tiny, "rank": 2}), ("/v1/samplers", {"base_model": tiny})]:
        assert_refused(c.post(path, json=body, headers=headers), "Idempotency-Key")
    assert (set(engine.sessions), set(engine.samplers)) == before
    ok = _create(c, "/v1/samplers", {"base_model": tiny}, MINE, "a" * 255)  # the longest key
    assert ok.status_code == 200, ok.text
    c.delete(f"/v1/sessions/{ok.json()['sampler_id']}", headers=MINE)


@pytest.mark.anyio
async def test_a_retry_waits_for_the_first_try_and_a_failed_first_try_leaves_no_trace():
    import anyio

    from asyncsess_local.idempotency import Creates

    creates = Creates()
    made: list[str] = []
    go = anyio.Event()

    async def create(name: str, slow: bool, fail: bool = False) -> None:
        async with creates.once("tenant", "k", "/v1/sessions", {"rank": 2}) as once:
            if once.reply is None:
                if slow:
                    await go.wait()
                if fail:
                    raise RuntimeError("the create failed")
                made.append(name)
                once.reply = {"model_id": name}
        replies.append(once.reply["model_id"])

    replies: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(create, "first", True)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(create, "retry", False)
        await anyio.wait_all_tasks_blocked()
        assert replies == [] and made == []  # the retry waits for the first try
        go.set()
    assert made == ["first"] and replies == ["first", "first"]

    async def failing() -> None:
        with pytest.raises(RuntimeError):
            await create("broken", True, True)

    go, made, replies = anyio.Event(), [], []
    creates = Creates()
    async with anyio.create_task_group() as tg:
        tg.start_soon(failing)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(create, "retry", False)
        await anyio.wait_all_tasks_blocked()
        go.set()
    assert made == ["retry"] and replies == ["retry"]  # the first try failed and kept nothing: the retry made it
    assert len(creates) == 1


def test_the_replies_kept_are_bounded_in_time_and_number():
    import anyio

    from asyncsess_local.idempotency import Creates

    now = [0.0]
    creates = Creates(ttl=100.0, max_per_tenant=3, clock=lambda: now[0])

    async def create(tenant: str, key: str, name: str) -> str:
        async with creates.once(tenant, key, "/v1/samplers", {}) as once:
            once.reply = once.reply or {"sampler_id": name}
        return str(once.reply["sampler_id"])

    async def main() -> None:
        assert [await create("t", f"k{i}", f"s{i}") for i in range(5)] == [f"s{i}" for i in range(5)]
        assert len(creates) == 3 and await create("t", "k4", "new") == "s4"  # the newest kept, the oldest dropped
        assert await create("t", "k0", "new") == "new"
        assert await create("other", "k4", "theirs") == "theirs" and len(creates) == 4  # per tenant
        now[0] = 100.0
        assert await create("t", "k4", "later") == "later"  # past the ttl: a new create
        assert len(creates) == 2  # the tenant's expired replies were dropped; the other tenant's wait for its next create

    anyio.run(main)


class LoseEveryReply(LoseFirstReply):
    """Every reply to a POST on ``paths`` is read (kept in ``lost``) and then lost: the client never learns what the
    worker made."""

    def __init__(self, *paths: str) -> None:
        super().__init__(*paths)
        self.lost: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.url.path, request.headers.get("idempotency-key")))
        response = await self.inner.handle_async_request(request)
        if request.method == "POST" and request.url.path in self.to_lose:
            self.lost.append(json.loads(await response.aread()))
            await response.aclose()
            raise httpx.ReadError("the connection dropped after the worker answered", request=request)
        return response


@pytest.mark.anyio
async def test_a_create_the_client_gave_up_on_is_stopped_on_the_worker_at_once(worker, tiny):
    """Every reply of a create lost: the session the worker made held its LoRA until the idle timeout. The client now
    calls the create off (``DELETE /v1/creates/{key}``) as soon as it gives up: the session is stopped while the
    client is still open, and the key makes nothing after that."""
    import anyio

    from asyncsess import RetryPolicy
    from asyncsess.errors import RetriesExhaustedError

    engine = worker.backend.engine
    lose = LoseEveryReply("/v1/sessions")
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, jitter=0.0)
    async with ServiceClient(worker.url, api_key=KEY, transport=lose, heartbeat_interval=0, retry=policy) as svc:
        before = set(engine.sessions)
        with pytest.raises(RetriesExhaustedError):
            await svc.create_lora_training_client(tiny, rank=2, seed=0)
        made = {r["model_id"] for r in lose.lost}
        assert len(lose.lost) == 2 and len(made) == 1, lose.lost  # two tries, one session made (the retry was answered with it)
        (made,) = made
        with anyio.fail_after(60):  # a hang guard, not a timing check
            while made in engine.sessions:
                await anyio.sleep(0.02)
        called_off = [(p, k) for p, k in lose.sent if p.startswith("/v1/creates/")]
        (key,) = {k for p, k in lose.sent if p == "/v1/sessions"}
        assert called_off == [(f"/v1/creates/{key}", None)]
    with httpx.Client(base_url=worker.url, timeout=120) as c:
        late = _create(c, "/v1/sessions", {"base_model": tiny, "rank": 2, "seed": 0}, MINE, key)  # a try still in the network
        assert assert_refused(late, "Idempotency-Key", 409)["type"] == "ConflictError"
        assert set(engine.sessions) == before


def test_calling_a_create_off_stops_only_the_callers_own(c, worker, tiny):
    engine = worker.backend.engine
    mine = _create(c, "/v1/samplers", {"base_model": tiny}, MINE, "off-1")
    assert mine.status_code == 200, mine.text
    sid = mine.json()["sampler_id"]
    assert c.delete("/v1/creates/off-1", headers=THEIRS).status_code == 204  # another tenant's same key: theirs, not mine
    assert sid in engine.samplers
    assert c.delete("/v1/creates/off-1", headers=MINE).status_code == 204
    assert sid not in engine.samplers
    assert c.delete("/v1/creates/off-1", headers=MINE).status_code == 204  # again: nothing left to stop
    assert c.delete("/v1/creates/never-sent", headers=MINE).status_code == 204  # the create never reached the worker
    before = set(engine.samplers)
    for key in ("off-1", "never-sent"):
        assert_refused(_create(c, "/v1/samplers", {"base_model": tiny}, MINE, key), "Idempotency-Key", 409)  # a late try makes nothing
    assert set(engine.samplers) == before
    theirs = _create(c, "/v1/samplers", {"base_model": tiny}, THEIRS, "never-sent")  # my calling-off left their key alone
    assert theirs.status_code == 200, theirs.text
    c.delete(f"/v1/sessions/{theirs.json()['sampler_id']}", headers=THEIRS)
    assert_refused(c.delete("/v1/creates/a%20b", headers=MINE), "Idempotency-Key")
    assert c.delete("/v1/creates/x", headers={}).status_code == 401


def test_calling_off_a_create_under_way_waits_for_what_it_makes():
    import anyio

    from asyncsess.errors import ConflictError
    from asyncsess_local.idempotency import Creates

    creates, go, got = Creates(), None, []

    async def create() -> None:
        async with creates.once("t", "k", "/v1/sessions", {}) as once:
            await go.wait()
            once.reply = {"model_id": "made"}

    async def main() -> None:
        nonlocal go
        go = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(create)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(lambda: _abandon(got))
            await anyio.wait_all_tasks_blocked()
            assert got == []  # it waits for the create under way
            go.set()
        assert got == [{"model_id": "made"}]  # what to stop
        with pytest.raises(ConflictError):
            async with creates.once("t", "k", "/v1/sessions", {}):
                pass

    async def _abandon(out: list) -> None:
        out.append(await creates.abandon("t", "k"))

    anyio.run(main)
