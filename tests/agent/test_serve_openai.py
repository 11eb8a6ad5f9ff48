"""``asyncsess serve`` hosts both doors: the official openai client against the server's ``/v1`` routes, in-process
(httpx.ASGITransport, the app's own lifespan), on mock://. Samplers are created through the Tinker routes with
plain JSON (the tinker SDK's own run is in tests/tinker/test_openai_door_sdk.py)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import openai
import pytest

from asyncsess.backends import load_backend
from asyncsess.errors import InvalidInputError
from asyncsess.serve.tinker_api import create_app

from .helpers import post_scope

pytestmark = pytest.mark.anyio
KEY_A, KEY_B = "key-a", "key-b"
BASE = "mock/bigram-tiny"
HI = [{"role": "user", "content": "Say hi."}]


@contextlib.asynccontextmanager
async def _server() -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    app = create_app(load_backend("mock://"), {KEY_A, KEY_B}, poll_timeout=5.0)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve", timeout=30) as http:
            yield app, http


@pytest.fixture
async def server() -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    async with _server() as s:
        yield s


def _openai(http: httpx.AsyncClient, key: str, rollout: str | None = None) -> openai.AsyncOpenAI:
    headers = {"X-Rollout-Id": rollout} if rollout else {}
    return openai.AsyncOpenAI(base_url="http://serve/v1", api_key=key, http_client=http, max_retries=0, default_headers=headers)


async def _sampling_session(http: httpx.AsyncClient, key: str, base_model: str = BASE) -> str:
    """A sampling session created over Tinker's wire with ``key``."""
    h = {"X-API-Key": key}
    sid = (await http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}}, headers=h)).json()["session_id"]
    body = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": base_model}
    resp = await http.post("/api/v1/create_sampling_session", json=body, headers=h)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["sampling_session_id"])


async def test_chat_on_a_base_model_is_captured_per_key(server) -> None:
    app, http = server
    client = _openai(http, KEY_A, "r1")
    reply = await client.chat.completions.create(model=BASE, messages=HI, n=2, seed=3, max_tokens=12, logprobs=True)
    assert len(reply.choices) == 2 and reply.usage is not None
    calls = (await http.get("/v1/asyncsess/rollouts/r1", headers={"X-API-Key": KEY_A})).json()["calls"]
    assert len(calls) == 1
    [call] = calls
    assert call["model"] == BASE and call["sampler_id"] == BASE and call["weight_version"] == 0
    assert call["usage"]["prompt_tokens"] == reply.usage.prompt_tokens
    for choice, served in zip(call["choices"], reply.choices):
        assert choice["logprobs"] == [e.logprob for e in served.logprobs.content]
    # the same base sampler serves every key (opened once); key B sees none of key A's captures
    await _openai(http, KEY_B, "r1").chat.completions.create(model=BASE, messages=HI, max_tokens=4)
    assert len(app.state.openai_door._opened) == 1
    b_calls = (await http.get("/v1/asyncsess/rollouts/r1", headers={"Authorization": f"Bearer {KEY_B}"})).json()["calls"]
    assert len(b_calls) == 1 and b_calls[0]["choices"][0]["tokens"] != [] and b_calls[0]["request"]["max_tokens"] == 4
    assert len((await http.get("/v1/asyncsess/rollouts/r1", headers={"X-API-Key": KEY_A})).json()["calls"]) == 1


async def test_a_sampling_session_id_is_a_model_of_its_key_only(server) -> None:
    app, http = server
    sid = await _sampling_session(http, KEY_A)
    reply = await _openai(http, KEY_A, "mine").completions.create(model=sid, prompt=[5, 6, 7], max_tokens=5, seed=1)
    assert reply.model == sid and reply.choices[0].text is not None
    [call] = app.state.openai_door.captures(KEY_A).calls("mine")
    assert call.sampler_id == sid and call.prompt_tokens == [5, 6, 7] and call.weight_version == 0
    ids_a = [m.id for m in (await _openai(http, KEY_A).models.list()).data]
    ids_b = [m.id for m in (await _openai(http, KEY_B).models.list()).data]
    assert sid in ids_a and BASE in ids_a and sid not in ids_b and BASE in ids_b
    # key B gets the same 404 for A's sampler as for a name that never existed
    with pytest.raises(openai.NotFoundError) as theirs:
        await _openai(http, KEY_B, "mine").completions.create(model=sid, prompt=[5, 6, 7], max_tokens=5)
    with pytest.raises(openai.NotFoundError) as nothing:
        await _openai(http, KEY_B, "mine").completions.create(model=sid + "0", prompt=[5, 6, 7], max_tokens=5)
    assert theirs.value.body["code"] == nothing.value.body["code"] == "model_not_found"
    assert theirs.value.body["param"] == "model"
    assert theirs.value.body["message"].replace(sid, "X") == nothing.value.body["message"].replace(sid + "0", "X")
    assert app.state.openai_door.captures(KEY_B).calls("mine") == []
    assert len(app.state.openai_door.captures(KEY_A).calls("mine")) == 1


