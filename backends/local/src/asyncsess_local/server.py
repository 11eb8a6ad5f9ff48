"""The worker: the local engine behind HTTP (FastAPI on uvicorn), plus an OpenAI-compatible chat API.

Every request needs an API key (``Authorization: Bearer <key>`` or ``X-API-Key``); a session, sampler or
checkpoint belongs to the key that created it and is invisible to other keys. Bad input gets a 4xx
naming the field, never a 5xx. Run it with ``asyncsess-worker --model tiny-llama --port 8765``.
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from asyncsess.backend import SampleRequest, SamplerSpec, TrainingOp, TrainingSessionSpec
from asyncsess.errors import AsyncSessError, InvalidInputError, ServerError, SessionGoneError
from asyncsess.types import SamplingParams

from . import wire
from .checkpoints import EPHEMERAL
from .embedded import LocalBackend
from .vllm_sampler import VllmOptions

__all__ = ["create_app", "serve_in_thread", "main"]

log = logging.getLogger("asyncsess.worker")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "added_tokens.json")


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    """The subset of OpenAI's chat-completions body the worker honours (other fields are ignored)."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False


class _Owners:
    """Which API key owns which session, sampler and model id (kept after stop, for checkpoints)."""

    def __init__(self) -> None:
        self.by_id: dict[str, str] = {}
        self.latest_sampler_path: dict[str, str] = {}  # training session -> last save_weights path
        self.chat_samplers: dict[tuple[str, str], str] = {}  # (key, target) -> sampler id

    def check(self, key: str, object_id: str) -> None:
        if self.by_id.get(object_id) != key:
            raise SessionGoneError(f"no session {object_id!r} for this API key")


