"""``asyncsess serve`` at the HTTP level, as an attacker would hit it: every bad input gets a 4xx whose JSON
body names the field, never a 5xx; and the command starts, answers and refuses unknown keys."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from asyncio import _get_running_loop as _running_loop
from typing import Any

import httpx
import pytest

from asyncsess.serve import json_body, tinker_proto
from asyncsess.types import Datum, ModelInput

from .conftest import API_KEY, Server, _free_port

pytestmark = pytest.mark.tinker

H = {"X-API-Key": API_KEY}


@pytest.fixture(scope="module")
def model(mock_server: Server) -> tuple[httpx.Client, str, str]:
    c = httpx.Client(base_url=mock_server.url, headers=H, timeout=30)
    sid = c.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()["session_id"]
    fut = c.post(
        "/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": "mock/bigram-tiny", "lora_config": {"rank": 4}}
    )
    model_id = c.post("/api/v1/retrieve_future", json={"request_id": fut.json()["request_id"]}).json()["model_id"]
    return c, sid, model_id


def _refused(resp: httpx.Response, status: int, field: str | None) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["error"]
    if field is not None:
        assert field in (body.get("field") or "") or field in body["error"], body


def _post_in_thread(url: str, route: str, body: bytes, done: list[httpx.Response], state: threading.Condition) -> threading.Thread:
    """POST ``body`` to ``route`` from a started thread; its answer is appended to ``done`` (``state`` notified)."""

    def send() -> None:
        with httpx.Client(base_url=url, headers=H, timeout=60) as own:
            r = own.post(route, content=body, headers={"Content-Type": "application/json"})
        with state:
            done.append(r)
            state.notify_all()

    thread = threading.Thread(target=send)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "path, payload, field",
    [
        ("/api/v1/create_session", b"{not json", "body"),
        ("/api/v1/create_session", b"[1, 2]", "body"),
        ("/api/v1/create_model", {"session_id": "nope", "model_seq_id": 0, "base_model": "m"}, "session_id"),
        ("/api/v1/session_heartbeat", {"session_id": "a\x00b"}, "session_id"),
        ("/api/v1/session_heartbeat", b'{"session_id": "\\ud800"}', "session_id"),
        ("/api/v1/get_info", {"model_id": "x" * 100_000}, "model_id"),
        ("/api/v1/retrieve_future", {"request_id": 12}, "request_id"),
        ("/api/v1/retrieve_future", {"request_id": "never-issued"}, "request_id"),
        ("/api/v1/weights_info", {"tinker_path": "tinker://nope/weights/x"}, "tinker_path"),
        ("/api/v1/create_session", b'{"a":' * 100_000, "body"),  # RecursionError in json.loads: once a 500
        ("/api/v1/sessions/search", b"[" * 100_000 + b"]" * 100_000, "body"),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_field(model, path: str, payload, field: str) -> None:
    c, _, _ = model
    kw = {"content": payload, "headers": {"Content-Type": "application/json"}} if isinstance(payload, bytes) else {"json": payload}
    resp = c.post(path, **kw)
    assert 400 <= resp.status_code < 500, resp.text
    _refused(resp, resp.status_code, field)


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/api/v1/create_session", {"tags": 5e-324, "user_metadata": {}}, "tags"),
        ("/api/v1/create_session", {"tags": ["a", "\ud800"]}, "tags"),
        ("/api/v1/create_session", {"user_metadata": [1]}, "user_metadata"),
        ("/api/v1/create_session", {"user_metadata": True}, "user_metadata"),
        ("/api/v1/create_session", {"user_metadata": {"k": "a\x00b"}}, "user_metadata"),
        ("/api/v1/create_model", {"model_seq_id": 90, "base_model": "mock/bigram-tiny", "user_metadata": "x"}, "user_metadata"),
        # "false" was read as True (any non-empty string)
        (
            "/api/v1/create_model",
            {"model_seq_id": 91, "base_model": "mock/bigram-tiny", "lora_config": {"rank": 4, "train_mlp": "false"}},
            "train_mlp",
        ),
        ("/api/v1/create_sampling_session", {"sampling_session_seq_id": 90, "base_model": 2**63}, "base_model"),
        ("/api/v1/create_sampling_session", {"sampling_session_seq_id": 91, "base_model": "\ud800"}, "base_model"),
        ("/api/v1/create_sampling_session", {"sampling_session_seq_id": 92, "model_path": True}, "model_path"),
    ],
)
def test_wrongly_typed_session_fields_are_refused_not_a_500(model, path: str, body: dict, field: str) -> None:
    """Once a 500 (a TypeError, or a lone surrogate reaching the backend); the session is not created."""
    c, sid, _ = model
    raw = json.dumps({"session_id": sid, **body}).encode()  # keeps \ud800 as an escape
    _refused(c.post(path, content=raw, headers={"Content-Type": "application/json"}), 400, field)
    assert c.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200


@pytest.mark.parametrize(
    "body, field",
    [
        ({"seq_id": 2**70, "adam_params": {}}, "seq_id"),
        ({"seq_id": 0, "adam_params": {}}, "seq_id"),
        ({"seq_id": True, "adam_params": {}}, "seq_id"),
        ({"seq_id": 5, "adam_params": {"learning_rate": "NaN"}}, "learning_rate"),
        ({"seq_id": 6, "adam_params": {"learning_rate": -1}}, "learning_rate"),
        ({"seq_id": 7, "optimizer_params": {"type": "dimuon", "learning_rate": 1}}, "optimizer_params"),
    ],
)
def test_bad_optim_steps_are_refused(model, body: dict, field: str) -> None:
    c, _, model_id = model
    _refused(c.post("/api/v1/optim_step", json={"model_id": model_id, **body}), 400, field)


def test_bad_forward_backward_bodies(model) -> None:
    c, _, model_id = model
    proto = {"Content-Type": "application/x-protobuf"}
    _refused(c.post("/api/v1/forward_backward", content=b"\xff\x00garbage", headers=proto), 400, "body")
    _refused(c.post("/api/v1/forward_backward", content=b"not zstd", headers={**proto, "Content-Encoding": "zstd"}), 400, "body")
    _refused(c.post("/api/v1/forward_backward", json={"model_id": model_id}), 415, "Content-Type")
    nan_datum = Datum(model_input=ModelInput.from_ints([1, 40]), loss_fn_inputs={"target_tokens": [40, 41], "weights": [float("nan"), 1.0]})
    raw = tinker_proto.encode_forward_backward(model_id, 50, [nan_datum], "cross_entropy")
    _refused(c.post("/api/v1/forward_backward", content=raw, headers=proto), 400, "weights")
    good = Datum(model_input=ModelInput.from_ints([1, 40]), loss_fn_inputs={"target_tokens": [40, 41], "weights": [1.0, 1.0]})
    unknown = tinker_proto.encode_forward_backward("no-such-model", 1, [good], "cross_entropy")
    _refused(c.post("/api/v1/forward_backward", content=unknown, headers=proto), 404, "model_id")
    bad_loss = tinker_proto.encode_forward_backward(model_id, 51, [good], "not-a-loss")
    _refused(c.post("/api/v1/forward_backward", content=bad_loss, headers=proto), 400, "loss_fn")


def test_auth_is_required_except_healthz(mock_server: Server) -> None:
    assert httpx.get(mock_server.url + "/api/v1/healthz").json() == {"status": "ok"}
    _refused(httpx.post(mock_server.url + "/api/v1/create_session", json={}), 401, "X-API-Key")
    _refused(httpx.post(mock_server.url + "/api/v1/create_session", json={}, headers={"X-API-Key": "tml-x"}), 401, "X-API-Key")


def test_retrieve_future_long_poll_answers_408_try_again(mock_server: Server, model) -> None:
    c, sid, _ = model
    door = mock_server.door
    promise = door.promises.new("probe", sid)  # a promise nobody resolves
    old, door.poll_timeout = door.poll_timeout, 0.2
    try:
        resp = c.post("/api/v1/retrieve_future", json={"request_id": promise.request_id})
    finally:
        door.poll_timeout = old
    assert resp.status_code == 408 and resp.json()["type"] == "try_again" and resp.json()["queue_state"] == "active"


def test_the_serve_command_starts_and_answers(tmp_path) -> None:
    port = _free_port()
    env = {**os.environ, "ASYNCSESS_API_KEYS": "tml-a,tml-b"}
    proc = subprocess.Popen([sys.executable, "-m", "asyncsess", "serve", "--backend", "mock://", "--port", str(port)], env=env)
    try:
        url = f"http://127.0.0.1:{port}/api/v1"
        for _ in range(300):
            try:
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        assert httpx.post(url + "/client/config", headers={"X-API-Key": "tml-b"}).json()["pjwt_auth_enabled"] is False
        assert httpx.post(url + "/client/config", headers={"X-API-Key": "tml-c"}).status_code == 401
        # the same process serves the OpenAI door behind the same keys
        v1 = f"http://127.0.0.1:{port}/v1"
        assert "mock/bigram-tiny" in [m["id"] for m in httpx.get(v1 + "/models", headers={"Authorization": "Bearer tml-a"}).json()["data"]]
        chat = {"model": "mock/bigram-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        reply = httpx.post(v1 + "/chat/completions", json=chat, headers={"X-API-Key": "tml-b"}, timeout=30)
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert httpx.post(v1 + "/chat/completions", json=chat, headers={"Authorization": "Bearer tml-c"}).status_code == 401
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_openai_door_refuses_a_body_nested_too_deeply(mock_server: Server) -> None:
    """The door reads ``model`` from the body before the front does; a deep body was a 500 there."""
    for route in ("/v1/chat/completions", "/v1/completions"):
        r = httpx.post(mock_server.url + route, content=b'{"model":' * 100_000, headers={**H, "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text[:200]


def test_session_text_fields_are_checked_so_search_keeps_working(mock_server: Server) -> None:
    """A display_name or project_id with a lone surrogate was stored, and every search of that key's sessions was
    then a 500 (the answer cannot be encoded); a status query whose reasons is not a list was a 500 (TypeError)."""
    import tinker
    from tinker import types

    c = httpx.Client(base_url=mock_server.url, headers=H, timeout=30)
    post = lambda path, raw: c.post(path, content=raw, headers={"Content-Type": "application/json"})  # noqa: E731
    for body, field in [
        (b'{"display_name": "\\ud800"}', "display_name"),
        (b'{"project_id": "p\\udfff"}', "project_id"),
        (b'{"display_name": "a\\u0000b"}', "display_name"),
        (json.dumps({"display_name": "x" * 100_000}).encode(), "display_name"),
        (b'{"display_name": ["x"]}', "display_name"),
    ]:
        _refused(post("/api/v1/create_session", body), 400, field)
    sid = c.post("/api/v1/create_session", json={"display_name": "clean"}).json()["session_id"]
    _refused(c.put(f"/api/v1/sessions/{sid}/project", content=b'{"project_id": "\\ud800"}'), 400, "project_id")
    assert c.post(f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}}).status_code == 200
    _refused(c.post("/api/v1/sessions/search", json={"statuses": [{"type": "client_finished", "reasons": 5}]}), 400, "statuses")
    rest = tinker.RestClient(base_url=mock_server.url, api_key=API_KEY)
    found = rest.search_sessions(types.SessionSearchRequest(session_id=sid)).result().sessions
    assert [(s.session_id, s.display_name, s.project_id) for s in found] == [(sid, "clean", "")]


def test_a_large_json_body_is_decoded_off_the_event_loop(mock_server: Server, model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The door decoded every JSON body with ``json.loads`` on the event loop all keys share: a 120 MB body held
    other keys' heartbeats for 1.4 s. Now a large one is decoded in a worker thread (held there below, in the
    decoder itself, until another request has been answered: on the loop, that request could not have been)."""
    c, sid, _ = model
    real, release, state = json_body.loads, threading.Event(), threading.Condition()
    held: list[bool] = []  # per large body decoded: whether it was on an event loop's thread
    done: list[httpx.Response] = []

    def holding(raw: bytes, *args: Any) -> Any:
        if len(raw) > json_body.INLINE_BYTES:
            on_loop = _running_loop() is not None
            with state:
                held.append(on_loop)
                state.notify_all()
            if not on_loop:  # (on the loop, waiting would freeze the server: the assert below says it instead)
                release.wait()
        return real(raw, *args)

    monkeypatch.setattr(json_body, "loads", holding)
    body = json.dumps({"tags": ["big"], "sdk_version": "x"}).encode() + b" " * (json_body.INLINE_BYTES + 1)
    big = _post_in_thread(mock_server.url, "/api/v1/create_session", body, done, state)
    try:
        with state:
            assert state.wait_for(lambda: held or done, timeout=60)  # a hang guard
        assert held == [False], "the large body was decoded on the event loop"
        assert c.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200  # answered meanwhile
        assert not done
    finally:
        release.set()
        big.join(60)
    assert done[0].status_code == 200 and done[0].json()["session_id"], done[0].text


