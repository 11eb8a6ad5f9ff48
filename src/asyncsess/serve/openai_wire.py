"""The OpenAI wire format of the front: request schemas (unknown parameters refused), the error body, and the
encoding of replies, log-probs and server-sent-event streams. Pure data: no sampler here."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import anyio
import anyio.lowlevel
from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from ..types import MAX_STOP_CHARS, MAX_TOKENS
from . import json_body

__all__ = [
    "FrontError",
    "model_card",
    "model_not_found",
    "no_route",
    "Message",
    "OpenAIRequest",
    "SamplingRequest",
    "ChatRequest",
    "NamedToolChoice",
    "ToolMode",
    "tool_choice_kind",
    "CompletionRequest",
    "Choice",
    "validation_error",
    "usage",
    "chat_message",
    "lp_entry",
    "TokenText",
    "reply_json",
    "token_bytes",
    "legacy_logprobs",
    "chat_chunks",
    "content_pieces",
    "reply_pieces",
    "served_tokens",
    "completion_chunks",
]

Finite = Annotated[StrictFloat, Field(allow_inf_nan=False)]  # an int too; not a bool or a string


class FrontError(Exception):
    """A request the front refuses: HTTP ``status`` and an OpenAI error body naming ``param``."""

    def __init__(
        self, message: str, param: str | None, status: int = 400, code: str = "invalid_request", headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.headers = message, param, status, code, headers

    def response(self) -> JSONResponse:
        param = None if self.param is None else _printable(self.param)
        body = {"error": {"message": _printable(self.message), "type": "invalid_request_error", "param": param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def model_card(name: str) -> dict[str, Any]:
    """A model as ``GET /v1/models`` lists it (OpenAI's Model object)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "asyncsess"}


def model_not_found(model: str) -> FrontError:
    return FrontError(f"the model {model!r:.120} does not exist here", "model", status=404, code="model_not_found")


def no_route(request: Any, status: int, detail: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A path (404) or method (405) no OpenAI route serves, in OpenAI's error shape (``GET /v1/responses/{id}``, say);
    ``headers``: the router's (a 405's ``Allow``, the methods the path takes)."""
    field, code = ("method", "method_not_allowed") if status == 405 else ("path", "not_found")
    routes = "POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models"
    message = f"{request.method} {request.url.path[:200]}: {detail}; this server serves {routes}"
    return FrontError(message, field, status, code, headers=dict(headers or {})).response()


def check_coding(headers: Any) -> None:
    """A body sent compressed (a ``Content-Encoding`` but ``identity``), or declared as something other than JSON
    (``text/plain``, a form; none is read as JSON, as FastAPI does), is a 415 naming the header."""
    if (coding := json_body.coding(headers)) is not None:
        raise FrontError(
            f"Content-Encoding {coding!r:.60} is not accepted: send the body uncompressed", "Content-Encoding", 415, "unsupported_encoding"
        )
    if (declared := json_body.foreign_type(headers)) is not None:
        raise FrontError(
            f"Content-Type {declared!r:.80} is not JSON: send Content-Type: application/json", "Content-Type", 415, "unsupported_media_type"
        )


def parse_body(raw: bytes) -> Any:
    """A request body as JSON; not JSON, or nested past Python's recursion limit, is a 400 ``invalid_json``.

    A lone surrogate (a ``\\ud800`` escape) anywhere in it, a key or a value, is a 400 naming where: such text
    cannot be encoded as UTF-8, so it could be neither tokenized nor sent back in a capture. So is a number that is
    no JSON number (``NaN``, ``Infinity``, or ``1e400``, which decodes to one): a reply that echoes it (a Responses
    call's ``tools``) could not be written. So is a value nested more than ``MAX_DEPTH`` levels deep (a tool schema,
    say): a capture of it could not be read back."""
    try:
        body = json_body.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise FrontError(f"the body is not JSON: {err}", None, code="invalid_json") from None
    except RecursionError:
        raise FrontError("the body nests too deeply", None, code="invalid_json") from None
    _check_body(body)
    return body


MAX_DEPTH = 64  # levels of objects and arrays in a body; a capture (pydantic) serializes a couple of hundred at most


def _check_body(body: Any) -> None:
    """A FrontError naming the first key or string value of ``body`` that holds a lone surrogate, the first number
    that is not finite, or the first value nested past ``MAX_DEPTH``."""
    if isinstance(body, str) and not _encodable(body):
        raise FrontError("the body is a string with a lone surrogate; send a JSON object", None, code="invalid_json")
    todo: list[tuple[list[str], Any]] = [([], body)]
    while todo:  # iterative: the body may nest nearly to the recursion limit
        path, value = todo.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            name = str(key)
            if not _encodable(name):
                param = ".".join([*path, _printable(name)])
                raise FrontError(
                    f"the parameter name '{param}' is not valid Unicode (a lone surrogate); remove it", param, code="invalid_value"
                )
            if isinstance(item, str) and not _encodable(item):
                param = ".".join([*path, name])
                raise FrontError(
                    f"invalid value for '{param}': it holds a lone surrogate; send valid Unicode text", param, code="invalid_value"
                )
            if isinstance(item, float) and not math.isfinite(item):
                param = ".".join([*path, name])
                raise FrontError(
                    f"invalid value for '{param}': {item} is not a JSON number; send a finite number", param, code="invalid_value"
                )
            if isinstance(item, (dict, list)):
                if len(path) >= MAX_DEPTH:
                    param = ".".join([*path[:8], "..."])
                    raise FrontError(f"'{param}' nests more than {MAX_DEPTH} levels deep; flatten it", param, code="invalid_value")
                todo.append(([*path, name], item))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


MAX_TEXT_CHARS = 1_000_000  # one message, prompt or tool description; a context holds far less


def _printable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udxxx`` escapes (it can be sent as UTF-8)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"contains a lone surrogate at index {err.start}; send valid Unicode text") from None
        if "\x00" in value:
            raise ValueError(f"contains a NUL character at index {value.index(chr(0))}; remove it")
    return value


Text = Annotated[str, AfterValidator(_check_text), Field(max_length=MAX_TEXT_CHARS)]


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Function(_Req):
    # OpenAI's rule for a function name: a name the model can write back whole in a tool call
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Text = ""
    parameters: dict[str, Any] = Field(default_factory=dict)
    strict: StrictBool | None = None


class _ToolDef(_Req):
    type: Literal["function"]
    function: _Function


class _NamedFunction(_Req):
    name: str = Field(max_length=64)


class NamedToolChoice(_Req):
    """``tool_choice`` naming the one function the reply must call (chat's form)."""

    type: Literal["function"]
    function: _NamedFunction


ToolMode = Literal["auto", "none", "required"]


def tool_choice_kind(v: Any) -> str:
    """The branch of a ``tool_choice`` union: a named function (an object) or a mode (anything else); bracketed, as pydantic
    names union branches, so an error names ``tool_choice`` (and its key), not the branch."""
    return "[function]" if isinstance(v, (dict, BaseModel)) else "[mode]"


ToolChoice = Annotated[Annotated[ToolMode, Tag("[mode]")] | Annotated[NamedToolChoice, Tag("[function]")], Discriminator(tool_choice_kind)]


class _CallFunction(_Req):
    name: Text
    arguments: Text
    parsed_arguments: dict[str, Any] | None = None  # what the openai client's stream helper adds (strict tools); not read


class _ToolCall(_Req):
    id: Text
    type: Literal["function"] = "function"
    function: _CallFunction
    index: StrictInt | None = Field(default=None, ge=0)  # the stream helper keeps each call's delta index


class _TextPart(_Req):
    type: Literal["text"]
    text: Text


class Message(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[_TextPart] | None = None
    name: Text | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: Text | None = None
    # what the openai client echoes back from a reply; only empty values are accepted
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)
    parsed: None = None  # the stream helper's (and parse()'s) ParsedChatCompletionMessage

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        """OpenAI's rules: ``content`` is required, a string (``""`` too) or a non-empty array of parts, except in an
        assistant message with tool calls; ``tool_calls``, when sent, is a non-empty array."""
        if self.tool_calls == []:
            raise _refused("tool_calls", "empty_array", "an empty array; send at least one tool call, or leave tool_calls out")
        if self.content == []:
            raise _refused("content", "empty_array", 'an empty array; send at least one content part, or a string ("" too)')
        if self.content is not None or (self.role == "assistant" and self.tool_calls):
            return self
        if self.role == "assistant":
            raise _refused("content", "content_required", "an assistant message needs content, tool_calls or both")
        if "content" not in self.model_fields_set:
            raise _refused("content", "missing", "")
        raise _refused("content", "content_required", f"a {self.role} message needs a string or an array of content parts, got null")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


def _refused(field: str, kind: str, message: str) -> ValidationError:
    """A validation error of ``field`` (as pydantic raises for a field, so its param names it): ``kind`` "missing" is
    a missing required parameter, "empty_array" OpenAI's ``empty_array`` code, any other an invalid value."""
    error = kind if kind == "missing" else PydanticCustomError(kind, message)
    return ValidationError.from_exception_data("Message", [InitErrorDetails(type=error, loc=(field,), input=None)])


class _StreamOptions(_Req):
    include_usage: StrictBool = False


class OpenAIRequest(_Req):
    """The parameters every sampling route shares (chat, completions, responses)."""

    model: str
    temperature: Finite | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Finite | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    user: Annotated[Text, Field(max_length=256)] | None = None
    metadata: dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]] | None = Field(
        default=None, max_length=16
    )

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        """OpenAI's parameters are nullable: ``"n": null`` is ``n`` not sent (a null unsupported one asks for nothing)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class SamplingRequest(OpenAIRequest):
    n: StrictInt = Field(default=1, ge=1)
    stop: str | list[str] | None = Field(default=None)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream_options: _StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else v or []:
            _check_text(s)
            if s == "":
                raise ValueError("an empty stop string would stop at once; drop it")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS}")
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1, max_length=4096)
    tools: list[_ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt = Field(default=0, ge=0, le=20)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)


class CompletionRequest(SamplingRequest):
    prompt: Text | Annotated[list[StrictInt], Field(max_length=MAX_TEXT_CHARS)]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_TEXT_CHARS:  # before each id is checked: 85 M of them held the GIL for 20 s
            raise ValueError(f"{len(v)} token ids are more than any context holds; send at most {MAX_TEXT_CHARS}")
        if isinstance(v, list) and any(isinstance(p, (str, list)) for p in v):
            raise ValueError("a batch of prompts is not supported; send one prompt (text or token ids) per request")
        return v


def validation_error(err: ValidationError) -> FrontError:
    e = max(err.errors(), key=lambda x: len(x["loc"]))  # of a union's branches, the one that got furthest
    raw = [str(x) for x in e["loc"]]
    own = raw[-1:] if e["type"] == "extra_forbidden" else []  # an unknown key is the caller's name, whatever it holds
    # drop the union branch names pydantic adds (str, list[...], function-after[...])
    loc = [x for x in raw[: len(raw) - len(own)] if not any(c in x for c in "[]") and x not in ("str", "int", "list")] + own
    param = ".".join(loc) if loc else None  # an empty name ("") is named as it is
    if e["type"] == "extra_forbidden":
        return FrontError(
            f"unsupported parameter {param!r}: this server does not implement it; remove it", param, code="unsupported_parameter"
        )
    if e["type"] == "missing":
        return FrontError(f"missing required parameter {param!r}", param, code="missing_required_parameter")
    code = "empty_array" if e["type"] == "empty_array" else "invalid_value"
    return FrontError(f"invalid value for {param!r}: {e['msg']}", param, code=code)


@dataclass
class Choice:
    index: int
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish: Literal["stop", "length", "tool_calls"]
    text: str  # the whole reply as the template renders it back (stop token dropped)
    content: str | None
    tool_calls: list[dict[str, Any]]
    served: int = -1  # the leading tokens the served log-probs cover: the reply's text, not its end token (-1: all)
    schema_errors: dict[str, str] = dataclasses.field(default_factory=dict)  # tool-call id -> how it breaks its strict schema
    forced: str = ""  # the text tool_choice put before the sampled tokens (prompt-side), at the start of content or text
    tool_choice_error: str | None = None  # how the reply fails the tool call tool_choice forced

    def shown(self) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """(token, log-prob, alternatives) of the tokens the reply shows: OpenAI's log-probs cover the content, not
        the end-of-turn token or what a stop string cut off (a capture keeps every sampled token)."""
        n = len(self.tokens) if self.served < 0 else self.served
        return list(zip(self.tokens[:n], self.logprobs[:n], self.top[:n]))


def served_tokens(tok: Any, reply: list[int], content: str, skip_special_tokens: bool = True) -> int:
    """How many leading tokens of ``reply`` (end token dropped) ``content`` spans: all of them, unless a stop string
    cut the text (then up to the token that holds its last character)."""
    pieces = content_pieces(tok, reply, content, skip_special_tokens)
    if len(pieces) > len(reply):  # content ends past what the per-token deltas placed: every token is in it
        return len(reply)
    return next((k + 1 for k in range(len(pieces) - 1, -1, -1) if pieces[k]), 0)


def usage(prompt: list[int], choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


def chat_message(c: Choice) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": c.content}
    if c.tool_calls:
        msg["tool_calls"] = c.tool_calls
    return msg


def _piece(tok: Any, t: int) -> str:
    return str(tok.decode([t]))


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte in a token's string."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    return {chr(b): b for b in shown} | {chr(256 + i): b for i, b in enumerate(hidden)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def token_bytes(tok: Any, t: int) -> bytes:
    """The UTF-8 bytes token ``t`` stands for (OpenAI's ``bytes``): a character split over several tokens is whole
    once their bytes are joined. Read from the token's string for byte-level BPE and byte-fallback tokens (their
    text alone is only U+FFFD); else the token's text."""
    piece = _piece(tok, t)
    convert = getattr(tok, "convert_ids_to_tokens", None)
    name = convert(t) if convert is not None else None
    if isinstance(name, str) and (byte := _BYTE_TOKEN.fullmatch(name)):
        return bytes([int(byte.group(1), 16)])
    chars = _byte_level_chars()
    if isinstance(name, str) and name and all(c in chars for c in name):
        raw = bytes(chars[c] for c in name)
        if raw.decode("utf-8", "replace") == piece:  # the tokenizer is byte-level: the string spells its bytes
            return raw
    return piece.encode("utf-8", "replace")


