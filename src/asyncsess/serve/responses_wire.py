"""OpenAI's Responses API (``POST /v1/responses``) on the front's wire: the request schema, its mapping onto a
chat request (so a Responses call renders, samples, parses tool calls and is captured by the chat path), and the
Response object and its server-sent events. Pure data: no sampler here.

Input items map onto chat messages: ``instructions`` is a system message first; a ``message`` item is a message
of its role (``developer`` as ``system``); consecutive ``function_call`` items are one assistant message's
``tool_calls`` (joined to the assistant message item just before them, if any), their ``call_id`` the tool-call
id; a ``function_call_output`` item is the ``tool`` message answering its ``call_id``. Nothing is stored.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, StrictBool, StrictInt, Tag, ValidationError, field_validator, model_validator

from ..types import MAX_TOKENS
from .openai_wire import (
    ChatRequest,
    Choice,
    FrontError,
    OpenAIRequest,
    Text,
    ToolMode,
    _refused,
    _Req,
    reply_pieces,
    tool_choice_kind,
    validation_error,
)

__all__ = ["ResponsesRequest", "Origins", "chat_request", "responses_error", "response_object", "response_events"]

_ITEM_TYPES = ("message", "function_call", "function_call_output")


class _Nullable(_Req):
    """A part of an input item: a key sent as null is a key not sent, as for the request's own parameters (what the
    openai client gives back from a reply, ``model_dump()`` or the stream helper's ``parsed``, holds many)."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _Part(_Nullable):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = Field(default=None, max_length=0)  # what a reply's output_text carries back
    logprobs: list[Any] | None = Field(default=None, max_length=0)


class _MessageItem(_Nullable):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[_Part]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @model_validator(mode="after")
    def _has_parts(self) -> _MessageItem:
        """``content`` is a string (``""`` too) or a non-empty array of parts, as in a chat message."""
        if self.content == []:
            raise _refused("content", "empty_array", 'an empty array; send at least one content part, or a string ("" too)')
        return self

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _FunctionCallItem(_Nullable):
    type: Literal["function_call"]
    call_id: Annotated[Text, Field(min_length=1)]
    name: Text
    arguments: Text
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class _OutputPart(_Nullable):
    type: Literal["input_text"]
    text: Text


class _FunctionCallOutputItem(_Nullable):
    type: Literal["function_call_output"]
    call_id: Annotated[Text, Field(min_length=1)]
    output: Text | list[_OutputPart]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_type(v: Any) -> str | None:
    """The tag of an input item: bracketed, as pydantic names union branches (so an error's location skips it)."""
    return f"[{v.get('type', 'message')}]" if isinstance(v, dict) else None


_Item = Annotated[
    Annotated[_MessageItem, Tag("[message]")]
    | Annotated[_FunctionCallItem, Tag("[function_call]")]
    | Annotated[_FunctionCallOutputItem, Tag("[function_call_output]")],
    Discriminator(_item_type),
]


class _FunctionTool(_Nullable):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")  # as the chat route's
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class _NamedToolChoice(_Req):
    """``tool_choice`` naming the one function the reply must call (the Responses API's form)."""

    type: Literal["function"]
    name: str = Field(max_length=64)


_ToolChoice = Annotated[
    Annotated[ToolMode, Tag("[mode]")] | Annotated[_NamedToolChoice, Tag("[function]")], Discriminator(tool_choice_kind)
]


class _StreamOptions(_Req):
    include_obfuscation: StrictBool = True

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, v: bool) -> bool:
        if v:
            raise ValueError("this server adds no obfuscation padding to stream events; set include_obfuscation false")
        return v


def _refuse_kinds(v: Any, field: str, kinds: tuple[str, ...], default: str | None, fix: str) -> Any:
    """A FrontError naming ``field.<i>.type`` for the first item of ``v`` whose type is not one of ``kinds``."""
    for i, item in enumerate(v if isinstance(v, list) else []):
        kind = item.get("type", default) if isinstance(item, dict) else None
        if isinstance(item, dict) and kind not in kinds:
            shown = json.dumps(kind)[:80]
            raise FrontError(f"{field} item type {shown} is not supported here: {fix}", f"{field}.{i}.type", code="invalid_value")
    return v


