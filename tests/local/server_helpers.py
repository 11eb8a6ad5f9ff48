"""A worker on 127.0.0.1 for the server tests (two API keys), and the checks every answer must pass."""

from __future__ import annotations

import json
from typing import Any

import httpx

KEY, OTHER = "key-a", "key-b"
MINE, THEIRS = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {OTHER}"}


def start_worker(tiny: str, ckpt_dir: str, **app_options: Any) -> Any:
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread

    backend = LocalBackend(model=tiny, device="cpu", checkpoint_dir=ckpt_dir, gap_timeout=0.2)
    app_options.setdefault("session_timeout", None)  # a module's sessions live as long as it runs (test_server_idle.py: expiry)
    worker = serve_in_thread(backend, [KEY, OTHER], **app_options)
    worker.backend = backend
    return worker


def raw_json(value: Any) -> bytes:
    """JSON as Python writes it: NaN and Infinity literals, lone surrogates as \\ud800 escapes."""
    return json.dumps(value, allow_nan=True).encode()


def send(c: httpx.Client, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> httpx.Response:
    kw: dict[str, Any] = {}
    if body is not None:
        kw["content"] = body if isinstance(body, bytes) else raw_json(body)
        kw["headers"] = {"content-type": "application/json", **(headers or {})}
    elif headers:
        kw["headers"] = headers
    return c.request(method, path, **kw)


def assert_refused(r: httpx.Response, field: str | None = None, status: int = 400) -> dict[str, Any]:
    """A 4xx with a JSON body naming the field and the fix."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["type"] and err["message"], err
    if field is not None:
        assert err.get("field") == field, err
    assert err.get("fix") or r.status_code == 404, err
    return err


def assert_openai_refused(r: httpx.Response, param: str | None, status: int = 400) -> dict[str, Any]:
    """An OpenAI route's refusal: a 4xx with OpenAI's error body naming the parameter."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"] and err["code"], err
    assert err["param"] == param, err
    return err


def new_session(c: httpx.Client, tiny: str, headers: dict[str, str], rank: int = 2) -> str:
    r = c.post("/v1/sessions", json={"base_model": tiny, "rank": rank, "seed": 0}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["model_id"]


def new_sampler(c: httpx.Client, headers: dict[str, str], **body: Any) -> str:
    r = c.post("/v1/samplers", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["sampler_id"]


def assert_healthy(c: httpx.Client, tiny: str, headers: dict[str, str] = MINE) -> None:
    """The worker still answers a real request end to end: a session trains and a sampler samples."""
    assert c.get("/v1/capabilities", headers=headers).status_code == 200
    sid = new_session(c, tiny, headers)
    datum = {"model_input": [5, 6, 7], "loss_fn_inputs": {"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]}}
    op = {"kind": "forward_backward", "seq": 1, "idempotency_key": "h1", "loss_fn": "cross_entropy", "data": [datum]}
    r = c.post(f"/v1/sessions/{sid}/ops", json=op, headers=headers)
    assert r.status_code == 200 and r.json()["type"] == "forward_backward", r.text
    smp = new_sampler(c, headers, base_model=tiny)
    body = {"prompt": [5, 6], "num_samples": 2, "sampling_params": {"max_tokens": 3, "temperature": 1.0, "seed": 1}}
    r = c.post(f"/v1/samplers/{smp}/sample", json=body, headers=headers)
    assert r.status_code == 200 and len(r.json()["sequences"]) == 2, r.text
    c.delete(f"/v1/sessions/{sid}", headers=headers)
    c.delete(f"/v1/sessions/{smp}", headers=headers)