async def test_responses_on_the_door_are_captured_per_key_and_stream(server) -> None:
    """``POST /v1/responses`` resolves ``model`` and captures as chat does: per key, another key's sampler a 404."""
    app, http = server
    sid = await _sampling_session(http, KEY_A)
    mine = _openai(http, KEY_A, "resp")
    reply = await mine.responses.create(model=sid, input="Say hi.", max_output_tokens=12)
    events = [e async for e in await mine.responses.create(model=sid, input="Say hi.", max_output_tokens=12, stream=True)]
    final = events[-1].response
    plain, streamed = app.state.openai_door.captures(KEY_A).calls("resp")
    assert plain.endpoint == streamed.endpoint == "responses" and plain.sampler_id == sid
    assert reply.usage.output_tokens == len(plain.choices[0].tokens) and final.output_text == streamed.choices[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    with pytest.raises(openai.NotFoundError) as theirs:
        await _openai(http, KEY_B, "resp").responses.create(model=sid, input="Say hi.")
    assert theirs.value.body["code"] == "model_not_found" and app.state.openai_door.captures(KEY_B).calls("resp") == []


async def test_streaming_chat_matches_its_capture(server) -> None:
    app, http = server
    sid = await _sampling_session(http, KEY_A)
    stream = await _openai(http, KEY_A, "s").chat.completions.create(
        model=sid, messages=HI, max_tokens=16, seed=5, stream=True, stream_options={"include_usage": True}
    )
    text, usage = "", None
    async for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
        usage = chunk.usage or usage
    [call] = app.state.openai_door.captures(KEY_A).calls("s")
    assert call.sampler_id == sid and usage is not None
    assert usage.completion_tokens == len(call.choices[0].tokens) > 0
    assert text == call.choices[0].text


@pytest.mark.parametrize(
    "headers, status",
    [({}, 401), ({"Authorization": "Bearer nope"}, 401), ({"X-API-Key": KEY_A + "x"}, 401), ({"Authorization": f"Basic {KEY_A}"}, 401)],
)
async def test_unknown_keys_are_refused(server, headers: dict[str, str], status: int) -> None:
    _, http = server
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/asyncsess/rollouts/r")]:
        kw = {"json": {"model": BASE, "messages": HI}} if method == "POST" else {}
        resp = await http.request(method, path, headers=headers, **kw)
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        ({"messages": HI}, "model"),
        ({"model": 7, "messages": HI}, "model"),
        ({"model": "", "messages": HI}, "model"),
        ({"model": "tinker://nope/sampler_weights/x", "messages": HI}, "model"),
        ({"model": "a\x00b", "messages": HI}, "model"),
        ({"model": "\ud800", "messages": HI}, "model"),
        ({"model": "x" * 100_000, "messages": HI}, "model"),
        ({"model": BASE, "messages": HI, "temperature": math.inf}, "temperature"),
        ({"model": BASE, "messages": HI, "max_tokens": -1}, "max_tokens"),
        ({"model": BASE, "messages": HI, "n": 10_000}, "n"),
        ({"model": BASE, "messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        ({"model": BASE, "messages": HI, "frobnicate": 1}, "frobnicate"),
    ],
)
async def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(server, body: Any, param: str | None) -> None:
    _, http = server
    h = {"X-API-Key": KEY_A, "Content-Type": "application/json"}

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = await http.post("/v1/chat/completions", content=raw, headers=h)
    assert 400 <= resp.status_code < 500, resp.text
    err = resp.json()["error"]
    assert err["message"]
    if param is not None:
        assert param in (err["param"] or "") or param in err["message"], err
    ok = await _openai(http, KEY_A).chat.completions.create(model=BASE, messages=HI, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


async def test_a_training_checkpoint_is_not_a_sampler(server) -> None:
    """A ``tinker://.../weights/...`` path (training state) of the key's own run: a 400 saying so."""
    app, http = server
    h = {"X-API-Key": KEY_A}
    sid = (await http.post("/api/v1/create_session", json={"tags": []}, headers=h)).json()["session_id"]
    fut = await http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": BASE}, headers=h)
    model_id = (await http.post("/api/v1/retrieve_future", json={"request_id": fut.json()["request_id"]}, headers=h)).json()["model_id"]
    fut = await http.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "s1"}, headers=h)
    path = (await http.post("/api/v1/retrieve_future", json={"request_id": fut.json()["request_id"]}, headers=h)).json()["path"]
    assert path.endswith("/weights/s1")
    with pytest.raises(openai.BadRequestError) as err:
        await _openai(http, KEY_A).chat.completions.create(model=path, messages=HI, max_tokens=3)
    assert err.value.body["param"] == "model" and "sampler weights" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        await _openai(http, KEY_B).chat.completions.create(model=path, messages=HI, max_tokens=3)