@pytest.mark.parametrize("coding", ["gzip", "br", "zstd"])
def test_a_compressed_json_body_is_a_415_naming_content_encoding_on_both_doors(mock_server: Server, model, coding: str) -> None:
    """Both doors read a JSON body as plain whatever its Content-Encoding: a gzip body was a 400 "not JSON" naming
    ``body``, and a plain body labelled ``br`` was taken. Now any coding but identity is a 415 naming the header,
    as the worker answers (forward_backward's zstd protobuf is unchanged: see test_bad_forward_backward_bodies)."""
    c, sid, _ = model
    tinker_body = json.dumps({"session_id": sid}).encode()
    oai_body = json.dumps({"model": "mock/bigram-tiny", "prompt": "hi", "max_tokens": 1}).encode()
    for route, raw in (("/api/v1/session_heartbeat", tinker_body), ("/v1/completions", oai_body), ("/v1/chat/completions", oai_body)):
        sent = gzip.compress(raw) if coding == "gzip" else raw
        r = c.post(route, content=sent, headers={"Content-Type": "application/json", "Content-Encoding": coding})
        assert r.status_code == 415, r.text
        named = r.json()["field"] if route.startswith("/api") else r.json()["error"]["param"]
        assert named == "Content-Encoding" and coding in r.text
    assert c.post("/api/v1/session_heartbeat", content=tinker_body, headers={"Content-Encoding": "identity"}).status_code == 200


