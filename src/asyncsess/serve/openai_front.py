"""An OpenAI-compatible front for any :class:`~asyncsess.client.SamplingClient`, with token-faithful capture.

``OpenAIFront(sampler)`` serves ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(mapped onto the chat path: :mod:`asyncsess.serve.responses_wire`) and ``GET /v1/models``
for whatever backend the sampler runs on (mock, local, http, sagemaker, tinker). Use it in-process (no socket):
``front.openai_client()`` is an ``openai.AsyncOpenAI`` whose httpx client goes through ``front.transport()``
(an ``httpx.ASGITransport`` on ``front.app()``); or mount ``front.router()`` into a server.

Chat messages are rendered with the model's own chat template through :class:`asyncsess.chat.ChatRenderer`
(tools included); replies are parsed for Hermes-style ``<tool_call>{...}</tool_call>`` blocks (the convention
of the templates the project ships) and returned as ``tool_calls``. An assistant message that comes back with
tool-call ids this front issued is rendered from the exact text the model produced, so the next prompt extends
the previous one token for token. Every call is captured (:mod:`asyncsess.serve.capture`) under the rollout id the
caller set: header ``X-Rollout-Id``, else ``metadata["rollout_id"]``, else ``user``, else ``"default"``.

Bad requests get a 400 (404 for an unknown model) with an OpenAI-shaped body naming the parameter; a parameter
the front does not implement is refused by name, never ignored.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import anyio
import anyio.lowlevel
import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..chat import VERBATIM, ChatRenderer, Tool, check_tools, forced_tool_call, parse_tool_calls, special_texts
from ..client import SamplingClient
from ..errors import AsyncSessError, InvalidInputError, RateLimitError, RetriesExhaustedError
from ..types import SampledSequence, SamplingParams
from . import json_body
from .capture import CapturedCall, CapturedChoice, CaptureStore
from .openai_wire import (
    ChatRequest,
    Choice,
    CompletionRequest,
    FrontError,
    Message,
    NamedToolChoice,
    OpenAIRequest,
    SamplingRequest,
    TokenText,
    chat_chunks,
    chat_message,
    check_coding,
    completion_chunks,
    legacy_logprobs,
    model_card,
    model_not_found,
    no_route,
    parse_body,
    reply_json,
    served_tokens,
    usage,
    validation_error,
)
from .responses_wire import ResponsesRequest, chat_request, response_events, response_object, responses_error
from .tool_schema import schema_error

__all__ = ["OpenAIFront", "FrontError", "ROLLOUT_HEADER", "Route", "rollout_reply"]

T = TypeVar("T")
R = TypeVar("R", bound=OpenAIRequest)
Route = Literal["chat", "completions", "responses"]
_UNREAD = object()  # a body not yet decoded

ROLLOUT_HEADER = "x-rollout-id"
VERSION_HEADER = "x-weight-version"
DEFAULT_ROLLOUT = "default"
MAX_ROLLOUT_ID_CHARS = 256
_MAX_REMEMBERED_REPLIES = 100_000
_MAX_REMEMBERED_CHARS = 32_000_000  # and their text: 100,000 long replies (n=64 forced calls) held GBs per front
_GREEDY_BELOW = 1e-6  # temperatures under this sample greedily
_CALL_CHARS = len('<tool_call>{"name": "", "arguments": }</tool_call>\n')  # what the front writes around a call
_MERGED = 4  # characters Unicode normalization may compose into one (a letter and 3 marks: Greek's ᾧ)


def _rollout_id(request: Request, req: OpenAIRequest) -> str:
    """The call's rollout id: header ``X-Rollout-Id``, else ``metadata["rollout_id"]``, else ``user``, else
    ``"default"``; one its captures can be read back by, from ``/v1/asyncsess/rollouts/{id}`` (a ``/`` is fine;
    a ``.`` or ``..`` segment is not: HTTP clients resolve it away before sending the URL), else a FrontError
    naming where it came from."""
    sources = [(ROLLOUT_HEADER, _header_text(request)), ("metadata.rollout_id", (req.metadata or {}).get("rollout_id"))]
    field, rollout = next(((f, r) for f, r in [*sources, ("user", req.user)] if r), (None, DEFAULT_ROLLOUT))
    if len(rollout) > MAX_ROLLOUT_ID_CHARS:
        raise FrontError(f"the rollout id has {len(rollout)} characters; at most {MAX_ROLLOUT_ID_CHARS}", field)
    if any(part in (".", "..") for part in rollout.split("/")):
        raise FrontError(f"the rollout id {rollout!r} has a '.' or '..' segment, which no URL keeps; rename it", field)
    return rollout


def _header_text(request: Request) -> str | None:
    """The ``X-Rollout-Id`` header as the UTF-8 text the client sent (Starlette reads header bytes as Latin-1, so
    ``héllo`` came back as ``hÃ©llo``: captured under another id, and a bound rollout's calls served by the default
    sampler); bytes that are not UTF-8 are a FrontError naming the header."""
    value = request.headers.get(ROLLOUT_HEADER)
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise FrontError(f"the {ROLLOUT_HEADER} header is not UTF-8 text; send the rollout id UTF-8 encoded", ROLLOUT_HEADER) from None


def _topk(k: int) -> dict[str, Any]:
    """The ``sample`` keyword that asks for ``k`` alternatives per sampled token."""
    return {"topk_sample_logprobs": k} if k else {}


def _top_alternatives(seq: SampledSequence, i: int) -> list[tuple[int, float]]:
    table = getattr(seq, "topk_logprobs", None)
    return [(int(t), float(lp)) for t, lp in table[i]] if table else []


@dataclass
class _Binding:
    sampler: SamplingClient
    version: int
    temperature: float | None = None  # forced for every call of the rollout (the loop's policy), if set
    name: str | None = None  # what captures call the sampler (default: its sampler_id)
    seed: int | None = None  # calls that set no seed get seed + i for the rollout's i-th such call
    seeded_calls: int = 0


class OpenAIFront:
    """Serves the OpenAI API from a sampler (or per-rollout samplers) and captures every call's tokens.

    ``model_name`` is the alias clients may use besides the sampler's base model; ``sampler_name`` is what
    captures record as ``sampler_id`` (default: the sampler's own id). ``max_n`` bounds ``n``;
    ``max_tokens`` is the default completion budget; ``context_window`` (if known) caps it to what fits.
    """

    def __init__(
        self,
        sampler: SamplingClient | None = None,
        *,
        version: int = 0,
        model_name: str = "policy",
        captures: CaptureStore | None = None,
        max_n: int = 64,
        max_tokens: int = 256,
        context_window: int | None = None,
        sampler_name: str | None = None,
    ) -> None:
        self.model_name = model_name
        self.captures = captures if captures is not None else CaptureStore()
        self.max_n, self.max_tokens, self.context_window = max_n, max_tokens, context_window
        self._default = _Binding(sampler, version, name=sampler_name) if sampler is not None else None
        self._bindings: dict[str, _Binding] = {}
        self._renderers: dict[str, ChatRenderer] = {}
        self._replies: OrderedDict[str, str] = OrderedDict()  # tool-call id -> the exact reply text
        self._replies_chars = 0
        self._string_stops: set[str] = set()  # samplers that refused stop token ids
        self._token_chars: dict[str, int | None] = {}  # base model -> the most characters one token spells
        self.counts = {"requests": 0, "errors": 0, "sampled_tokens": 0}
        self.active = 0  # calls being served (a reply being streamed is no longer one: it has its samples)

    # ------------------------------------------------------------------ binding samplers to rollouts

    def publish(self, sampler: SamplingClient, version: int, *, sampler_name: str | None = None) -> None:
        """Serve calls without a bound rollout from ``sampler`` (weights ``version``) from now on;
        ``sampler_name``: what its captures call it (default: its sampler_id)."""
        self._default = _Binding(sampler, version, name=sampler_name)

    def bind(
        self, rollout_id: str, sampler: SamplingClient, version: int, temperature: float | None = None, *, seed: int | None = None
    ) -> None:
        """Serve every call of ``rollout_id`` from ``sampler``; ``temperature`` overrides what the agent asks.

        With ``seed``, a call that sets no seed of its own samples with ``seed + i`` (its place among the
        rollout's calls), so concurrent rollouts draw the same tokens whatever order their calls arrive in."""
        self._bindings[rollout_id] = _Binding(sampler, version, temperature, seed=seed)

    def unbind(self, rollout_id: str) -> None:
        self._bindings.pop(rollout_id, None)

    def stats(self) -> dict[str, Any]:
        """Request counts and the sampling pool's backpressure figures (in flight, queued, ...)."""
        out: dict[str, Any] = dict(
            self.counts, bound_rollouts=len(self._bindings), late_calls=self.captures.late_calls, dropped_calls=self.captures.dropped_calls
        )
        binding = self._default or next(iter(self._bindings.values()), None)
        if binding is not None:
            s = binding.sampler.stats()
            out.update(
                in_flight=s.in_flight,
                queued=s.queued,
                bytes_in_flight=s.bytes_in_flight,
                max_in_flight=s.max_in_flight,
                completed=s.completed,
                waited=s.waited,
                peak_in_flight=s.peak_in_flight,
            )
        return out

    # ------------------------------------------------------------------ doors

    def router(self, prefix: str = "") -> APIRouter:
        """The routes, to mount into a server (``app.include_router(front.router())``), under ``prefix``."""
        r = APIRouter(prefix=prefix)
        r.add_api_route("/v1/chat/completions", self._chat_route, methods=["POST"])
        r.add_api_route("/v1/completions", self._completions_route, methods=["POST"])
        r.add_api_route("/v1/responses", self._responses_route, methods=["POST"])
        r.add_api_route("/v1/models", self._models_route, methods=["GET"])
        r.add_api_route("/v1/models/{model:path}", self._model_route, methods=["GET"])
        r.add_api_route("/v1/asyncsess/stats", self._stats_route, methods=["GET"])
        r.add_api_route("/v1/asyncsess/rollouts/{rollout_id:path}", self._rollout_route, methods=["GET", "DELETE"])
        return r

    def app(self) -> FastAPI:
        """A standalone ASGI app with the routes; other paths and methods are refused in OpenAI's error shape."""
        app = FastAPI(title="asyncsess OpenAI front")
        app.include_router(self.router())

        @app.exception_handler(StarletteHTTPException)
        async def _no_route(request: Request, err: StarletteHTTPException) -> JSONResponse:
            return no_route(request, err.status_code, str(err.detail), err.headers)  # a 405 keeps its Allow

        return app

    def transport(self) -> httpx.ASGITransport:
        """An httpx transport that calls the app in-process (no socket), within the client's read timeout."""
        return _TimedTransport(app=self.app())

    def openai_client(self, rollout_id: str | None = None, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` talking to this front in-process; its calls are captured under ``rollout_id``."""
        import openai  # the test/agent extra; not needed to serve

        headers = dict(kwargs.pop("default_headers", None) or {})
        # UTF-8 bytes in the httpx client's headers: httpx (and so openai's default_headers) sends ASCII text only
        rollout = {ROLLOUT_HEADER.encode(): rollout_id.encode("utf-8")} if rollout_id is not None else {}
        http = httpx.AsyncClient(transport=self.transport(), base_url="http://asyncsess-front", headers=rollout)
        kwargs.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(
            base_url="http://asyncsess-front/v1", api_key="asyncsess", http_client=cast(Any, http), default_headers=headers, **kwargs
        )

    # ------------------------------------------------------------------ routes

    def _model_names(self) -> list[str]:
        return sorted({self.model_name} | {b.sampler.base_model for b in self._all_bindings()})

    async def _models_route(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(n) for n in self._model_names()]})

    async def _model_route(self, model: str) -> JSONResponse:
        if model not in self._model_names():
            return model_not_found(model).response()
        return JSONResponse(model_card(model))

    async def _rollout_route(self, rollout_id: str, request: Request) -> Response:
        """The captured calls of a rollout (for a trainer in another process); ``DELETE`` also forgets them."""
        calls = self.captures.pop(rollout_id) if request.method == "DELETE" else self.captures.calls(rollout_id)
        return await rollout_reply(rollout_id, calls)

    async def _stats_route(self) -> JSONResponse:
        return JSONResponse(self.stats())

    async def _chat_route(self, request: Request) -> Response:
        return await self._serve(request, ChatRequest, self._chat)

    async def _completions_route(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, self._completion)

    async def _responses_route(self, request: Request) -> Response:
        return await self._serve(request, ResponsesRequest, self._responses)

    async def answer(self, request: Request, body: Any, route: Route) -> Response:
        """A request to ``route`` whose body the caller has decoded already (``parse_body``)."""
        routes: dict[str, tuple[type[OpenAIRequest], Any]] = {
            "chat": (ChatRequest, self._chat),
            "completions": (CompletionRequest, self._completion),
            "responses": (ResponsesRequest, self._responses),
        }
        model, handler = routes[route]
        return await self._serve(request, model, handler, body)

    async def _serve(self, request: Request, model: type[OpenAIRequest], handler: Any, body: Any = _UNREAD) -> Response:
        self.counts["requests"] += 1
        self.active += 1
        try:
            raw = await request.body()  # a large body is decoded and validated in a thread (json_body)
            if body is _UNREAD:
                check_coding(request.headers)
                body = await json_body.off_loop(len(raw), parse_body, raw)
            req = await json_body.off_loop(len(raw), _request_of, body, model)
            if getattr(req, "stream_options", None) is not None and not req.stream:
                raise FrontError("stream_options is only allowed when stream is true; set stream or drop it", "stream_options")
            rollout = _rollout_id(request, req)
            return await handler(req, rollout, request)
        except FrontError as err:
            self.counts["errors"] += 1
            return err.response()
        except (_ClientGone, ClientDisconnect):  # no one reads the answer (it hung up while its call ran, or its body arrived)
            return Response(status_code=499)
        except InvalidInputError as err:
            self.counts["errors"] += 1
            return FrontError(str(err), err.field).response()
        except AsyncSessError as err:  # the backend failed, not the request
            self.counts["errors"] += 1
            return _unavailable(err).response()
        finally:
            self.active -= 1

    # ------------------------------------------------------------------ shared steps

    def _all_bindings(self) -> list[_Binding]:
        return [b for b in [self._default, *self._bindings.values()] if b is not None]

    def _binding(self, rollout: str, model: str) -> _Binding:
        binding = self._bindings.get(rollout) or self._default
        if binding is None:
            raise FrontError(f"no sampler serves rollout {rollout!r}", ROLLOUT_HEADER, status=404, code="rollout_not_found")
        if model not in (self.model_name, binding.sampler.base_model):
            raise FrontError(
                f"the model {model!r} does not exist here; use {self.model_name!r} or {binding.sampler.base_model!r}",
                "model",
                status=404,
                code="model_not_found",
            )
        return binding

    def _renderer(self, sampler: SamplingClient) -> ChatRenderer:
        key = sampler.base_model
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(sampler.get_tokenizer())
        return self._renderers[key]

    def _refuse_past_context(self, sampler: SamplingClient, chars: int, field: str, what: str) -> None:
        """A FrontError when ``chars`` characters of text are sure to make more tokens than the context holds: each
        token spells at most as many characters as the vocabulary's longest entry, once a tokenizer's Unicode
        normalization has merged a character with its combining marks (at most ``_MERGED`` into one). Tokenizing
        first took seconds for a few MB of text, on the event loop every tenant's calls wait on."""
        if self.context_window is None:
            return
        key = sampler.base_model
        if key not in self._token_chars:
            self._token_chars[key] = _max_token_chars(sampler.get_tokenizer())
        most = self._token_chars[key]
        if most is not None and chars > _MERGED * most * self.context_window:
            raise FrontError(
                f"{what} {chars} characters: more than the {self.context_window} tokens of the model's context "
                f"can spell ({most} characters a token at most, {_MERGED} before normalization); shorten them",
                field,
            )

    def _refuse_full_prompt(self, prompt_len: int, field: str) -> None:
        """A FrontError naming ``field`` when a prompt of ``prompt_len`` tokens leaves the context no room to sample."""
        if self.context_window is not None and prompt_len >= self.context_window:
            raise FrontError(f"the prompt has {prompt_len} tokens; the context holds {self.context_window}", field)

    def _params(
        self, req: SamplingRequest, binding: _Binding, prompt_len: int, max_tokens: int | None, stop: list[str | int]
    ) -> SamplingParams:
        if req.n > self.max_n:
            raise FrontError(f"n={req.n} is more than this server allows ({self.max_n})", "n")
        budget = max_tokens or self.max_tokens
        if self.context_window is not None and max_tokens is not None and max_tokens > self.context_window:
            name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise FrontError(f"{name}={max_tokens} is more than the model's context ({self.context_window} tokens)", name)
        if self.context_window is not None:
            self._refuse_full_prompt(prompt_len, "messages" if isinstance(req, ChatRequest) else "prompt")
            budget = min(budget, self.context_window - prompt_len)
        temperature = binding.temperature if binding.temperature is not None else req.temperature
        if temperature is not None and temperature < _GREEDY_BELOW:
            temperature = 0.0  # the limit of softmax(x / T) as T -> 0; tinier T overflows the logits
        return SamplingParams(
            max_tokens=budget,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=None if req.seed is None else req.seed % 2**63,  # None: the rollout's seed, if bound with one (in _sample)
            stop=stop or None,
        )

    async def _sample(
        self,
        request: Request,
        rollout: str,
        binding: _Binding,
        prompt: list[int],
        req: SamplingRequest,
        params: SamplingParams,
        topk: dict[str, Any],
    ) -> tuple[int, list[SampledSequence]]:
        """The call's index in its rollout and its samples.

        The index (and the rollout seed of a call that sets none) is taken once the client has checked the
        request, and given back if the call fails to sample (the backend refuses it, say) while no later call of
        the rollout has taken one: a refused call shifts neither the indices nor the seeds of the calls after it.
        So is a call whose client hung up while it sampled (it timed out, and may be retrying): the agent never
        saw those samples, so they are not captured."""
        sampler = binding.sampler
        seeded = params.seed is None and binding.seed is not None
        if seeded:
            params = params.model_copy(update={"seed": (cast(int, binding.seed) + binding.seeded_calls) % 2**63})
        if sampler.sampler_id in self._string_stops:
            params = _stops_as_strings(params, sampler.get_tokenizer())
        pending = sampler.sample(prompt, req.n, params, **topk)  # the client's checks: a refusal here takes nothing
        index = self.captures.reserve(rollout)
        binding.seeded_calls += int(seeded)
        try:
            seqs = await _unless_gone(request, self._sampled(binding, prompt, req, params, topk, pending))
        except BaseException:
            await _withdraw(pending)  # the client hung up or timed out: free the sampling slot now
            if self.captures.release(rollout, index):
                binding.seeded_calls -= int(seeded)
            raise
        return index, seqs

    async def _sampled(
        self, binding: _Binding, prompt: list[int], req: SamplingRequest, params: SamplingParams, topk: dict[str, Any], pending: Any
    ) -> list[SampledSequence]:
        sampler = binding.sampler
        try:
            response = await pending
        except InvalidInputError as err:  # a backend that takes stop strings only (SageMaker): the stop tokens' text
            if err.field != "sampling_params.stop" or not params.stop_token_ids():
                raise
            self._string_stops.add(sampler.sampler_id)
            response = await _withdrawn_if_cancelled(
                sampler.sample(prompt, req.n, _stops_as_strings(params, sampler.get_tokenizer()), **topk)
            )
        seqs = list(response.sequences)
        for i, seq in enumerate(seqs):
            if seq.logprobs is None or len(seq.logprobs) != len(seq.tokens):  # score them: a capture needs log-probs
                lps = await _withdrawn_if_cancelled(sampler.compute_logprobs(prompt + list(seq.tokens)))
                seqs[i] = seq.model_copy(update={"logprobs": [float(x or 0.0) for x in lps[len(prompt) :]]})
        self.counts["sampled_tokens"] += sum(len(s.tokens) for s in seqs)
        return seqs

    def _remember(self, call_id: str, text: str) -> None:
        """Keep ``text`` as the reply behind ``call_id``; the oldest are forgotten past ``_MAX_REMEMBERED_REPLIES`` or
        ``_MAX_REMEMBERED_CHARS`` (a forgotten one, sent back, renders from the message's fields)."""
        self._replies[call_id] = text
        self._replies_chars += len(text)
        while len(self._replies) > _MAX_REMEMBERED_REPLIES or self._replies_chars > _MAX_REMEMBERED_CHARS:
            self._replies_chars -= len(self._replies.popitem(last=False)[1])

    def _capture(
        self, rollout: str, index: int, endpoint: Any, req: OpenAIRequest, binding: _Binding, prompt: list[int], choices: list[Choice]
    ) -> None:
        request = req.model_dump(exclude={"stream", "stream_options"}, exclude_none=True)
        self.captures.add(
            CapturedCall(
                rollout_id=rollout,
                call_index=index,
                endpoint=endpoint,
                model=req.model,
                sampler_id=binding.name or binding.sampler.sampler_id,
                weight_version=binding.version,
                prompt_tokens=list(prompt),
                choices=[
                    CapturedChoice(
                        index=c.index,
                        tokens=c.tokens,
                        logprobs=c.logprobs,
                        finish_reason=c.finish,
                        text=c.text,
                        tool_calls=c.tool_calls,
                        schema_errors=c.schema_errors,
                        tool_choice_error=c.tool_choice_error,
                    )
                    for c in choices
                ],
                usage=usage(prompt, choices),
                request=request,
            )
        )

    # ------------------------------------------------------------------ chat

    def _chat_messages(self, req: ChatRequest) -> list[dict[str, str]]:
        out = []
        for m in _answers_in_call_order(req.messages):
            if m.role == "assistant" and m.tool_calls:
                raw = [self._replies.get(c.id) for c in m.tool_calls]
                if raw[0] is not None and all(r == raw[0] for r in raw):
                    out.append({"role": "assistant", "content": raw[0], VERBATIM: "1"})  # exactly what the model wrote
                    continue
                calls = [
                    f'<tool_call>{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}</tool_call>'
                    for c in m.tool_calls
                ]
                out.append({"role": "assistant", "content": (m.text() + "\n" if m.text() else "") + "\n".join(calls)})
            else:
                out.append({"role": "system" if m.role == "developer" else m.role, "content": m.text()})
        return out

    async def _chat_choices(
        self, req: ChatRequest, rollout: str, request: Request, endpoint: str, sent: OpenAIRequest
    ) -> tuple[_Binding, list[int], list[Choice], ChatRenderer]:
        """A chat request rendered, sampled, parsed for tool calls and captured (as ``sent``, under ``endpoint``)."""
        binding = self._binding(rollout, req.model)
        if req.parallel_tool_calls is False:
            raise FrontError(
                "parallel_tool_calls=false is not supported (a reply may call several tools); leave it unset", "parallel_tool_calls"
            )
        # every message's text and tool calls: a template that drops old assistant turns could fit more, but not
        # _MERGED times the context's longest spelling (uncounted, 256 MB of them were parsed and tokenized
        # on the event loop)
        shown = [m.text() for m in req.messages]
        # a call as the front writes it (<tool_call>{"name": ..., "arguments": ...}</tool_call>): 3 characters of name and
        # arguments made 50 of prompt, so 175,000 calls fit a count of what the client sent, and took seconds to tokenize
        calls = [c.function for m in req.messages for c in m.tool_calls or []]
        shown += [part for f in calls for part in (f.name, f.arguments)]
        for t in req.tools or []:  # as compact as a template could show a tool
            shown += [t.function.name, t.function.description, json.dumps(t.function.parameters, separators=(",", ":"), ensure_ascii=False)]
        chars = sum(map(len, shown)) + _CALL_CHARS * len(calls)
        self._refuse_past_context(binding.sampler, chars, "messages", "the messages and tools hold")
        for i, m in enumerate(req.messages):
            if m.name is not None:
                raise FrontError("message names are not supported (the chat template has no place for them); drop it", f"messages.{i}.name")
            for j, c in enumerate(m.tool_calls or []):
                try:
                    json.loads(c.function.arguments)
                except (ValueError, RecursionError):  # nested past the parser's recursion limit too
                    raise FrontError("the tool-call arguments are not JSON", f"messages.{i}.tool_calls.{j}.function.arguments") from None
        forced, names = _forced(req)
        topk = _topk(req.top_logprobs)
        if req.top_logprobs and not req.logprobs:
            raise FrontError("top_logprobs needs logprobs=true", "top_logprobs")
        renderer = self._renderer(binding.sampler)
        tools = [Tool(t.function.name, t.function.description, t.function.parameters, _no_run) for t in req.tools or []]
        check_tools(special_texts(renderer.tokenizer), [t.schema() for t in tools], field="tools.{}.function")
        messages = self._chat_messages(req)
        try:
            prompt = await json_body.off_loop(chars, renderer.tokens, messages, tools, True, forced)  # (see _tokens)
        except InvalidInputError as err:  # its field indexes the rendered conversation, not the request's messages
            raise FrontError(str(err), "messages") from None
        except Exception as err:  # the template rejected the conversation
            raise FrontError(f"the chat template cannot render these messages: {err}", "messages") from None
        stops = [s for s in ([req.stop] if isinstance(req.stop, str) else req.stop or [])]
        params = self._params(req, binding, len(prompt), req.max_completion_tokens or req.max_tokens, [*renderer.stop, *stops])
        budgets = (req.max_tokens, req.max_completion_tokens)
        if None not in budgets and budgets[0] != budgets[1]:  # one of them would be ignored
            raise FrontError(
                f"max_tokens={budgets[0]} and max_completion_tokens={budgets[1]} disagree; send only max_completion_tokens", "max_tokens"
            )
        try:
            index, seqs = await self._sample(request, rollout, binding, prompt, req, params, topk)
        except InvalidInputError as err:  # the backend refused the prompt: the chat has no 'prompt', it sent messages
            if err.field != "prompt":
                raise
            raise FrontError(f"the messages (with the tools) rendered to a prompt the sampler refused: {err}", "messages") from None
        parse_tools = bool(tools) and req.tool_choice != "none"
        strict = {t.function.name: t.function.parameters for t in req.tools or [] if t.function.strict}
        choices = []
        for i, s in enumerate(seqs):  # each decoded, cut and parsed apart: 64 long choices held the event loop for seconds
            await anyio.lowlevel.cancel_shielded_checkpoint()  # (not a cancel point: the call has its index, it is captured)
            choices.append(self._chat_choice(i, s, renderer, set(renderer.stop), stops, parse_tools, strict, forced, names))
        self._capture(rollout, index, endpoint, sent, binding, prompt, choices)
        return binding, prompt, choices, renderer

    async def _chat(self, req: ChatRequest, rollout: str, request: Request) -> Response:
        binding, prompt, choices, renderer = await self._chat_choices(req, rollout, request, "chat.completions", req)
        tok = renderer.tokenizer
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        headers = {VERSION_HEADER: str(binding.version)}
        fingerprint = f"asyncsess-w{binding.version}"
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = chat_chunks(
                cid, created, req.model, fingerprint, choices, tok, req.logprobs, usage(prompt, choices) if include_usage else None
            )
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)

        def body() -> bytes:
            texts = TokenText(tok)
            return reply_json(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": req.model,
                    "system_fingerprint": fingerprint,
                    "choices": [
                        {
                            "index": c.index,
                            "message": chat_message(c),
                            "logprobs": {"content": [texts.entry(t, lp, top) for t, lp, top in c.shown()]} if req.logprobs else None,
                            "finish_reason": c.finish,
                        }
                        for c in choices
                    ],
                    "usage": usage(prompt, choices),
                }
            )

        return await _json_reply(body, _reply_size(choices, req.top_logprobs if req.logprobs else None), headers)

    def _chat_choice(
        self,
        i: int,
        seq: SampledSequence,
        renderer: ChatRenderer,
        turn_stops: set[int],
        stops: list[str],
        parse_tools: bool,
        strict: dict[str, dict[str, Any]],
        forced: str = "",
        names: frozenset[str] | None = None,
    ) -> Choice:
        """A sampled sequence as a reply; ``strict``: the schemas of the strict tools, which their calls' arguments are
        checked against (sampling is not constrained: a call that breaks its schema is returned, and flagged in the capture).

        ``forced``: the tool-call opening ``tool_choice`` put in the prompt, which the reply continues; ``names``: the
        tools it may call then. A reply that is no call, or calls another tool, is returned as the model wrote it and
        flagged in the capture (``tool_choice_error``), as a strict tool's bad arguments are."""
        tokens, lps = list(seq.tokens), [float(x) for x in seq.logprobs or []]
        top = [_top_alternatives(seq, j) for j in range(len(tokens))]
        body = tokens[:-1] if seq.stop_reason == "stop" and tokens and tokens[-1] in turn_stops else tokens
        sampled = str(renderer.tokenizer.decode(body))  # special tokens kept: rendered back, they tokenize the same
        text = forced + sampled
        content, finish = forced + _cut_at_stop(sampled, stops), "length" if seq.stop_reason == "length" else "stop"
        tool_calls: list[dict[str, Any]] = []
        schema_errors: dict[str, str] = {}
        unmet: str | None = None
        if parse_tools and "<tool_call>" in content:
            calls, error = parse_tool_calls(content)
            if forced and (error is not None or not calls):
                unmet = f"the reply is not a tool call: {error or 'no call'}"
            elif names is not None and (other := next((c.name for c in calls if c.name not in names), None)) is not None:
                unmet = f"the reply calls {other[:64]!r}, which tool_choice does not allow"
            if error is None and calls:
                for call in calls:
                    call_id = f"call_{uuid.uuid4().hex[:24]}"
                    tool_calls.append(
                        {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                    )
                    self._remember(call_id, text)
                    if call.name in strict and (err := schema_error(strict[call.name], call.arguments)):
                        schema_errors[call_id] = err
                content = content[: content.index("<tool_call>")].strip()
                finish = "tool_calls"
        # the log-probs served cover the reply's sampled text (the whole of it for tool calls), never the end token
        served = len(body) if tool_calls else served_tokens(renderer.tokenizer, body, content[len(forced) :], skip_special_tokens=False)
        shown = content if content or not tool_calls else None
        forced = "" if tool_calls else forced  # (content, where it shows, starts with it)
        return Choice(i, tokens, lps, top, finish, text, shown, tool_calls, served, schema_errors, forced, unmet)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ responses

    async def _responses(self, req: ResponsesRequest, rollout: str, request: Request) -> Response:
        """The Responses API as a chat: the same rendering, sampling, tool-call parsing and capture."""
        chat, origins = chat_request(req)
        try:
            binding, prompt, choices, renderer = await self._chat_choices(chat, rollout, request, "responses", req)
        except FrontError as err:
            raise responses_error(err, origins) from None
        except InvalidInputError as err:  # (a tool the template cannot show, say): its field names the chat request's
            raise responses_error(FrontError(str(err), err.field), origins) from None
        body = response_object(f"resp_{uuid.uuid4().hex}", int(time.time()), req, choices[0], usage(prompt, choices))
        headers = {VERSION_HEADER: str(binding.version)}
        if req.stream:
            events = response_events(body, choices[0], renderer.tokenizer)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(body, headers=headers)

    # ------------------------------------------------------------------ completions

    async def _completion(self, req: CompletionRequest, rollout: str, request: Request) -> Response:
        binding = self._binding(rollout, req.model)
        topk = _topk(req.logprobs or 0)
        tok = binding.sampler.get_tokenizer()
        if isinstance(req.prompt, str):
            self._refuse_past_context(binding.sampler, len(req.prompt), "prompt", "the prompt holds")
        prompt = list(req.prompt) if isinstance(req.prompt, list) else await json_body.off_loop(len(req.prompt), _tokens, tok, req.prompt)
        if not prompt:
            raise FrontError("the prompt is empty", "prompt")
        self._refuse_full_prompt(len(prompt), "prompt")  # before every id is scanned (on the event loop)
        vocab = len(cast(Any, tok))  # HF: added tokens included
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise FrontError(f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        params = self._params(req, binding, len(prompt), req.max_tokens or 16, list(stops))
        index, seqs = await self._sample(request, rollout, binding, prompt, req, params, topk)
        eos = getattr(tok, "eos_token_id", None)
        choices = []
        for i, s in enumerate(seqs):
            await anyio.lowlevel.cancel_shielded_checkpoint()  # (as for chat: other calls run between long choices)
            tokens = list(s.tokens)
            reply = tokens[:-1] if s.stop_reason == "stop" and tokens and tokens[-1] == eos else tokens
            text = _cut_at_stop(tok.decode(reply, skip_special_tokens=True), stops)
            top = [_top_alternatives(s, j) for j in range(len(tokens))]
            served = served_tokens(tok, reply, text)  # the log-probs served cover the text, not the end token
            choices.append(Choice(i, tokens, [float(x) for x in s.logprobs or []], top, s.stop_reason, text, text, [], served))
        self._capture(rollout, index, "completions", req, binding, prompt, choices)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        headers = {VERSION_HEADER: str(binding.version)}
        want_lp = req.logprobs is not None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = completion_chunks(cid, created, req.model, choices, tok, want_lp, usage(prompt, choices) if include_usage else None)
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)

        def body() -> bytes:
            texts = TokenText(tok)
            lps = [legacy_logprobs(tok, c, texts) if want_lp else None for c in choices]
            return reply_json(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": req.model,
                    "system_fingerprint": f"asyncsess-w{binding.version}",
                    "choices": [
                        {"index": c.index, "text": c.content, "logprobs": lp, "finish_reason": c.finish} for c, lp in zip(choices, lps)
                    ],
                    "usage": usage(prompt, choices),
                }
            )

        return await _json_reply(body, _reply_size(choices, req.logprobs), headers)


async def rollout_reply(rollout_id: str, calls: Sequence[CapturedCall]) -> Response:
    """``{"rollout_id", "calls"}``: a rollout's captured calls as JSON, made in a worker thread when they are large, a
    call at a time (a key's 4,000,000 captured tokens were 36 MB made in one ``json.dumps``, 0.75 s of the event loop
    every tenant's calls wait on, on each read of the rollout)."""
    size = 8 * sum(len(c.prompt_tokens) + sum(3 * len(ch.tokens) + len(ch.text) for ch in c.choices) for c in calls)

    def build() -> bytes:
        return reply_json({"rollout_id": rollout_id, "calls": calls}, "calls", lambda c: c.model_dump(mode="json"))

    return Response(await json_body.off_loop(size, build), media_type="application/json")


def _reply_size(choices: Sequence[Choice], top: int | None) -> int:
    """About the bytes of a reply's JSON: its text, and an entry per served token and alternative (``top`` None: no
    log-probs)."""
    text = sum(len(c.content or "") + len(c.text) for c in choices)
    return text + (0 if top is None else 100 * (1 + top) * sum(len(c.tokens) for c in choices))


async def _json_reply(build: Callable[[], bytes], size: int, headers: dict[str, str]) -> Response:
    """The JSON reply ``build`` makes, made in a worker thread when it is large (``size`` bytes)."""
    return Response(await json_body.off_loop(size, build), media_type="application/json", headers=headers)


def _forced(req: ChatRequest) -> tuple[str, frozenset[str] | None]:
    """The tool-call opening ``tool_choice`` forces the reply to start with ("" for auto / none) and the tools the
    reply may call then; a FrontError naming ``tool_choice`` when it asks for a call no tool in ``tools`` can answer."""
    choice, tools = req.tool_choice, {t.function.name for t in req.tools or []}
    if choice in (None, "auto", "none"):
        return "", None
    if not tools:
        raise FrontError("tool_choice 'required' or a named function needs tools; declare the functions in tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in tools:
            raise FrontError(f"tool_choice names {name!r}, which is not in tools; name one of {sorted(tools)[:16]}", "tool_choice")
        return forced_tool_call(name), frozenset([name])
    return forced_tool_call(), frozenset(tools)


class _ClientGone(Exception):
    """The client hung up before its call was answered."""


def _request_of(body: Any, model: type[R]) -> R:
    """The request in a decoded ``body``, or a FrontError naming what is wrong with it."""
    if not isinstance(body, dict):
        raise FrontError("the body must be a JSON object", None, code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise validation_error(err) from None


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; :class:`_ClientGone` as soon as the client hangs up (``work`` cancelled).

    A sampler slot held for a client that is gone was held to the end of its sampling (minutes for a long reply),
    delaying every other agent's calls. The ASGI ``receive`` of a request whose body was read waits for the
    disconnect (or, in-process, for the response)."""
    gone, failed, result = False, None, None

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        scope.cancel()

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            try:
                result = await work
            except Exception as err:  # raised after the task group: inside it, it would come wrapped in a group
                failed = err
            tg.cancel_scope.cancel()
    if failed is not None:
        raise failed
    if gone:
        raise _ClientGone
    return cast(T, result)


async def _withdrawn_if_cancelled(pending: Awaitable[T]) -> T:
    """``await pending``; if the caller is cancelled meanwhile (its client hung up), its work is withdrawn too."""
    try:
        return await pending
    except BaseException:
        await _withdraw(pending)
        raise


async def _withdraw(pending: Any) -> None:
    """Cancel a sampling future that is not done, and wait (shielded) until it has given back its pool slot."""
    cancel = getattr(pending, "cancel", None)
    if cancel is not None and cancel():
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(Exception):
                await pending


def _unavailable(err: AsyncSessError) -> FrontError:
    """A backend failure as the openai client's retry logic reads it: a throttled backend is a 429, any other
    failure a 503 (both retried), with the backend's hint of when to retry as ``retry-after-ms`` / ``Retry-After``."""
    cause = err.__cause__ if isinstance(err, RetriesExhaustedError) and err.__cause__ is not None else err
    hint = getattr(cause, "retry_after", None)
    headers = {"retry-after-ms": str(round(hint * 1000)), "Retry-After": str(math.ceil(hint))} if hint and hint > 0 else None
    if isinstance(cause, RateLimitError):
        return FrontError(f"the sampler is throttled: {err}", None, status=429, code="rate_limit_exceeded", headers=headers)
    return FrontError(f"the sampler failed: {err}", None, status=503, code="sampler_unavailable", headers=headers)


class _TimedTransport(httpx.ASGITransport):
    """httpx's ASGI transport keeps no timeout (it has no socket to time): a call that outlasts the client's read
    timeout is cancelled here and raises ``httpx.ReadTimeout``, which the openai client retries or raises as
    ``APITimeoutError``, as it would over a socket."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = (request.extensions.get("timeout") or {}).get("read")
        if timeout is None:
            return await super().handle_async_request(request)
        with anyio.move_on_after(timeout):
            return await super().handle_async_request(request)
        raise httpx.ReadTimeout(f"no response within the read timeout ({timeout} s)", request=request)


def _answers_in_call_order(messages: Sequence[Message]) -> list[Message]:
    """``messages`` with the tool messages that answer an assistant message's tool calls put in the order of its calls.

    A template shows tool results without their ``tool_call_id``, so their order is all that tells the model which
    result belongs to which call; an agent that appends results as they complete sends them in any order. As
    OpenAI's API does, a FrontError refuses a tool message that answers no call of the assistant message before it
    (or one already answered) and a call left without an answer."""
    out: list[Message] = []
    i = 0
    while i < len(messages):
        m, at = messages[i], i
        i += 1
        if m.role == "tool":
            raise FrontError(
                "a tool message must follow an assistant message with tool_calls (or the other tool messages answering it)",
                f"messages.{at}.role",
            )
        out.append(m)
        calls = [c.id for c in m.tool_calls or []] if m.role == "assistant" else []
        ids = set(calls)  # (a list scanned per answer: 4,095 answers to 100,000 calls held the event loop 6 s)
        if len(ids) != len(calls):
            raise FrontError("the tool calls of an assistant message must have distinct ids", f"messages.{at}.tool_calls")
        answers: dict[str, Message] = {}
        while calls and i < len(messages) and messages[i].role == "tool":
            call_id = messages[i].tool_call_id
            if call_id not in ids or call_id in answers:
                what = "answers a tool call already answered" if call_id in answers else f"answers no tool call of messages.{at}"
                raise FrontError(f"tool_call_id {call_id!r} {what}: answer each call once, by its id", f"messages.{i}.tool_call_id")
            answers[call_id] = messages[i]
            i += 1
        missing = next((j for j, c in enumerate(calls) if c not in answers), None)
        if missing is not None:
            raise FrontError(
                f"tool call {calls[missing]!r} has no answer: follow the assistant message with one tool message per call",
                f"messages.{at}.tool_calls.{missing}.id",
            )
        out += [answers[c] for c in calls]
    return out


async def _no_run(arguments: Any) -> tuple[str, dict[str, float]]:
    raise RuntimeError("the front renders tools; the agent runs them")


def _max_token_chars(tok: Any) -> int | None:
    """The most characters one token of ``tok`` decodes to, at most (its longest vocabulary entry: a token's string
    spells a character in one or more characters); None if the vocabulary cannot be read."""
    try:
        vocab = getattr(tok, "get_vocab", None)
        if vocab is not None:
            return max(map(len, vocab()), default=None)
        if len(tok) <= 2**16:
            return max((len(str(tok.decode([i]))) for i in range(len(tok))), default=None)
    except Exception:  # a tokenizer without a readable vocabulary: no early bound
        pass
    return None


def _stops_as_strings(params: SamplingParams, tok: Any) -> SamplingParams:
    strings = [*params.stop_strings(), *(str(tok.decode([t])) for t in params.stop_token_ids())]
    return params.model_copy(update={"stop": list(dict.fromkeys(strings))})


def _tokens(tok: Any, text: str) -> list[int]:
    """``text``'s token ids. A prompt of more than ``json_body.INLINE_BYTES`` characters is tokenized in a worker thread, as a
    chat's messages are (a tokenizer hands the GIL back as it works): 1,000,000 characters held the event loop every
    tenant's calls wait on for 0.7 s (a context of 32k tokens can take that many)."""
    return [int(t) for t in tok.encode(text)]


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """OpenAI semantics: the reply ends before the first stop string (which is not returned)."""
    cut = min((text.index(s) for s in stops if s in text), default=len(text))
    return text[:cut]