async def test_the_tinker_routes_hide_another_keys_sessions(server) -> None:
    """The registry both doors share belongs to keys on the Tinker wire too: key B gets the 404 of a never-issued id."""
    _, http = server
    a, b = {"X-API-Key": KEY_A}, {"Authorization": f"Bearer {KEY_B}"}
    sid = (await http.post("/api/v1/create_session", json={"tags": []}, headers=a)).json()["session_id"]
    fut = (await http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": BASE}, headers=a)).json()
    model_id = (await http.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]}, headers=a)).json()["model_id"]
    fut = await http.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 1, "path": "w"}, headers=a)
    path = (await http.post("/api/v1/retrieve_future", json={"request_id": fut.json()["request_id"]}, headers=a)).json()["path"]
    sampler = await _sampling_session(http, KEY_A)
    probes = [
        ("POST", "/api/v1/session_heartbeat", {"session_id": sid}, "session_id"),
        ("GET", f"/api/v1/sessions/{sid}", None, "session_id"),
        ("POST", "/api/v1/create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 9, "base_model": BASE}, "session_id"),
        ("POST", "/api/v1/get_info", {"model_id": model_id}, "model_id"),
        ("POST", "/api/v1/optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.1}}, "model_id"),
        ("GET", f"/api/v1/training_runs/{model_id}", None, "model_id"),
        ("GET", f"/api/v1/samplers/{sampler}", None, "sampling_session_id"),
        ("POST", "/api/v1/asample", {"sampling_session_id": sampler, "seq_id": 1, "prompt": {"chunks": []}}, "sampling_session_id"),
        ("POST", "/api/v1/retrieve_future", {"request_id": fut.json()["request_id"]}, "request_id"),
        ("POST", "/api/v1/weights_info", {"tinker_path": path}, "tinker_path"),
        ("POST", "/api/v1/sessions/" + sid + "/finish", {}, "session_id"),
    ]
    for method, route, body, field in probes:
        resp = await http.request(method, route, json=body, headers=b)
        assert resp.status_code == 404 and resp.json()["field"] == field, (route, resp.text)
        other = ("0" if sid[0] != "0" else "1") + sid[1:]  # a session id that was never issued
        never = route.replace(sid, other)
        fake = None if body is None else json.loads(json.dumps(body).replace(sid, other))
        assert (await http.request(method, never, json=fake, headers=b)).status_code == 404
    for route, key in [
        ("/api/v1/training_runs", "training_runs"),
        ("/api/v1/checkpoints", "checkpoints"),
        ("/api/v1/sessions", "sessions"),
    ]:
        assert (await http.get(route, headers=b)).json()[key] == []
        assert len((await http.get(route, headers=a)).json()[key]) >= 1
    # key A still has everything (B's finish did not stop A's session)
    assert (await http.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=a)).status_code == 200
    assert (await http.post("/api/v1/weights_info", json={"tinker_path": path}, headers=a)).json()["base_model"] == BASE


async def _sampler_saved_as_pub(http, a: dict[str, str]) -> tuple[str, str]:
    """A new model of key ``a`` and the tinker:// path of its sampler weights saved as ``pub``."""
    sid = (await http.post("/api/v1/create_session", json={"tags": []}, headers=a)).json()["session_id"]
    fut = (await http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": BASE}, headers=a)).json()
    model_id = (await http.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]}, headers=a)).json()["model_id"]
    fut = await http.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 1, "path": "pub"}, headers=a)
    path = (await http.post("/api/v1/retrieve_future", json={"request_id": fut.json()["request_id"]}, headers=a)).json()["path"]
    return model_id, path