class TokenText:
    """Each token's text and UTF-8 bytes, as log-prob entries show them, decoded once per token id: a reply of n × L
    tokens with 20 alternatives each decoded the same few ids millions of times (seconds on the event loop)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, t: int) -> tuple[str, list[int]]:
        got = self._seen.get(t)
        if got is None:
            got = self._seen[t] = (_piece(self.tok, t), list(token_bytes(self.tok, t)))
        return got

    def entry(self, t: int, lp: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        """Token ``t``'s log-prob entry (OpenAI's shape), with its alternatives ``top``."""
        piece, raw = self(t)
        alternatives = []
        for a, b in top:
            other, other_raw = self(a)
            alternatives.append({"token": other, "logprob": b, "bytes": other_raw})
        return {"token": piece, "logprob": lp, "bytes": raw, "top_logprobs": alternatives}


def lp_entry(tok: Any, t: int, lp: float, top: list[tuple[int, float]]) -> dict[str, Any]:
    """One log-prob entry; for a reply's many, one :class:`TokenText`'s ``entry``."""
    return TokenText(tok).entry(t, lp, top)


def reply_json(body: dict[str, Any], items: str = "choices", item: Callable[[Any], Any] = lambda v: v) -> bytes:
    """``body`` (a reply with a list under ``items``) as JSON, as ``JSONResponse`` writes it, one ``item(entry)`` of the
    list at a time: ``json.dumps`` holds the GIL until it returns, so a reply of 64 choices with top log-probs stalled
    every other call for seconds (from a worker thread too)."""

    def dumps(obj: Any) -> str:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    rest = dumps({k: v for k, v in body.items() if k != items})
    entries = ",".join(dumps(item(e)) for e in body.get(items, []))
    return (rest[:-1] + ("," if len(rest) > 2 else "") + f'"{items}":[' + entries + "]}").encode("utf-8")


def legacy_logprobs(tok: Any, c: Choice, texts: TokenText | None = None) -> dict[str, Any]:
    """A completion's log-probs in the legacy shape; ``text_offset`` is where each token's text starts in the reply
    (from the streamed deltas: a token that holds part of a character decodes alone to U+FFFD, one character)."""
    shown = c.shown()
    tokens = [t for t, _, _ in shown]
    offsets, at = [], 0
    for delta in content_pieces(tok, tokens, c.content or "")[: len(tokens)]:
        offsets.append(at)
        at += len(delta)
    texts = texts or TokenText(tok)
    top = [{texts(a)[0]: b for a, b in alts} for _, _, alts in shown] if any(alts for _, _, alts in shown) else None
    return {
        "tokens": [texts(t)[0] for t in tokens],
        "token_logprobs": [lp for _, lp, _ in shown],
        "top_logprobs": top,
        "text_offset": offsets,
    }


_STALL_TOKENS = 4  # a UTF-8 character spans at most 4 byte tokens


def content_pieces(tok: Any, tokens: list[int], content: str, skip_special_tokens: bool = True) -> list[str]:
    """Per-token text deltas whose concatenation is ``content``.

    Incremental decoding over a sliding window (vLLM's detokenizer: each step decodes only the tokens since the
    last emitted text), so the cost is linear in the reply's length; decoding ``tokens[:i + 1]`` afresh for every
    token made a long streamed reply quadratic, blocking the event loop for seconds. A delta waits while it ends in
    an incomplete character; one that does not continue ``content`` (cut at a stop string, a window that decodes
    differently) is dropped, and whatever ``content`` still lacks comes as a last piece. The window never holds
    more than a few tokens that added no text, so even a reply of undecodable bytes or skipped tokens stays linear.
    """
    pieces: list[str] = []
    done = prefix = read = 0  # characters of content emitted; the window is tokens[prefix:read] (+ the new one)
    for i in range(len(tokens)):
        before = str(tok.decode(tokens[prefix:read], skip_special_tokens=skip_special_tokens))
        now = str(tok.decode(tokens[prefix : i + 1], skip_special_tokens=skip_special_tokens))
        piece = ""
        stalled = i + 1 - read >= _STALL_TOKENS  # no new character for that long: stop waiting, keep the window short
        if len(now) > len(before) and (stalled or not now.endswith("\ufffd")):
            delta, rest = now[len(before) :], content[done:]
            if rest.startswith(delta) or delta.startswith(rest):  # (the second: content ends inside this token)
                piece = delta[: len(rest)]
            prefix, read = read, i + 1
        elif stalled:  # tokens that decode to nothing (skipped special tokens)
            prefix, read = i, i + 1
        pieces.append(piece)
        done += len(piece)
    if done < len(content):
        pieces.append(content[done:])
    return pieces


def reply_pieces(tok: Any, c: Choice) -> list[str]:
    """A chat reply's per-token content deltas after the text ``tool_choice`` forced (which streams first, alone)."""
    return content_pieces(tok, [t for t, _, _ in c.shown()], (c.content or "")[len(c.forced) :], skip_special_tokens=False)