def test_a_body_of_a_million_strings_is_decoded_yielding_to_other_keys(mock_server: Server, model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strings have no hook in the C decoder: a body listing 6 M short strings held the GIL, and so every key's
    requests, for its whole decode, even in a thread. Such a body is now decoded by the Python scanner, which goes
    through Python between values: held there at its 1,000th string, it lets another request be answered."""
    c, sid, _ = model
    real, release, state = json_body._scanstring, threading.Event(), threading.Condition()
    strings: list[int] = [0]
    done: list[httpx.Response] = []

    def holding(s: str, end: int, strict: bool = True) -> Any:
        strings[0] += 1
        if strings[0] == 1_000:
            with state:
                state.notify_all()
            release.wait(60)
        return real(s, end, strict)

    monkeypatch.setattr(json_body, "_scanstring", holding)
    body = json.dumps({"session_id": sid, "pad": ["a"] * (json_body.SCAN_VALUES + 1)}).encode()
    big = _post_in_thread(mock_server.url, "/api/v1/session_heartbeat", body, done, state)
    try:
        with state:
            assert state.wait_for(lambda: strings[0] >= 1_000 or done, timeout=60)  # a hang guard
        assert not done, done[0].text
        assert c.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200  # answered meanwhile
        assert not done and strings[0] == 1_000
    finally:
        release.set()
        big.join(60)
    assert done[0].status_code == 200, done[0].text


def test_a_body_of_too_many_arrays_is_a_413_naming_the_body(model) -> None:
    """``[[],[],...]``: 6 M empty arrays held the event loop ~7 s in a thread (the garbage collector walks the new
    arrays with the GIL held). A body of more than ``MAX_CONTAINERS`` arrays and objects is now refused before it is
    decoded, and the key's next request is served."""
    c, sid, _ = model
    pad = b",".join([b"[]"] * (json_body.MAX_CONTAINERS + 1))
    r = c.post(
        "/api/v1/session_heartbeat",
        content=b'{"session_id": "%s", "pad": [%s]}' % (sid.encode(), pad),
        headers={"Content-Type": "application/json"},
    )
    _refused(r, 413, "body")
    assert "arrays and objects" in r.json()["error"]
    assert c.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200
    text = "[{" * json_body.MAX_CONTAINERS  # brackets in text are no arrays: refused only as many made
    assert c.post("/api/v1/session_heartbeat", json={"session_id": sid, "pad": text}).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain; x=application/x-protobuf", "application/x-protobufx", "text/application/x-protobuf"])
def test_forward_backward_reads_its_content_type_as_a_media_type(model, content_type: str) -> None:
    """The protobuf check was a substring test: ``text/plain; x=application/x-protobuf`` passed it. The header is now
    parsed, so only ``application/x-protobuf`` (any case, any parameters) is taken; the rest are 415s."""
    c, _, model_id = model
    good = Datum(model_input=ModelInput.from_ints([1, 40]), loss_fn_inputs={"target_tokens": [40, 41], "weights": [1.0, 1.0]})
    raw = tinker_proto.encode_forward_backward(model_id, 1, [good], "cross_entropy")
    _refused(c.post("/api/v1/forward_backward", content=raw, headers={"Content-Type": content_type}), 415, "Content-Type")
    unknown = tinker_proto.encode_forward_backward("no-such-model", 1, [good], "cross_entropy")
    for ok in ("Application/X-Protobuf", "application/x-protobuf; charset=binary"):  # parsed, so past the 415 to the model check
        _refused(c.post("/api/v1/forward_backward", content=unknown, headers={"Content-Type": ok}), 404, "model_id")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "jsonx"])