def create_app(backend: LocalBackend, api_keys: Iterable[str]) -> FastAPI:
    keys = set(api_keys)
    if not keys:
        raise ValueError("the worker needs at least one API key")
    owners = _Owners()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.open()
        try:
            yield
        finally:
            await backend.aclose()

    app = FastAPI(title="asyncsess worker", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(AsyncSessError)
    async def _typed(request: Request, err: AsyncSessError) -> JSONResponse:
        return JSONResponse(wire.encode_error(err), status_code=wire.status_for(err))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return JSONResponse(wire.encode_error(InvalidInputError(str(first.get("msg")), field=where)), status_code=400)

    @app.exception_handler(Exception)
    async def _crash(request: Request, err: Exception) -> JSONResponse:
        log.exception("worker error")
        return JSONResponse(wire.encode_error(ServerError(f"{type(err).__name__}: {err}")), status_code=500)

    def api_key(request: Request) -> str:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not any(secrets.compare_digest(key, k) for k in keys):
            raise _Unauthorized()
        return key

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(request: Request, err: Exception) -> JSONResponse:
        body = wire.encode_error(
            InvalidInputError("missing or wrong API key", field="Authorization", fix="send 'Authorization: Bearer <key>'")
        )
        return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})

    def parse(adapter: Any, body: Any, what: str) -> Any:
        try:
            return adapter.validate_python(body)
        except ValidationError as err:
            e = err.errors()[0]
            raise InvalidInputError(e["msg"], field=".".join(map(str, (what, *e["loc"])))) from None

    def owned_path(key: str, path: str | None, field: str) -> None:
        """A checkpoint path must come from one of this key's sessions."""
        if not path:
            return
        if path.startswith(EPHEMERAL):
            owner = path[len(EPHEMERAL) :].split("/", 1)[0]
        else:
            resolved = backend.engine.store.resolve(path)
            owner = resolved.relative_to(backend.engine.store.root).parts[0]
        if owners.by_id.get(owner) != key:
            raise InvalidInputError(f"no checkpoint at {path!r}", field=field, fix="pass a path saved with this API key")

    # ---------------------------------------------------------------- the backend protocol

    @app.get("/v1/capabilities")
    async def capabilities(key: str = Depends(api_key)) -> Any:
        return (await backend.capabilities()).model_dump(mode="json")

    @app.post("/v1/sessions")
    async def create_session(body: dict[str, Any], key: str = Depends(api_key)) -> Any:
        spec: TrainingSessionSpec = parse(wire.SESSION_SPEC, body, "spec")
        owned_path(key, spec.from_path, "from_path")
        info = await backend.create_training_session(spec)
        owners.by_id[info.model_id] = key
        return info.model_dump(mode="json")

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def stop_session(session_id: str, key: str = Depends(api_key)) -> Response:
        if owners.by_id.get(session_id) == key:
            await backend.stop_session(session_id)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/heartbeat", status_code=204)
    async def heartbeat(session_id: str, key: str = Depends(api_key)) -> Response:
        owners.check(key, session_id)
        await backend.heartbeat(session_id)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/ops")
    async def execute(session_id: str, body: dict[str, Any], key: str = Depends(api_key)) -> Any:
        owners.check(key, session_id)
        op: TrainingOp = parse(wire.OP, body, "op")
        if op.kind == "load_state":
            owned_path(key, op.path, "path")
        result = await backend.execute_training(session_id, op)
        if op.kind == "save_weights":
            owners.latest_sampler_path[session_id] = result.path  # type: ignore[union-attr]
        return wire.encode_result(result)

    @app.post("/v1/samplers")
    async def create_sampler(body: dict[str, Any], key: str = Depends(api_key)) -> Any:
        spec: SamplerSpec = parse(wire.SAMPLER_SPEC, body, "spec")
        owned_path(key, spec.model_path, "model_path")
        sampler_id = await backend.create_sampler(spec)
        owners.by_id[sampler_id] = key
        return {"sampler_id": sampler_id}

    @app.post("/v1/samplers/{sampler_id}/sample")
    async def sample(sampler_id: str, body: dict[str, Any], key: str = Depends(api_key)) -> Any:
        owners.check(key, sampler_id)
        request: SampleRequest = parse(wire.SAMPLE_REQUEST, body, "request")
        return (await backend.sample(sampler_id, request)).model_dump(mode="json")

    @app.post("/v1/samplers/{sampler_id}/logprobs")
    async def logprobs(sampler_id: str, body: dict[str, Any], key: str = Depends(api_key)) -> Any:
        owners.check(key, sampler_id)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidInputError("must be a list of token ids", field="tokens")
        return {"logprobs": await backend.compute_logprobs(sampler_id, tokens)}

    @app.get("/v1/checkpoints")
    async def checkpoints(session_id: str | None = None, key: str = Depends(api_key)) -> Any:
        if session_id is not None:
            owners.check(key, session_id)
        listed = await backend.list_checkpoints(session_id)
        return [c.model_dump(mode="json") for c in listed if owners.by_id.get(c.checkpoint_id.split("/")[0]) == key]

    @app.get("/v1/tokenizer")
    async def tokenizer(base_model: str, key: str = Depends(api_key)) -> Any:
        import tempfile

        tok = backend.get_tokenizer(base_model)
        with tempfile.TemporaryDirectory() as tmp:
            tok.save_pretrained(tmp)
            return {"files": {n: (Path(tmp) / n).read_text() for n in _TOKENIZER_FILES if (Path(tmp) / n).exists()}}

    # ------------------------------------------------------------------------------- OpenAI

    async def chat_sampler(key: str, model: str) -> tuple[str, str]:
        """(sampler id, base model) for a chat ``model``: a sampler, a training session's latest weights, or a base model."""
        engine = backend.engine
        if owners.by_id.get(model) == key and model in engine.samplers:
            return model, engine.samplers[model].slot.name
        if owners.by_id.get(model) == key and model in engine.sessions:
            path = owners.latest_sampler_path.get(model)
            spec = SamplerSpec(model_path=path) if path else SamplerSpec(base_model=engine.sessions[model].base_model)
            target, base = path or f"base:{spec.base_model}", engine.sessions[model].base_model
        elif model in {s.name for s in engine.slots.values()} or model == backend.default_model:
            spec, target, base = SamplerSpec(base_model=model), f"base:{model}", model
        else:
            raise InvalidInputError(f"unknown model {model!r}", field="model", fix="see GET /v1/models")
        if (key, target) not in owners.chat_samplers:
            owners.chat_samplers[(key, target)] = await backend.create_sampler(spec)
        return owners.chat_samplers[(key, target)], base

    @app.get("/v1/models")
    async def models(key: str = Depends(api_key)) -> Any:
        engine = backend.engine
        names = sorted({s.name for s in engine.slots.values()}) + sorted(
            i for i, k in owners.by_id.items() if k == key and (i in engine.sessions or i in engine.samplers)
        )
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "asyncsess"} for n in names]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, key: str = Depends(api_key)) -> Any:
        sampler_id, base = await chat_sampler(key, body.model)
        tok = backend.get_tokenizer(base)
        try:
            prompt = tok.apply_chat_template([m.model_dump() for m in body.messages], add_generation_prompt=True, tokenize=True)
        except Exception as err:  # no chat template, bad roles...
            raise InvalidInputError(f"cannot apply the chat template: {err}", field="messages") from None
        if isinstance(prompt, dict) or hasattr(prompt, "keys"):
            prompt = prompt["input_ids"]
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        params = SamplingParams(
            max_tokens=body.max_completion_tokens or body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=None if not stops else [*stops, *([tok.eos_token_id] if tok.eos_token_id is not None else [])],
        )
        out = await backend.sample(sampler_id, SampleRequest(tuple(prompt), body.n, params))
        special = set(tok.all_special_ids)
        texts = []
        for s in out.sequences:
            text = tok.decode([t for t in s.tokens if t not in special], skip_special_tokens=True)
            for stop in stops or []:
                text = text.split(stop, 1)[0]
            texts.append(text)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:16]}", int(time.time())
        finish = ["stop" if s.stop_reason == "stop" else "length" for s in out.sequences]
        usage = {
            "prompt_tokens": out.usage.prefill_tokens,
            "completion_tokens": out.usage.decode_tokens,
            "total_tokens": out.usage.prefill_tokens + out.usage.decode_tokens,
        }
        if not body.stream:
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": body.model,
                "choices": [
                    {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": f, "logprobs": None}
                    for i, (t, f) in enumerate(zip(texts, finish))
                ],
                "usage": usage,
            }

        def chunk(i: int, delta: dict[str, Any], finish_reason: str | None) -> str:
            obj = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [{"index": i, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
            }
            return f"data: {json.dumps(obj)}\n\n"

        async def events() -> AsyncIterator[str]:
            for i, (s, text, f) in enumerate(zip(out.sequences, texts, finish)):
                yield chunk(i, {"role": "assistant", "content": ""}, None)
                pieces, sent = [], ""
                for n in range(1, len(s.tokens) + 1):  # one event per token, as the text grows
                    now = tok.decode([t for t in s.tokens[:n] if t not in special], skip_special_tokens=True)
                    if len(now) > len(sent) and text.startswith(now):
                        pieces.append(now[len(sent) :])
                        sent = now
                if sent != text:
                    pieces.append(text[len(sent) :])
                for p in pieces:
                    yield chunk(i, {"content": p}, None)
                yield chunk(i, {}, f)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class _Unauthorized(Exception):
    pass


# ------------------------------------------------------------------------------------- running


class _Thread:
    """A uvicorn server on a background thread (for tests, benchmarks and ``local://``-style embedding)."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> _Thread:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the worker failed to start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def serve_in_thread(backend: LocalBackend, api_keys: Iterable[str], host: str = "127.0.0.1", port: int = 0) -> _Thread:
    """Start a worker on ``host:port`` (port 0: a free one) in this process; ``.url``, ``.stop()``."""
    return _Thread(create_app(backend, api_keys), host, port).start()


def main(argv: list[str] | None = None) -> None:
    """``asyncsess-worker [--model M] [--host 127.0.0.1] [--port 8765] [--api-key K] [--dir D] [--device D] [--dtype T]``."""
    import os

    import uvicorn

    p = argparse.ArgumentParser(prog="asyncsess-worker", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="base model to load at start (directory, alias or hub id)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--api-key", action="append", default=None, help="accepted key (repeatable; default $ASYNCSESS_API_KEY or a new one)")
    p.add_argument("--dir", default="./runs/checkpoints", help="checkpoint root")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--sampler", default="auto", choices=["auto", "torch", "vllm"], help="auto: vLLM when installed and on CUDA")
    p.add_argument("--vllm-memory", type=float, default=0.4, help="vLLM's share of the GPU (the trainer keeps the rest)")
    p.add_argument("--vllm-max-model-len", type=int, default=32768, help="cap on vLLM's context (its KV cache must hold one)")
    p.add_argument("--vllm-max-loras", type=int, default=4, help="adapters in one vLLM batch")
    p.add_argument("--vllm-max-cpu-loras", type=int, default=None, help="adapters vLLM keeps loaded (default max(16, max-loras))")
    p.add_argument("--vllm-max-lora-rank", type=int, default=64)
    p.add_argument("--vllm-unembed", default="torch", choices=["torch", "refuse"], help="LM-head LoRAs vLLM cannot load")
    p.add_argument("--token-budget", type=int, default=8192, help="tokens per training micro-batch (halved after an OOM)")
    p.add_argument("--checkpoint-layers", default="auto", choices=["auto", "on", "off"], help="recompute decoder layers in backward")
    args = p.parse_args(argv)
    keys = args.api_key or ([os.environ["ASYNCSESS_API_KEY"]] if os.environ.get("ASYNCSESS_API_KEY") else [])
    if not keys:
        keys = [secrets.token_urlsafe(24)]
        print(f"API key (set ASYNCSESS_API_KEY to reuse): {keys[0]}", flush=True)
    backend = LocalBackend(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        checkpoint_dir=args.dir,
        sampler=args.sampler,
        token_budget=args.token_budget,
        checkpoint_layers=args.checkpoint_layers,
        vllm=VllmOptions(
            memory=args.vllm_memory,
            max_model_len=args.vllm_max_model_len,
            max_loras=args.vllm_max_loras,
            max_cpu_loras=args.vllm_max_cpu_loras,
            max_lora_rank=args.vllm_max_lora_rank,
            unembed=args.vllm_unembed,
        ),
    )
    logging.basicConfig(level=logging.INFO)
    uvicorn.run(create_app(backend, keys), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