_PACE = 32  # stream chunks between checkpoints


async def _paced(sent: int) -> int:
    """``sent + 1``, after letting the event loop run every ``_PACE`` chunks: a server's ``send`` need not suspend, so a
    stream of 64 choices × thousands of tokens ran to its end before any other call got the loop."""
    if sent % _PACE == _PACE - 1:
        await anyio.lowlevel.checkpoint()
    return sent + 1


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def chat_chunks(
    cid: str, created: int, model: str, fingerprint: str, choices: list[Choice], tok: Any, logprobs: bool, usage: dict[str, int] | None
) -> AsyncIterator[str]:
    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lps: list[dict[str, Any]] | None = None) -> str:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": {"content": lps} if logprobs and lps is not None else None,
            "finish_reason": finish,
        }
        extra = {"usage": None} if usage is not None else {}
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "system_fingerprint": fingerprint}
        return _sse({**obj, "choices": [choice], **extra})

    texts = TokenText(tok)
    sent = 0
    for c in choices:
        entries = [texts.entry(t, lp, top) for t, lp, top in c.shown()] if logprobs else []
        yield chunk(c.index, {"role": "assistant", "content": "" if c.content is not None else None})
        if c.tool_calls:  # content is None when the reply is only tool calls, as in the plain reply
            yield chunk(c.index, {"content": c.content} if c.content else {}, lps=entries)
            calls = [{"index": k, **call} for k, call in enumerate(c.tool_calls)]
            yield chunk(c.index, {"tool_calls": calls})
        else:
            if c.forced:  # the tool-call opening tool_choice forced: prompt-side, so no log-probs
                yield chunk(c.index, {"content": c.forced}, lps=[])
            pieces = reply_pieces(tok, c)
            for k, piece in enumerate(pieces):
                sent = await _paced(sent)
                yield chunk(c.index, {"content": piece}, lps=entries[k : k + 1] if k < len(entries) else [])
        yield chunk(c.index, {}, c.finish)
    if usage is not None:
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "system_fingerprint": fingerprint}
        yield _sse({**obj, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


async def completion_chunks(
    cid: str, created: int, model: str, choices: list[Choice], tok: Any, logprobs: bool, usage: dict[str, int] | None
) -> AsyncIterator[str]:
    def chunk(index: int, text: str, finish: str | None, lp: dict[str, Any] | None) -> str:
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return _sse({"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice]})

    texts = TokenText(tok)
    sent = 0
    for c in choices:
        pieces = content_pieces(tok, [t for t, _, _ in c.shown()], c.content or "")
        legacy = legacy_logprobs(tok, c, texts) if logprobs else None
        for k, piece in enumerate(pieces):
            sent = await _paced(sent)
            lp = None
            if legacy is not None and k < len(legacy["tokens"]):
                top = legacy["top_logprobs"][k : k + 1] if legacy["top_logprobs"] else None
                lp = {
                    "tokens": legacy["tokens"][k : k + 1],
                    "token_logprobs": legacy["token_logprobs"][k : k + 1],
                    "top_logprobs": top,
                    "text_offset": legacy["text_offset"][k : k + 1],
                }
            yield chunk(c.index, piece, None, lp)
        yield chunk(c.index, "", c.finish, None)
    if usage is not None:
        yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"