def test_a_body_declared_as_another_type_is_a_415_naming_content_type(mock_server: Server, model, content_type: str) -> None:
    """The door read any body as JSON whatever its Content-Type (a form post made a session). A type that is not
    JSON is now a 415 naming the header, before anything is made, as FastAPI would not decode it; JSON with
    parameters, a ``+json`` type and no Content-Type at all (FastAPI reads it as JSON) still work."""
    c, sid, _ = model
    body = json.dumps({"tags": [], "user_metadata": {}, "sdk_version": "x"}).encode()
    before = len(mock_server.door.sessions)
    r = c.post("/api/v1/create_session", content=body, headers={"Content-Type": content_type})
    _refused(r, 415, "Content-Type")
    assert content_type in r.json()["error"] and "application/json" in r.json()["fix"]
    assert len(mock_server.door.sessions) == before
    beat = json.dumps({"session_id": sid}).encode()
    for ok in ("application/json; charset=utf-8", "APPLICATION/JSON", "application/vnd.api+json", None):
        r = c.post("/api/v1/session_heartbeat", content=beat, headers={"Content-Type": ok} if ok else {})
        assert r.status_code == 200, (ok, r.text)


@pytest.mark.parametrize(
    "cursor, says",
    [
        ("abc", "got a string"),
        ([1], "got an array"),
        ({}, "last_session_id: expected a session id, got null"),
        ({"last_session_id": "x"}, "last_created_at: expected an ISO 8601 time with a time zone, got null"),
        ({"last_session_id": "x", "last_created_at": "yesterday"}, "got 'yesterday'"),
        ({"last_session_id": "x", "last_created_at": 5}, "got a number"),
        ({"last_session_id": "x", "last_created_at": "2020-01-01T00:00:00"}, "with a time zone"),
        ({"last_session_id": "x", "last_created_at": "1" * 100_000}, "with a time zone"),
    ],
)
def test_a_bad_search_cursor_names_the_key_and_the_fix_not_python(model, cursor: Any, says: str) -> None:
    """A bad cursor's 400 quoted Python's exception: "string indices must be integers", "'last_created_at'" (a
    KeyError), "Invalid isoformat string: '111...'" with all 100,000 characters. It now says which key is wrong and
    what it should hold."""
    c, _, _ = model
    r = c.post("/api/v1/sessions/search", json={"cursor": cursor})
    _refused(r, 400, "cursor")
    error = r.json()["error"]
    assert says in error and "next_cursor" in r.json()["fix"], error
    assert not any(python in error for python in ("indices", "isoformat", "'last_")) and len(error) < 300, error


