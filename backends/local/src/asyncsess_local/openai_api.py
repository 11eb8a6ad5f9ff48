"""The worker's OpenAI-compatible routes: ``GET /v1/models`` and ``POST /v1/chat/completions`` (text in,
text out; ``stream`` as server-sent events).

A chat ``model`` is a base model, one of the key's samplers, or one of its training sessions (its latest
``save_weights``, else its base model); the sampler a chat uses is made once per key and target.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from asyncsess.backends import SampleRequest, SamplerSpec
from asyncsess.errors import InvalidInputError
from asyncsess.types import SamplingParams

from . import bodies
from .embedded import LocalBackend
from .tenants import Owners

__all__ = ["router"]


def router(backend: LocalBackend, owners: Owners, base_models: Callable[[], set[str]], api_key: Callable[..., str]) -> APIRouter:
    """The OpenAI routes over ``backend``; ``api_key``: the dependency naming the request's tenant,
    ``base_models``: the base models a client may name."""
    api = APIRouter()

    async def chat_sampler(key: str, model: str) -> tuple[str, str]:
        """(sampler id, base model) for a chat ``model``: a sampler, a training session's latest weights, or a base model."""
        engine = backend.engine
        if owners.by_id.get(model) == key and model in engine.samplers:
            return model, engine.samplers[model].slot.name
        if owners.by_id.get(model) == key and model in engine.sessions:
            path = owners.latest_sampler_path.get(model)
            spec = SamplerSpec(model_path=path) if path else SamplerSpec(base_model=engine.sessions[model].base_model)
            target, base = path or f"base:{spec.base_model}", engine.sessions[model].base_model
        elif model in base_models():
            spec, target, base = SamplerSpec(base_model=model), f"base:{model}", model
        else:
            raise InvalidInputError(f"unknown model {model!r}", field="model", fix="see GET /v1/models")
        if (key, target) not in owners.chat_samplers:
            owners.chat_samplers[(key, target)] = await backend.create_sampler(spec)
        return owners.chat_samplers[(key, target)], base

    @api.get("/v1/models")
    async def models(key: str = Depends(api_key)) -> Any:
        engine = backend.engine
        names = sorted(base_models()) + sorted(
            i for i, k in owners.by_id.items() if k == key and (i in engine.sessions or i in engine.samplers)
        )
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "asyncsess"} for n in names]}

    @api.post("/v1/chat/completions")
    async def chat(body: bodies.ChatRequest, key: str = Depends(api_key)) -> Any:
        sampler_id, base = await chat_sampler(key, body.model)
        tok: Any = backend.get_tokenizer(base)  # a transformers tokenizer (chat template, special ids)
        try:
            prompt = tok.apply_chat_template([m.model_dump() for m in body.messages], add_generation_prompt=True, tokenize=True)
        except Exception as err:  # no chat template, bad roles...
            raise InvalidInputError(f"cannot apply the chat template: {err}", field="messages") from None
        if isinstance(prompt, dict) or hasattr(prompt, "keys"):
            prompt = prompt["input_ids"]
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        try:
            params = SamplingParams(
                max_tokens=body.max_completion_tokens or body.max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                seed=body.seed,
                stop=None if not stops else [*stops, *([tok.eos_token_id] if tok.eos_token_id is not None else [])],
            )
        except ValidationError as err:
            raise bodies.invalid_input(err.errors()) from None
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

    return api