class _TextFormat(_Nullable):
    type: Literal["text"]

    @model_validator(mode="before")
    @classmethod
    def _plain_text(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind is not None and kind != "text":
            fix = "structured output is not constrained here; ask for JSON in the instructions and parse output_text"
            raise FrontError(f"text format {json.dumps(kind)[:80]} is not supported: {fix}", "text.format.type", code="invalid_value")
        return data


class _TextConfig(_Nullable):
    """``text``: plain text only, the default the Agents SDK and the openai client send (``{"format": {"type": "text"}}``)."""

    format: _TextFormat | None = None


class _Reasoning(_Nullable):
    """``reasoning``: no settings (what ``Reasoning()`` dumps to); the policy's reasoning is its own text."""


def _no_includes(v: Any) -> Any:
    if isinstance(v, list) and v:
        shown = json.dumps(v[0])[:80]
        fix = "this server returns no reasoning, encrypted content, logprobs or tool results beyond the output items; send []"
        raise FrontError(f"include {shown} is not supported: {fix}", "include.0", code="invalid_value")
    return v


class ResponsesRequest(OpenAIRequest):
    input: Text | Annotated[list[_Item], Field(min_length=1, max_length=4096)]
    instructions: Text | None = None
    tools: list[_FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: _ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)
    store: StrictBool | None = None  # accepted; nothing is stored either way
    previous_response_id: Any = None  # refused (by _stateless), with the fix
    conversation: Any = None
    stream_options: _StreamOptions | None = None
    # what the Agents SDK sends by default, accepted in that form only (any other is a 400 naming it)
    include: Annotated[list[Any], BeforeValidator(_no_includes)] | None = None
    text: _TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: _Reasoning | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_kinds(cls, v: Any) -> Any:
        return _refuse_kinds(v, "input", _ITEM_TYPES, "message", "send message, function_call and function_call_output items")

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_kinds(cls, v: Any) -> Any:
        fix = "only function tools run here (the agent runs them); declare it as a {'type': 'function', ...} tool"
        return _refuse_kinds(v, "tools", ("function",), None, fix)

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _stateless(cls, v: Any) -> Any:
        raise ValueError("this server stores no responses; send the whole conversation in 'input' (the earlier output items too)")


@dataclass
class Origins:
    """Where each chat message came from in the Responses request: its item (``input.3``), its text's field
    (``input.3.content``, ``instructions``) and each of its tool calls' item; to name fields in the chat path's errors."""

    items: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    calls: list[list[str]] = field(default_factory=list)

    def param(self, chat_param: str | None) -> str | None:
        """``chat_param`` (``messages.2.tool_calls.0.id``, say) as the Responses request's field."""
        p = chat_param or ""
        if m := re.fullmatch(r"messages\.(\d+)(?:\.tool_calls\.(\d+))?(?:\.(.+))?", p):
            at, call, rest = int(m.group(1)), m.group(2), m.group(3) or ""
            if at >= len(self.items):
                return "input"
            if call is not None and int(call) < len(self.calls[at]):
                return f"{self.calls[at][int(call)]}.{_CALL_FIELDS.get(rest, 'call_id')}"
            if rest == "content":
                return self.texts[at]
            return f"{self.items[at]}.call_id" if rest == "tool_call_id" else self.items[at]
        if p.startswith("messages"):
            return "input"
        if m := re.fullmatch(r"tools\.(\d+)\.function(\..+)?", p):
            return f"tools.{m.group(1)}{m.group(2) or ''}"
        return "max_output_tokens" if p in ("max_completion_tokens", "max_tokens") else chat_param


_CALL_FIELDS = {"id": "call_id", "function.arguments": "arguments", "function.name": "name"}
_WORDS = [
    ("the tool calls of an assistant message must have distinct ids", "the function_call items of a turn must have distinct call_ids"),
    ("tool_call_id", "call_id"),
    ("tool messages", "function_call_output items"),
    ("tool message", "function_call_output item"),
    ("an assistant message with tool_calls", "function_call items"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
]


def responses_error(err: FrontError, origins: Origins) -> FrontError:
    """A FrontError of the chat path in the Responses request's terms (its ``param`` and wording)."""
    message = err.message
    for chat_word, word in _WORDS:
        message = message.replace(chat_word, word)
    return FrontError(message, origins.param(err.param), err.status, err.code, err.headers)


def chat_request(req: ResponsesRequest) -> tuple[ChatRequest, Origins]:
    """``req`` as a chat request, and where each of its messages came from."""
    messages: list[dict[str, Any]] = []
    origins = Origins()

    def add(message: dict[str, Any], item: str, text: str) -> None:
        messages.append(message)
        origins.items.append(item)
        origins.texts.append(text)
        origins.calls.append([])

    if req.instructions is not None:
        add({"role": "system", "content": req.instructions}, "instructions", "instructions")
    items: list[Any] = [_MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        at = "input" if isinstance(req.input, str) else f"input.{i}"
        if isinstance(item, _MessageItem):
            add(
                {"role": "system" if item.role == "developer" else item.role, "content": item.text()},
                at,
                at if at == "input" else f"{at}.content",
            )
        elif isinstance(item, _FunctionCallItem):
            if not messages or messages[-1]["role"] != "assistant":
                add({"role": "assistant", "content": None}, at, at)
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            messages[-1].setdefault("tool_calls", []).append(call)
            origins.calls[-1].append(at)
        else:
            add({"role": "tool", "tool_call_id": item.call_id, "content": item.text()}, at, f"{at}.output")
    tools = [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.parameters or {}, "strict": t.strict},
        }
        for t in req.tools or []
    ]
    chat = {
        "model": req.model,
        "messages": messages,
        "tools": tools or None,
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "user": req.user,
        "metadata": req.metadata,
    }
    try:
        return ChatRequest.model_validate(chat), origins
    except ValidationError as err:
        raise responses_error(validation_error(err), origins) from None


def _chat_tool_choice(choice: str | _NamedToolChoice | None) -> Any:
    """``tool_choice`` in the chat request's form (a named function nests its name under ``function``)."""
    return {"type": "function", "function": {"name": choice.name}} if isinstance(choice, _NamedToolChoice) else choice


def _output_items(c: Choice) -> list[dict[str, Any]]:
    status = "incomplete" if c.finish == "length" else "completed"
    items: list[dict[str, Any]] = []
    if c.content or not c.tool_calls:
        part = {"type": "output_text", "text": c.content or "", "annotations": [], "logprobs": []}
        items.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": status, "role": "assistant", "content": [part]})
    for call in c.tool_calls:
        fn = call["function"]
        items.append(
            {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "status": "completed",
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
            }
        )
    return items


def response_object(rid: str, created: int, req: ResponsesRequest, c: Choice, usage: dict[str, int]) -> dict[str, Any]:
    """The Response object of a served call (``status`` ``incomplete`` when the reply ran out of tokens)."""
    incomplete = c.finish == "length"
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": _output_items(c),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None,
        "store": False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, _NamedToolChoice) else req.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": req.metadata or {},
        "user": req.user,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


async def response_events(response: dict[str, Any], c: Choice, tok: Any) -> AsyncIterator[str]:
    """The documented event stream of ``response``: created, in_progress, per output item added / deltas / done,
    then completed (``response.incomplete`` when it ran out of tokens). One text delta per token, as chat streams."""
    seq = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

    started = {**response, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
            text = item["content"][0]["text"]
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", **ids, content_index=0, part=empty)
            pieces = [text] if c.tool_calls else [c.forced] * bool(c.forced) + reply_pieces(tok, c)
            for piece in pieces:
                yield event("response.output_text.delta", **ids, content_index=0, delta=piece, logprobs=[])
            yield event("response.output_text.done", **ids, content_index=0, text=text, logprobs=[])
            yield event("response.content_part.done", **ids, content_index=0, part=item["content"][0])
        else:
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed" if response["status"] == "completed" else "response.incomplete", response=response)