@pytest.mark.parametrize("route", ["asample", "optim_step", "create_model"])
def test_a_body_nested_deep_enough_to_decode_in_a_thread_is_a_400_not_a_500(mock_server: Server, model, route: str) -> None:
    """A large body is decoded in a worker thread, whose stack is short: nested ~970 levels it decoded there, then
    its hash (``json.dumps``) on the event loop, deeper in the stack, passed Python's recursion limit: a 500. A body
    nesting more than ``MAX_DEPTH`` (64) levels is now a 400 naming ``body``, whatever its size, and nothing is made."""
    c, sid, model_id = model
    sampler = c.post(
        "/api/v1/create_sampling_session", json={"session_id": sid, "sampling_session_seq_id": 90, "base_model": "mock/bigram-tiny"}
    )
    fields = {
        "asample": {"sampling_session_id": sampler.json().get("sampling_session_id"), "seq_id": 1, "prompt": {"chunks": []}},
        "optim_step": {"model_id": model_id, "seq_id": 900, "adam_params": {"learning_rate": 0.01}},
        "create_model": {"session_id": sid, "model_seq_id": 90, "base_model": "mock/bigram-tiny"},
    }[route]
    depth = sys.getrecursionlimit() - 30
    raw = json.dumps({**fields, "x": None}).encode().replace(b"null", b"[" * depth + b"]" * depth) + b" " * json_body.INLINE_BYTES
    r = c.post(f"/api/v1/{route}", content=raw, headers={"Content-Type": "application/json"})
    _refused(r, 400, "body")
    assert "nests too deeply" in r.json()["error"] and "64" in r.json()["fix"]
    assert f"{sid}:train:90" not in mock_server.door.models and f"{sid}:train:90" not in mock_server.door.sessions[sid].creating


