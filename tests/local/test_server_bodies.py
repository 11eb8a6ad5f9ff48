"""Request bodies as HTTP carries them: a large body is decoded off the event loop (one tenant's 256 MB
never stalls another's requests), with the same answers as a small one; a body the worker cannot read as
JSON (another Content-Type, a Content-Encoding, a Content-Length that lies) is a 4xx naming the header."""

from __future__ import annotations

import gzip
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")

from asyncsess.serve import json_body

from .server_helpers import MINE, THEIRS, assert_refused, new_session, start_worker

pytestmark = pytest.mark.local

PAD = b" " * (json_body.INLINE_BYTES + 1)  # JSON whitespace: a body over the inline size that decodes the same
DATUM = {"model_input": [5, 6, 7], "loss_fn_inputs": {"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]}}


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    w = start_worker(tiny, str(tmp_path_factory.mktemp("bodies-ckpt")))
    yield w
    w.stop()


def _forward(seq: int) -> dict[str, Any]:
    return {"kind": "forward", "seq": seq, "idempotency_key": f"f{seq}", "loss_fn": "cross_entropy", "data": [DATUM]}


def _post(c: httpx.Client, path: str, raw: bytes, headers: dict[str, str], content_type: str | None = "application/json") -> httpx.Response:
    return c.post(path, content=raw, headers={**headers, **({"content-type": content_type} if content_type else {})})


@pytest.mark.parametrize("route", ["ops", "chat"])
def test_a_large_body_is_decoded_off_the_event_loop_while_another_tenant_is_served(worker, c, tiny, monkeypatch, route):
    """The large body's decoding is held (in the decoder itself) until the other tenant has been answered: had
    it been decoded on the event loop, the other tenant's request could not have been."""
    sid, theirs = new_session(c, tiny, MINE), new_session(c, tiny, THEIRS)
    if route == "ops":
        path, big = f"/v1/sessions/{sid}/ops", json.dumps(_forward(1)).encode() + PAD
    else:
        path, big = (
            "/v1/chat/completions",
            json.dumps({"model": tiny, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode() + PAD,
        )
    real, release, state = json_body.loads, threading.Event(), threading.Condition()
    held: list[bool] = []  # per large body decoded: whether it was on the worker's event loop thread
    done: list[httpx.Response] = []

    def holding(raw: bytes) -> Any:
        if len(raw) > json_body.INLINE_BYTES:
            on_loop = threading.current_thread() is worker.thread
            with state:
                held.append(on_loop)
                state.notify_all()
            if not on_loop:  # (on the loop, waiting would freeze the worker: the assert below says it instead)
                release.wait()
        return real(raw)

    monkeypatch.setattr(json_body, "loads", holding)

    def send_big() -> httpx.Response:
        with httpx.Client(base_url=worker.url, timeout=120) as own:
            r = _post(own, path, big, MINE)
        with state:
            done.append(r)
            state.notify_all()
        return r

    pool = ThreadPoolExecutor(1)
    try:
        future = pool.submit(send_big)
        with state:
            state.wait_for(lambda: held or done)
        assert held == [False], "the large body was decoded on the event loop"
        small = c.post(f"/v1/sessions/{theirs}/ops", json=_forward(1), headers=THEIRS)  # answered meanwhile
        assert small.status_code == 200 and small.json()["result"]["loss_fn_outputs"], small.text
        assert not done  # the large one is still being decoded
        release.set()
        r = future.result()
    finally:
        release.set()  # (before the pool is shut: a failed assert must not leave the large request held)
        pool.shutdown()
    assert r.status_code == 200, r.text
    if route == "ops":
        assert r.json()["result"]["loss_fn_outputs"] and worker.backend.next_seq(sid) == 2
    else:
        assert r.json()["choices"][0]["message"]["role"] == "assistant"


BAD_BODIES = {
    "not JSON": b'{"kind" "forward"}',
    "wrong type": json.dumps({**_forward(1), "seq": "1"}).encode(),
    "unknown field": json.dumps({**_forward(1), "extra": 1}).encode(),
    "not an object": b"[1, 2]",
    "bad UTF-8": b'{"kind": "\xff"}',
    "5000 digits": b'{"seq": 1' + b"0" * 5000 + b"}",
    "deep": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_a_large_bad_body_gets_the_answer_of_a_small_one_and_consumes_no_seq(worker, c, tiny, case):
    sid = new_session(c, tiny, MINE)
    small = _post(c, f"/v1/sessions/{sid}/ops", BAD_BODIES[case], MINE)
    large = _post(c, f"/v1/sessions/{sid}/ops", BAD_BODIES[case] + PAD, MINE)
    err = assert_refused(small, status=400)
    assert large.status_code == small.status_code and large.json() == small.json()
    assert err["field"] not in ("", None) and not err["field"].startswith("[")  # a field, never a character offset
    assert worker.backend.next_seq(sid) == 1  # nothing consumed: the op at seq 1 still runs
    assert c.post(f"/v1/sessions/{sid}/ops", json=_forward(1), headers=MINE).status_code == 200


def test_a_body_of_too_many_arrays_is_a_413_naming_the_body_and_consumes_no_seq(worker, c, tiny):
    """``[[],[],...]``: 6 M empty arrays held the worker's event loop ~7 s, in a thread (the garbage collector walks
    the new arrays with the GIL held). Past ``json_body.MAX_CONTAINERS`` arrays and objects a body is a 413, before
    it is decoded."""
    sid = new_session(c, tiny, MINE)
    pad = b",".join([b"[]"] * (json_body.MAX_CONTAINERS + 1))
    err = assert_refused(_post(c, f"/v1/sessions/{sid}/ops", b'{"pad": [%s]}' % pad, MINE), "body", status=413)
    assert "arrays and objects" in err["message"] and "split" in err["fix"], err
    assert worker.backend.next_seq(sid) == 1


def test_a_body_that_is_not_json_says_so_with_where(c, tiny):
    err = assert_refused(_post(c, "/v1/sessions", b'{"rank" 2}', MINE), "body")
    assert "not JSON" in err["message"] and "(at character 8)" in err["message"], err
    err = assert_refused(_post(c, "/v1/sessions", b'{"rank": 1' + b"0" * 5000 + b"}", MINE), "body")
    assert "4300 digits" in err["message"], err  # it said only "There was an error parsing the body"


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_a_body_not_declared_json_is_a_415_naming_content_type(c, tiny, content_type):
    body = json.dumps({"base_model": tiny, "rank": 2}).encode()
    err = assert_refused(_post(c, "/v1/sessions", body, MINE, content_type), "Content-Type", status=415)
    assert "application/json" in err["fix"]
    assert _post(c, "/v1/sessions", body, MINE, "application/json; charset=utf-8").status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_an_openai_body_declared_as_another_type_is_a_415_naming_content_type(c, content_type):
    """The OpenAI routes read any body as JSON; one declared as text or a form is now refused, while an unlabelled
    body (what FastAPI also reads as JSON) and ``application/json; charset=utf-8`` reach the request checks."""
    body = json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
    r = c.post("/v1/chat/completions", content=body, headers={**MINE, "content-type": content_type})
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["param"] == "Content-Type" and "application/json" in err["message"], err
    for fine in (None, "application/json; charset=utf-8", "application/vnd.api+json"):
        headers = {**MINE, **({"content-type": fine} if fine else {})}
        r = c.post("/v1/chat/completions", content=body, headers=headers)
        assert r.status_code != 415 and r.status_code < 500, (fine, r.status_code, r.text)


BOMB = gzip.compress(b"0" * (64 << 20), compresslevel=1)


@pytest.mark.parametrize("path", ["/v1/sessions", "/v1/chat/completions"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd", "GZIP"])
def test_a_compressed_body_is_a_415_and_is_never_inflated(c, tiny, path, encoding):
    """A gzip body was read as plain bytes (a 400 that blamed the JSON), and a plain body labelled gzip was
    taken. Neither is inflated: a 64 MB zip bomb costs the worker its 64 kB."""
    body = BOMB if encoding == "gzip" else b"{}"
    r = c.post(path, content=body, headers={**MINE, "content-type": "application/json", "content-encoding": encoding})
    assert_refused(r, "Content-Encoding", status=415)
    ok = c.post("/v1/sessions", json={"base_model": tiny, "rank": 2}, headers={**MINE, "content-encoding": "identity"})
    assert ok.status_code == 200, ok.text


def _answers(worker, request: bytes, count: int = 1) -> list[tuple[int, dict[str, str], bytes]]:
    """Send ``request`` (raw bytes) on a fresh connection and read ``count`` answers: (status, headers, body)."""
    out = []
    with socket.create_connection(("127.0.0.1", worker.port), timeout=120) as sock:
        sock.sendall(request)
        reply = sock.makefile("rb")
        for _ in range(count):
            status = int(reply.readline().split()[1])
            headers = {}
            for line in iter(reply.readline, b"\r\n"):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            out.append((status, headers, reply.read(int(headers.get("content-length", "0")))))
    return out


def _head(method: str, path: str, *extra: str) -> bytes:
    return "".join(
        [f"{method} {path} HTTP/1.1\r\nHost: w\r\n{'Authorization'}: {MINE['Authorization']}\r\n", *(e + "\r\n" for e in extra)]
    ).encode()


@pytest.mark.parametrize("path", ["/v1/sessions", "/v1/chat/completions"])
def test_a_client_that_hangs_up_mid_body_is_no_worker_error(worker, c, tiny, caplog, path):
    """A client that closed its connection before its body had all arrived was a logged 500, a "worker error" with a
    traceback (one per such connection: anyone could fill the operator's log); it is no error now."""
    import logging
    import time

    caplog.set_level(logging.INFO, logger="asyncsess.worker")
    with socket.create_connection(("127.0.0.1", worker.port), timeout=30) as sock:
        sock.sendall(_head("POST", path, "Content-Type: application/json", "Content-Length: 100") + b'\r\n{"model":')
        deadline = time.monotonic() + 30  # (a hang guard) the request is in once it counts as in flight
        while not any(worker.app.state.inflight.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
    while any(worker.app.state.inflight.values()) and time.monotonic() < deadline:  # served: it hung up
        time.sleep(0.01)
    assert not any(worker.app.state.inflight.values())
    assert [r.getMessage() for r in caplog.records if r.name == "asyncsess.worker" and r.levelno >= logging.WARNING] == []
    assert c.post("/v1/sessions", json={"base_model": tiny, "rank": 1}, headers=MINE).status_code == 200


def test_a_content_length_that_lies_is_a_4xx_and_the_worker_serves_on(worker, c, tiny):
    body = json.dumps({"base_model": tiny, "rank": 2}).encode()
    for length in ("-1", "1e3", "0x10", "+5", " 5 5", "99999999999999999999999"):
        [(status, _, _)] = _answers(
            worker, _head("POST", "/v1/sessions", "Content-Type: application/json", f"Content-Length: {length}") + b"\r\n" + body
        )
        assert 400 <= status < 500, length
    both = _head("POST", "/v1/sessions", "Content-Type: application/json", "Content-Length: 5", "Content-Length: 50")
    assert 400 <= _answers(worker, both + b"\r\n" + body)[0][0] < 500
    # shorter than the body: the body is cut there (not JSON)
    [(status, _, answer)] = _answers(
        worker, _head("POST", "/v1/sessions", "Content-Type: application/json", "Content-Length: 5") + b"\r\n" + body
    )
    assert status == 400 and json.loads(answer)["error"]["field"] == "body"
    chunked = _head("POST", "/v1/sessions", "Content-Type: application/json", "Transfer-Encoding: chunked") + b"\r\n"
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, len(body), 7))
    [(status, _, answer)] = _answers(worker, chunked + chunks + b"0\r\n\r\n")  # no length at all: fine
    assert status == 200 and json.loads(answer)["lora_rank"] == 2
    assert c.get("/v1/capabilities", headers=MINE).status_code == 200


def test_query_parameters_a_route_does_not_take_are_refused_by_name(worker, c, tiny):
    """They were dropped in silence: ``POST /v1/sessions?rank=8`` made a session of the body's rank."""
    before = len(worker.backend.engine.sessions)
    err = assert_refused(c.post("/v1/sessions?rank=8", json={"base_model": tiny, "rank": 2}, headers=MINE), "rank")
    assert "JSON body" in err["fix"]
    assert len(worker.backend.engine.sessions) == before
    sid = new_session(c, tiny, MINE)
    assert_refused(c.post(f"/v1/sessions/{sid}/ops?seq=1", json=_forward(1), headers=MINE), "seq")
    assert worker.backend.next_seq(sid) == 1  # nothing consumed
    assert_refused(c.post(f"/v1/sessions/{sid}/heartbeat?x=1", headers=MINE), "x")
    assert_refused(c.get(f"/v1/checkpoints?session_id={sid}&ttl=1", headers=MINE), "ttl")
    assert c.get(f"/v1/checkpoints?session_id={sid}", headers=MINE).status_code == 200


@pytest.mark.parametrize("method", ["BREW", "PROPFIND", "TRACE", "OPTIONS", "PATCH"])
def test_any_method_a_route_lacks_is_a_405_naming_the_method(worker, method):
    [(status, headers, body)] = _answers(worker, _head(method, "/v1/sessions") + b"\r\n")
    assert status == 405 and json.loads(body)["error"]["field"] == "method", body  # BREW was the parser's plain 400
    [(status, _, body)] = _answers(worker, _head("HEAD", "/v1/capabilities") + b"\r\n")
    assert status == 405 and body == b""


def test_a_request_head_over_its_limit_is_refused_and_never_buffered(worker, c):
    """The parser buffered any amount of headers (96 MB in one request, before the key was checked)."""
    from asyncsess_local.server import MAX_HEADER_BYTES

    big = _head("GET", "/v1/capabilities", "X-Big: " + "a" * (16 * MAX_HEADER_BYTES)) + b"\r\n"  # (one read may pass the limit)
    assert _answers(worker, big)[0][0] == 400
    many = _head("GET", "/v1/capabilities", *(f"X-H{i}: v" for i in range(500))) + b"\r\n"
    assert _answers(worker, many)[0][0] == 200
    assert c.get("/v1/capabilities", headers=MINE).status_code == 200


def test_pipelined_requests_are_answered_in_order_and_a_bad_one_fails_alone(worker, tiny):
    good = _head("GET", "/v1/capabilities") + b"\r\n"
    bad = _head("POST", "/v1/sessions", "Content-Type: application/json", "Content-Length: 4") + b"\r\n{bad"
    body = json.dumps({"base_model": tiny, "rank": 3}).encode()
    new = _head("POST", "/v1/sessions", "Content-Type: application/json", f"Content-Length: {len(body)}") + b"\r\n" + body
    answers = _answers(worker, good + bad + new + good, 4)
    assert [a[0] for a in answers] == [200, 400, 200, 200]
    assert json.loads(answers[1][2])["error"]["field"] == "body" and json.loads(answers[2][2])["lora_rank"] == 3


def test_per_token_answers_are_rendered_off_the_event_loop(worker, c, tiny, monkeypatch):
    """A pass's, a sample's and a logprobs call's answer (tens of MB of JSON for large batches) was encoded on
    the event loop, stalling every tenant as a large body did."""
    from asyncsess_local import server

    real, on_loop = server._render, []

    def recording(content: Any) -> bytes:
        if isinstance(content, dict) and ({"sequences", "logprobs"} & content.keys() or content.get("type") == "forward_backward"):
            on_loop.append(threading.current_thread() is worker.thread)
        return real(content)

    monkeypatch.setattr(server, "_render", recording)
    sid = new_session(c, tiny, MINE)
    assert c.post(f"/v1/sessions/{sid}/ops", json=_forward(1), headers=MINE).status_code == 200
    smp = c.post("/v1/samplers", json={"base_model": tiny}, headers=MINE).json()["sampler_id"]
    r = c.post(f"/v1/samplers/{smp}/sample", json={"prompt": [5, 6], "sampling_params": {"max_tokens": 2}}, headers=MINE)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json" and r.json()["sequences"]
    r = c.post(f"/v1/samplers/{smp}/logprobs", json={"tokens": [5, 6, 7]}, headers=MINE)
    assert r.status_code == 200 and len(r.json()["logprobs"]) == 3
    assert on_loop == [False, False, False]


def test_a_checkpoint_listing_is_rendered_off_the_event_loop(worker, c, tiny, monkeypatch):
    """GET /v1/checkpoints was rendered on the event loop: a key's 4,096 checkpoints with 64 KB of user_metadata each
    are 300 MB of JSON, seconds of every tenant's calls on each listing."""
    from asyncsess_local import server

    real, on_loop = server._render, []

    def recording(content: Any) -> bytes:
        if isinstance(content, list):
            on_loop.append(threading.current_thread() is worker.thread)
        return real(content)

    monkeypatch.setattr(server, "_render", recording)
    sid = new_session(c, tiny, MINE)
    for seq in (1, 2):
        save = {"kind": "save_weights", "seq": seq, "idempotency_key": f"l{seq}", "name": f"l{seq}", "user_metadata": {"k": "v" * 1024}}
        assert c.post(f"/v1/sessions/{sid}/ops", json=save, headers=MINE).status_code == 200
    r = c.get("/v1/checkpoints", params={"session_id": sid}, headers=MINE)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert [(x["checkpoint_id"].rsplit("/", 1)[1], x["user_metadata"]["k"]) for x in r.json()] == [("l1", "v" * 1024), ("l2", "v" * 1024)]
    assert on_loop == [False]


N, K = 48, 1024  # a pass of (N, K) targets: 49,152 log-probs, 98,352 values to check
WIDE = {
    "model_input": [5] * N,
    "loss_fn_inputs": {
        "target_tokens": {"data": [7] * (N * K), "dtype": "int64", "shape": [N, K]},
        "weights": {"data": [0.0] * (N * K), "dtype": "float32", "shape": [N, K]},
    },
}


def test_a_large_pass_is_checked_off_the_event_loop(worker, c, tiny, monkeypatch):
    """A pass's datums were checked on the event loop when it arrived and again at its turn: (512, 8192) targets
    took 1.4 s each time, every tenant stalled. An op past INLINE_VALUES is checked in a worker thread both times."""
    from asyncsess_local import embedded

    real, on_loop = embedded._checked_pass, []

    def recording(op: Any, slot: Any) -> Any:
        on_loop.append(threading.current_thread() is worker.thread)
        return real(op, slot)

    monkeypatch.setattr(embedded, "_checked_pass", recording)
    sid = new_session(c, tiny, MINE)
    assert _post(c, f"/v1/sessions/{sid}/ops", json.dumps({**_forward(1), "data": [WIDE]}).encode(), MINE).status_code == 200
    assert on_loop == [False, False]  # on arrival, and at its turn


def test_a_large_answer_is_rendered_a_slice_at_a_time_and_reads_the_same(worker, c, tiny, monkeypatch):
    """Rendering in a thread did not free the event loop: json.dumps is one C call holding the GIL, and a forward's
    (512, 8192) log-probs held it 2 s. No call renders more than RENDER_SLICE numbers now, and the bytes are the same."""
    from asyncsess_local import server

    n, k = N, K  # three slices
    sid = new_session(c, tiny, MINE)
    raw = json.dumps({**_forward(1), "data": [WIDE]}).encode()  # encoded before json.dumps is watched
    real, numbers = json.dumps, []

    def counting(value: Any, **kw: Any) -> str:
        text = real(value, **kw)
        numbers.append(text.count(",") + 1)
        return text

    monkeypatch.setattr(server.json, "dumps", counting)
    r = _post(c, f"/v1/sessions/{sid}/ops", raw, MINE)
    monkeypatch.undo()
    assert r.status_code == 200, r.text[:300]
    logprobs = r.json()["result"]["loss_fn_outputs"][0]["logprobs"]
    assert logprobs["shape"] == [n, k] and len(logprobs["data"]) == n * k
    assert server._render(r.json()) == server._dumps(r.json()) == r.content
    assert numbers and max(numbers) <= server.RENDER_SLICE, max(numbers)


def test_the_tokenizer_is_written_out_once_and_off_the_event_loop(worker, c, tiny, monkeypatch):
    """Each GET /v1/tokenizer wrote the tokenizer's files to a temporary directory and read them back on the event
    loop (megabytes for a real model's tokenizer.json)."""
    from asyncsess_local import server

    real, calls = server._tokenizer_answer, []

    def recording(backend: Any, name: str) -> bytes:
        calls.append(threading.current_thread() is worker.thread)
        return real(backend, name)

    monkeypatch.setattr(server, "_tokenizer_answer", recording)
    first = c.get("/v1/tokenizer", params={"base_model": tiny}, headers=MINE)
    again = c.get("/v1/tokenizer", params={"base_model": tiny}, headers=THEIRS)
    assert first.status_code == 200 and "tokenizer.json" in first.json()["files"], first.text
    assert again.json() == first.json() and calls == [False]


def test_checkpoints_are_listed_off_the_event_loop(worker, c, tiny, monkeypatch):
    """GET /v1/checkpoints read every checkpoint's metadata and sized its files on the event loop: a key holding its
    4,096 allowed checkpoints froze every tenant's requests for 0.7 s per listing, and it may send 1,024 at once."""
    store, on_loop = worker.backend.engine.store, []
    real = store.list

    def recording(model_id: str | None = None) -> Any:
        on_loop.append(threading.current_thread() is worker.thread)
        return real(model_id)

    monkeypatch.setattr(store, "list", recording)
    sid = new_session(c, tiny, MINE)
    save = {"kind": "save_weights", "seq": 1, "idempotency_key": "s1", "name": "listed"}
    assert c.post(f"/v1/sessions/{sid}/ops", json=save, headers=MINE).status_code == 200
    r = c.get("/v1/checkpoints", params={"session_id": sid}, headers=MINE)
    assert r.status_code == 200 and [x["checkpoint_id"] for x in r.json()] == [f"{sid}/sampler/listed"], r.text
    assert on_loop == [False]