async def test_a_published_sampler_path_serves_every_key_with_captures_apart(server) -> None:
    app, http = server
    a = {"X-API-Key": KEY_A}
    model_id, path = await _sampler_saved_as_pub(http, a)
    with pytest.raises(openai.NotFoundError):
        await _openai(http, KEY_B, "p").completions.create(model=path, prompt=[5, 6], max_tokens=3)
    resp = await http.post(f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/pub/publish", headers=a)
    assert resp.status_code == 204
    await _openai(http, KEY_B, "p").completions.create(model=path, prompt=[5, 6], max_tokens=3, seed=2)
    await _openai(http, KEY_A, "p").completions.create(model=path, prompt=[5, 6, 7], max_tokens=3, seed=2)
    [b_call] = app.state.openai_door.captures(KEY_B).calls("p")
    [a_call] = app.state.openai_door.captures(KEY_A).calls("p")
    assert (b_call.prompt_tokens, a_call.prompt_tokens) == ([5, 6], [5, 6, 7])
    assert b_call.sampler_id == a_call.sampler_id == path
    assert len(app.state.openai_door._opened) == 1  # one sampler on those weights, shared


async def test_an_unpublished_or_deleted_path_serves_no_other_key_any_more(server) -> None:
    """Key B sampled key A's published weights; once A unpublishes them, or deletes them, B gets the 404 of a
    path it never saw (B's cached front kept serving them)."""
    app, http = server
    a = {"X-API-Key": KEY_A}
    model_id, path = await _sampler_saved_as_pub(http, a)
    route = f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/pub"
    b_client = _openai(http, KEY_B)
    for take_back in ("/publish", ""):  # unpublish, then (published again) delete
        assert (await http.post(route + "/publish", headers=a)).status_code == 204
        await b_client.completions.create(model=path, prompt=[5, 6], max_tokens=2)  # B may use it while published
        assert (await http.delete(route + take_back, headers=a)).status_code == 204
        with pytest.raises(openai.NotFoundError):
            await b_client.completions.create(model=path, prompt=[5, 6], max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await b_client.chat.completions.create(model=path, messages=HI, max_tokens=2)
    assert path not in [m.id for m in (await b_client.models.list()).data]


async def test_a_rollout_id_with_slashes_is_read_back_and_dot_segments_are_refused(server) -> None:
    """A rollout id such as "task/3/sample-0" was captured, but GET/DELETE /v1/asyncsess/rollouts/task/3/sample-0
    matched no route (404): a trainer in another process never got those calls."""
    _, http = server
    h = {"X-API-Key": KEY_A}
    body = {"model": BASE, "messages": HI, "max_tokens": 2}
    for rollout, where in [
        ("task/3/sample-0", {"headers": {"X-Rollout-Id": "task/3/sample-0"}}),
        ("a//b/", {"metadata": {"rollout_id": "a//b/"}}),
    ]:
        extra = where.get("metadata")
        resp = await http.post(
            "/v1/chat/completions", json={**body, **({"metadata": extra} if extra else {})}, headers={**h, **where.get("headers", {})}
        )
        assert resp.status_code == 200, resp.text
        got = await http.get(f"/v1/asyncsess/rollouts/{rollout}", headers=h)
        assert got.status_code == 200 and got.json()["rollout_id"] == rollout and len(got.json()["calls"]) == 1, got.text
        taken = await http.delete(f"/v1/asyncsess/rollouts/{rollout}", headers=h)
        assert len(taken.json()["calls"]) == 1 and (await http.get(f"/v1/asyncsess/rollouts/{rollout}", headers=h)).json()["calls"] == []
    for rollout in (".", "..", "a/../b", "a/./b", "x/.."):  # a URL cannot carry these: refused before sampling
        resp = await http.post("/v1/chat/completions", json={**body, "user": rollout}, headers=h)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "user", resp.text  # where it came from
        resp = await http.post("/v1/chat/completions", json={**body, "metadata": {"rollout_id": rollout}}, headers=h)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "metadata.rollout_id", resp.text
        resp = await http.post("/v1/chat/completions", json=body, headers={**h, "X-Rollout-Id": rollout})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-rollout-id", resp.text


async def test_an_unknown_route_or_method_is_refused_in_each_doors_shape(server) -> None:
    """FastAPI's bare {"detail": "Not Found"} was the answer on both doors (the official client's responses.retrieve
    hits a route serve does not have: it stores no responses)."""
    _, http = server
    with pytest.raises(openai.NotFoundError) as err:
        await _openai(http, KEY_A).responses.retrieve("resp_1")
    assert err.value.body["param"] == "path" and err.value.body["code"] == "not_found"
    resp = await http.get("/v1/chat/completions", headers={"X-API-Key": KEY_A})
    error = resp.json()["error"]
    assert resp.status_code == 405 and set(error) == {"message", "type", "param", "code"} and error["param"] == "method", resp.text
    assert resp.headers["allow"] == "POST"  # a 405 says which methods the path takes
    resp = await http.get("/api/v1/no_such_route", headers={"X-API-Key": KEY_A})
    assert resp.status_code == 404 and resp.json()["field"] == "path" and resp.json()["fix"], resp.text


async def test_models_retrieve_answers_what_models_list_lists_for_the_key(server) -> None:
    """``client.models.retrieve`` was a 404 'path not found' for every model (serve had no /v1/models/{id} route)."""
    _, http = server
    a = {"X-API-Key": KEY_A}
    sid = await _sampling_session(http, KEY_A)
    _, path = await _sampler_saved_as_pub(http, a)
    mine = _openai(http, KEY_A)
    listed = [m.id for m in (await mine.models.list()).data]
    assert {BASE, sid, path} <= set(listed)
    for name in listed:
        assert (await mine.models.retrieve(name)).model_dump() == next(
            m for m in (await mine.models.list()).data if m.id == name
        ).model_dump()
    for client, name in ((_openai(http, KEY_B), sid), (_openai(http, KEY_B), path), (mine, "nope/x")):
        with pytest.raises(openai.NotFoundError) as err:
            await client.models.retrieve(name)
        assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        await _openai(http, "wrong").models.retrieve(BASE)


async def test_a_finished_sessions_sampler_is_gone_not_a_5xx(server) -> None:
    _, http = server
    sampler = await _sampling_session(http, KEY_A)
    client = _openai(http, KEY_A)
    await client.completions.create(model=sampler, prompt=[5, 6], max_tokens=2)
    session = sampler.split(":")[0]
    assert (await http.post(f"/api/v1/sessions/{session}/finish", json={}, headers={"X-API-Key": KEY_A})).status_code == 200
    with pytest.raises(openai.APIStatusError) as err:
        await client.completions.create(model=sampler, prompt=[5, 6], max_tokens=2)
    assert err.value.status_code == 410 and err.value.body["param"] == "model" and err.value.body["code"] == "model_gone"
    assert (await client.completions.create(model=BASE, prompt=[5, 6], max_tokens=2)).choices


async def test_a_body_over_the_limit_is_a_413_in_each_doors_shape_and_the_server_goes_on() -> None:
    app = create_app(load_backend("mock://"), {KEY_A}, poll_timeout=5.0, max_body_bytes=4096)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve", timeout=30) as http:
            h = {"X-API-Key": KEY_A}
            big = {"tags": [], "user_metadata": {"x": "y" * 5000}}
            resp = await http.post("/api/v1/create_session", json=big, headers=h)  # declared by Content-Length
            assert resp.status_code == 413 and resp.json()["field"] == "body" and "4096" in resp.json()["fix"]

            async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams in
                yield b'{"tags": [], "user_metadata": {"x": "'
                for _ in range(10):
                    yield b"y" * 1000
                yield b'"}}'

            resp = await http.post("/api/v1/create_session", content=chunks(), headers={**h, "Content-Type": "application/json"})
            assert resp.status_code == 413 and resp.json()["field"] == "body"
            with pytest.raises(openai.APIStatusError) as err:
                await _openai(http, KEY_A).chat.completions.create(model=BASE, messages=[{"role": "user", "content": "y" * 5000}])
            assert err.value.status_code == 413
            assert err.value.body["param"] == "body" and err.value.body["code"] == "body_too_large"  # type: ignore[index]
            await _sampling_session(http, KEY_A)  # small bodies still go through
            reply = await _openai(http, KEY_A).chat.completions.create(model=BASE, messages=HI, max_tokens=4)
            assert reply.choices[0].message.content is not None


async def _slow_loris(app: Any, path: str) -> list[dict[str, Any]]:
    """What ``app`` sends a client that sends the start of a body to ``path`` and then nothing (for 30 s)."""
    import anyio

    scope = post_scope(path, [(b"x-api-key", KEY_A.encode())], server="serve")
    chunks = [{"type": "http.request", "body": b'{"model": "', "more_body": True}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if chunks:
            return chunks.pop(0)
        with anyio.move_on_after(30):  # the rest of the body never comes (the fix answers after 0.1 s)
            await anyio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


async def test_a_body_still_arriving_at_the_deadline_is_a_408_in_each_doors_shape_and_a_long_call_is_not() -> None:
    """A slow-loris client (a body that never finishes arriving) held its connection, and the handler waiting on it,
    for as long as it liked. The body now has ``max_body_seconds`` to arrive; a call that samples for longer once
    its body is in is answered (the server's wait for a hang-up is not timed)."""
    app = create_app(load_backend("mock://?latency_ms=300"), {KEY_A}, poll_timeout=5.0, max_body_seconds=0.1)
    async with app.router.lifespan_context(app):
        for path, field in (("/v1/chat/completions", "param"), ("/api/v1/create_session", "field")):
            sent = await _slow_loris(app, path)
            assert sent[0]["status"] == 408, sent
            body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
            err = body["error"] if field == "param" else body  # OpenAI's shape, Tinker's
            assert err[field] == "body" and "0.1 s" in json.dumps(body), body
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve", timeout=30) as http:
            reply = await _openai(http, KEY_A).chat.completions.create(model=BASE, messages=HI, max_tokens=4)  # samples 0.3 s
            assert reply.choices[0].message.content is not None


async def test_a_deleted_or_overwritten_checkpoint_does_not_keep_its_sampler_open(server) -> None:
    """The door opened a sampler per checkpoint path sampled and kept it for good: a deleted checkpoint's weights
    stayed loaded on the backend (one more per checkpoint ever sampled), and an overwritten one kept serving the
    old weights. A changed record now closes its sampler; the next call opens one on what the path holds."""
    app, http = server
    a = {"X-API-Key": KEY_A}
    backend = app.state.tinker_door.backend
    model_id, path = await _sampler_saved_as_pub(http, a)
    client = _openai(http, KEY_A)
    await client.completions.create(model=path, prompt=[5, 6], max_tokens=2)
    [(first, _, _)] = app.state.openai_door._opened.values()
    body = {"model_id": model_id, "seq_id": 2, "path": "pub", "overwrite": True}
    fut = await http.post("/api/v1/save_weights_for_sampler", json=body, headers=a)
    assert (await http.post("/api/v1/retrieve_future", json={"request_id": fut.json()["request_id"]}, headers=a)).status_code == 200
    await client.completions.create(model=path, prompt=[5, 6], max_tokens=2)
    [(second, _, _)] = app.state.openai_door._opened.values()
    assert second != first and first not in backend._samplers  # the old weights' sampler was stopped
    assert (await http.delete(f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/pub", headers=a)).status_code == 204
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model=path, prompt=[5, 6], max_tokens=2)
    assert app.state.openai_door._opened == {} and second not in backend._samplers


async def test_samplers_on_checkpoint_paths_are_bounded_least_recently_used_first(server) -> None:
    """A key that sampled checkpoint after checkpoint (an eval over a run's saves) kept a sampler open on each, for
    good. Past ``max_open_paths`` the least recently used one serving no call is stopped; it reopens when named."""
    app, http = server
    a = {"X-API-Key": KEY_A}
    oai, backend = app.state.openai_door, app.state.tinker_door.backend
    oai.max_open_paths = 2
    sid = (await http.post("/api/v1/create_session", json={"tags": []}, headers=a)).json()["session_id"]
    fut = (await http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": BASE}, headers=a)).json()
    model_id = (await http.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]}, headers=a)).json()["model_id"]
    paths = []
    for i in range(4):
        body = {"model_id": model_id, "seq_id": i + 1, "path": f"p{i}"}
        fut = (await http.post("/api/v1/save_weights_for_sampler", json=body, headers=a)).json()
        paths.append((await http.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]}, headers=a)).json()["path"])
    client = _openai(http, KEY_A)
    opened = []
    for path in [*paths, paths[0]]:
        await client.completions.create(model=path, prompt=[5, 6], max_tokens=2)
        opened.append(oai._opened[path][0])
        assert len(oai._opened) == min(len(opened), 2), oai._opened
    assert list(oai._opened) == [paths[3], paths[0]] and opened[-1] != opened[0]  # p0 was closed, then reopened
    assert not any(o in backend._samplers for o in opened[:3])  # and the closed samplers are stopped on the backend