@pytest.mark.parametrize(
    "query, field",
    [
        ({"project_ids": ["p"] * 1_025}, "project_ids"),
        ({"statuses": [{"type": "active"}] * 1_025}, "statuses"),
        ({"statuses": [{"type": "client_finished", "reasons": ["success"] * 1_025}]}, "statuses"),
        ({"statuses": [{"type": ["active"]}]}, "statuses"),
        ({"statuses": [{"type": "client_finished", "reasons": [{"type": "success"}]}]}, "statuses"),
        ({"user_metadata": {f"k{i}": "v" for i in range(65)}}, "user_metadata"),
        ({"display_name": "a " * 600}, "display_name"),
    ],
)
def test_search_filters_longer_than_any_session_can_match_are_refused_by_name(model, query: dict, field: str) -> None:
    """``sessions/search`` compared each listed project id, status query, reason and display_name word with each of
    the key's sessions on the event loop: a display_name of a million words held every key's requests 30 s over 300
    sessions. Lists past 1,024 entries, metadata past a session's 64 pairs and a name past its 1,024 characters are
    now 400s naming the field (a longer one could never match), and the lists are looked up, not scanned."""
    c, _, _ = model
    _refused(c.post("/api/v1/sessions/search", json=query), 400, field)
    ok = {**query, field: {"project_ids": ["p"], "statuses": [{"type": "active"}], "user_metadata": {"k": "v"}, "display_name": "a"}[field]}
    assert c.post("/api/v1/sessions/search", json=ok).status_code == 200