async def test_a_sampler_slow_to_open_for_one_key_holds_no_other_keys_call(server) -> None:
    """Every call on a base model or checkpoint path took one lock of the door while its sampler was opened, and
    held it across the backend's create: key B's chat on the base model waited for key A's checkpoint to load (seconds
    for merged weights; for good on a backend that hangs). Now a sampler is opened under a lock of its own."""
    app, http = server
    backend = app.state.tinker_door.backend
    _, path = await _sampler_saved_as_pub(http, {"X-API-Key": KEY_A})
    loading, release, opened = anyio.Event(), anyio.Event(), []
    create = backend.create_sampler

    async def slow_for_paths(spec: Any) -> str:
        opened.append(spec.model_path or spec.base_model)
        if spec.model_path is not None:
            loading.set()
            await release.wait()
        return await create(spec)

    backend.create_sampler = slow_for_paths
    replies: list[Any] = []
    with anyio.fail_after(30):  # (a hang guard)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _completion(http, KEY_A, path, replies))
            tg.start_soon(lambda: _completion(http, KEY_A, path, replies))  # a second call on it waits, opens nothing
            await loading.wait()
            await _completion(http, KEY_B, BASE, replies)  # while A's path loads
            assert [r.model for r in replies] == [BASE]
            release.set()
    assert [r.model for r in replies] == [BASE, path, path] and len(opened) == 2 and len(app.state.openai_door._opened) == 2


async def _completion(http: httpx.AsyncClient, key: str, model: str, replies: list[Any]) -> None:
    replies.append(await _openai(http, key).completions.create(model=model, prompt=[5, 6], max_tokens=2))


@pytest.mark.parametrize("case", ["deleted", "refused", "base"])
async def test_a_sampler_the_backend_refuses_to_open_is_a_4xx_naming_model(server, case: str) -> None:
    """A checkpoint deleted between the door's look-up of ``model`` and its sampler's opening (another call of its key,
    say) made the backend's refusal a 500; it is the 404 of a path that is gone, and a refusal of a path still held (or
    of a base model that does not load) a 400 ``model_not_sampleable`` naming ``model``."""
    app, http = server
    backend, a = app.state.tinker_door.backend, {"X-API-Key": KEY_A}
    model_id, path = await _sampler_saved_as_pub(http, a)
    create = backend.create_sampler

    async def refused(spec: Any) -> str:
        if case == "deleted":  # gone while the door opened it
            assert (await http.delete(f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/pub", headers=a)).status_code == 204
            return await create(spec)
        raise InvalidInputError("the weights cannot be read", field="model_path")

    backend.create_sampler = refused
    body = {"model": BASE if case == "base" else path, "prompt": [5, 6], "max_tokens": 2}
    r = await http.post("/v1/completions", json=body, headers=a)
    assert r.status_code == (404 if case == "deleted" else 400), r.text
    assert r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == ("model_not_found" if case == "deleted" else "model_not_sampleable")
