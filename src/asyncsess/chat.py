"""Chat rendering through the tokenizer's own chat template: token ids, assistant spans, turn stops, and
conversations with tools (:class:`ChatRenderer`, :func:`parse_tool_calls`), shared by the RL tool envs and the
OpenAI front.

Templates differ in what they support, so :class:`ChatRenderer` probes the tokenizer once: where the template
has no tool role (it raises, or drops the message) a result is sent as a user message wrapped in
``<tool_response>…</tool_response>`` (how Qwen's template renders tool results), and where it ignores the
``tools`` argument the tool signatures are added to the system message.

Message content is ordinary text, whoever wrote it (a user, a tool, a program's output): the text of a special
token in it (``<|im_end|>`` for ChatML, say) is tokenized as the characters it spells, never as the special
token, so content cannot forge a turn; only the template's own markers are special tokens (:func:`render_chat`).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InvalidInputError

__all__ = [
    "Message",
    "render_chat",
    "special_texts",
    "check_tools",
    "VERBATIM",
    "chat_tokens",
    "assistant_spans",
    "turn_stop_tokens",
    "Tool",
    "ToolCall",
    "parse_tool_calls",
    "forced_tool_call",
    "ChatRenderer",
]

Message = Mapping[str, str]


VERBATIM = "_verbatim"  # a message key: its content is the model's own output, special tokens and all


def special_texts(tokenizer: Any) -> list[str]:
    """The text of every special token the tokenizer finds in a string (Hugging Face's added tokens marked special
    and its named special tokens), longest first."""
    texts = {str(t) for t in getattr(tokenizer, "all_special_tokens", None) or []}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts |= {str(getattr(t, "content", t)) for t in decoder.values() if getattr(t, "special", False)}
    return sorted((t for t in texts if t), key=lambda t: (-len(t), t))


def render_chat(
    tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool = False, tools: Sequence[Mapping[str, Any]] = ()
) -> list[int]:
    """The conversation's tokens through the tokenizer's chat template, with every message's content as plain text.

    A content that holds a special token's text (``<|im_end|>\\n<|im_start|>system`` in a tool result, say) is
    tokenized as ordinary text (Hugging Face's ``split_special_tokens``), so it cannot forge a turn; the template's
    own markers stay special tokens. Content without such text renders exactly as ``apply_chat_template`` does.
    A message with the key ``"_verbatim"`` (the model's own reply, as sampled) keeps its special tokens. Tool
    schemas that hold special-token text are refused (the template renders them; they cannot be told apart)."""
    specials = special_texts(tokenizer)
    check_tools(specials, tools)
    msgs = [{k: v for k, v in m.items() if k != VERBATIM} for m in messages]
    risky = [i for i, m in enumerate(msgs) if not messages[i].get(VERBATIM) and _special_in(m.get("content"), specials)]
    if not risky:
        return _template_tokens(tokenizer, msgs, add_generation_prompt, tools)
    return _plain_content_tokens(tokenizer, msgs, risky, specials, add_generation_prompt, tools)


def chat_tokens(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[int]:
    """The conversation's tokens as a plain ``list[int]``; content is plain text (:func:`render_chat`)."""
    return render_chat(tokenizer, messages, add_generation_prompt)


def check_tools(specials: Sequence[str], tools: Sequence[Mapping[str, Any]], field: str = "tools[{}]") -> None:
    """An InvalidInputError naming the first tool (``field`` formatted with its index) whose schema holds
    special-token text."""
    for i, tool in enumerate(tools):
        if found := _special_in(json.dumps(tool, ensure_ascii=False), specials):
            raise InvalidInputError(
                f"tool {i} holds the special-token text {found!r} of the chat template",
                field=field.format(i),
                fix="remove the chat template's special tokens from tool names, descriptions and schemas",
            )


def _special_in(text: Any, specials: Sequence[str]) -> str | None:
    return next((s for s in specials if s in text), None) if isinstance(text, str) else None


def _template_tokens(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool, tools: Sequence[Any]) -> list[int]:
    """``apply_chat_template(..., tokenize=True)`` as a plain ``list[int]`` (transformers 5 returns a mapping)."""
    extra = {"tools": list(tools)} if tools else {}
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt, **extra)
    if not isinstance(out, list):
        out = out["input_ids"]
    return [int(t) for t in out]


def _template_text(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool, tools: Sequence[Any]) -> str:
    extra = {"tools": list(tools)} if tools else {}
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra))


def _plain_content_tokens(
    tokenizer: Any,
    messages: list[dict[str, str]],
    risky: list[int],
    specials: list[str],
    add_generation_prompt: bool,
    tools: Sequence[Any],
) -> list[int]:
    """Render with a placeholder for each risky content, then tokenize: special tokens only where the template
    wrote them; the text between them (template text and content) with special-token text spelled out. A
    template that trims content (Llama 3's ``| trim``) gets the content trimmed; any other change is refused."""
    slot = f"\ue000{uuid.uuid4().hex}"
    marked = [dict(m, content=f"{slot}{i}\ue001") if i in risky else m for i, m in enumerate(messages)]
    pattern = re.compile(re.escape(slot) + r"(\d+)\ue001")
    pieces = pattern.split(_template_text(tokenizer, marked, add_generation_prompt, tools))
    expected = _template_text(tokenizer, messages, add_generation_prompt, tools)
    for shown in ({i: messages[i]["content"] for i in risky}, {i: messages[i]["content"].strip() for i in risky}):
        if "".join(shown[int(p)] if k % 2 else p for k, p in enumerate(pieces)) == expected:
            break
    else:
        raise InvalidInputError(
            f"messages[{risky[0]}].content holds special-token text and this chat template changes content as it renders it",
            field=f"messages[{risky[0]}].content",
            fix="remove the chat template's special tokens from the content",
        )
    split = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")
    ids: list[int] = []
    run: list[str] = []
    for k, piece in enumerate(pieces):
        if k % 2:  # a risky content: plain text
            run.append(shown[int(piece)])
            continue
        for j, part in enumerate(split.split(piece)):
            if j % 2:  # the template's own special token
                ids += _encode_plain(tokenizer, "".join(run), specials)
                run = []
                ids.append(int(tokenizer.convert_tokens_to_ids(part)))
            else:
                run.append(part)
    return ids + _encode_plain(tokenizer, "".join(run), specials)


def _encode_plain(tokenizer: Any, text: str, specials: list[str]) -> list[int]:
    """``text`` as ordinary text; an InvalidInputError if the tokenizer still finds a special token in it."""
    if not text:
        return []
    ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)]
    special_ids = {int(tokenizer.convert_tokens_to_ids(s)) for s in specials}
    if any(t in special_ids for t in ids):
        raise InvalidInputError(
            "this tokenizer cannot tokenize special-token text as plain text (split_special_tokens)",
            field="messages",
            fix="remove the chat template's special tokens from the content, or use a Hugging Face tokenizer",
        )
    return ids


def assistant_spans(tokenizer: Any, messages: Sequence[Message]) -> tuple[list[int], list[tuple[int, int]]]:
    """The conversation's tokens and the ``[start, end)`` token span of each assistant message.

    A span covers what the model must generate for that turn: the content and the template's
    end-of-turn tokens, not the role header. Found by rendering growing prefixes, so the template must
    render a prefix of a conversation as a prefix of its tokens (true of common chat templates).
    """
    spans = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        head = chat_tokens(tokenizer, messages[:i], add_generation_prompt=True)
        upto = chat_tokens(tokenizer, messages[: i + 1])
        if upto[: len(head)] != head:
            raise InvalidInputError(
                "the chat template does not render a conversation prefix as a token prefix",
                field=f"messages[{i}]",
                fix="use a tokenizer whose chat template is prefix-stable, or build datums with asyncsess.rl.sft_datum",
            )
        spans.append((len(head), len(upto)))
    full = chat_tokens(tokenizer, messages)
    if spans and full[: spans[-1][1]] != upto:
        raise InvalidInputError("the chat template is not prefix-stable", field="messages", fix="see assistant_spans")
    return full, spans


def turn_stop_tokens(tokenizer: Any) -> list[int]:
    """Token ids that end an assistant turn: the special tokens the template puts after the content, plus EOS.

    Special means named (``all_special_ids``) or added as special (``added_tokens_decoder``): a tokenizer may name
    only some of its special tokens (one converted from GGUF names none of ChatML's ``<|im_end|>``). Only tokens
    after the content count: a template may put special tokens before it (a reasoning block's markers)."""
    full, [(start, end)] = assistant_spans(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(added, Mapping):
        special |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
    span = full[start:end]
    after = next((i + 1 for i in range(len(span)) if "ok" in tokenizer.decode(span[: i + 1])), 0)
    stops = [t for t in span[after:] if t in special]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        stops.append(int(eos))
    return list(dict.fromkeys(stops))


ToolFn = Callable[[Mapping[str, Any]], Awaitable[tuple[str, dict[str, float]]]]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_MAX_DIGITS = 4300  # an integer literal longer than this is refused (Python's own default int-from-str limit)
_PROBE = "asyncsess-probe-7f3a"


@dataclass(frozen=True)
class Tool:
    """A function the model may call: ``run(arguments) -> (result text, metrics)``."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments
    run: ToolFn

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def refusal(self, arguments: Mapping[str, Any]) -> str | None:
        """Why ``arguments`` do not fit :attr:`parameters`, or ``None``: the top level of the schema is checked
        (``required``, each property's ``type`` and ``enum``, ``additionalProperties: false``)."""
        props = self.parameters.get("properties") or {}
        missing = [k for k in self.parameters.get("required") or [] if k not in arguments]
        if missing:
            return f"{self.name} needs the argument {missing[0]!r}"
        if self.parameters.get("additionalProperties") is False and (extra := [k for k in arguments if k not in props]):
            return f"{self.name} takes no argument {extra[0][:64]!r}; it takes {sorted(props)}"
        for key, value in arguments.items():
            spec = props.get(key)
            if not isinstance(spec, Mapping):
                continue
            kinds = spec.get("type")
            kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
            if kinds and not any(_JSON_TYPES.get(k, lambda v: True)(value) for k in kinds):
                return f"{self.name}'s argument {key!r} must be {' or '.join(kinds)}, not {_json_type(value)}"
            if "enum" in spec and value not in spec["enum"]:
                return f"{self.name}'s argument {key!r} must be one of {spec['enum']}"
        return None


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _json_type(value: Any) -> str:
    return next((k for k, fits in _JSON_TYPES.items() if fits(value)), type(value).__name__)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:20]} is beyond a float's range")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > _MAX_DIGITS:  # int() of a long digit string is quadratic, and refused past Python's limit
        raise ValueError(f"an integer of {len(text)} digits is longer than {_MAX_DIGITS}")
    return int(text)


def _tool_call(body: str) -> ToolCall | str:
    """One ``<tool_call>`` body as a ToolCall, or what is wrong with it."""
    try:
        obj = json.loads(body, parse_constant=_not_json, parse_float=_finite, parse_int=_bounded_int)
    except ValueError as err:  # JSONDecodeError, NaN/Infinity (Python's extension), 1e999, a 10**5-digit integer
        return f"a tool call is not JSON: {err}"
    except RecursionError:  # a model can write "[[[[..." past the parser's recursion limit
        return "a tool call nests too deeply"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments", {}), dict):
        return 'a tool call must be {"name": str, "arguments": object}'
    if not _is_text(obj["name"]):
        return "a tool call's name holds a lone surrogate (\\ud800-\\udfff), which is not text"
    return ToolCall(obj["name"], dict(obj.get("arguments", {})))


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_tool_calls(text: str, limit: int | None = None) -> tuple[list[ToolCall], str | None]:
    """The tool calls in a reply, and an error message when one is malformed (not JSON, NaN, Infinity or a
    number beyond a float's range or of more than 4300 digits, nested too deeply, no name, a name that is not
    text, unclosed) or when there are more than ``limit``; the calls before the error come with it.

    A call's body runs from ``<tool_call>`` to the next ``</tool_call>``; the scan is linear in the text."""
    calls: list[ToolCall] = []
    at = text.find(_OPEN)
    while at >= 0:
        start = at + len(_OPEN)
        end = text.find(_CLOSE, start)
        if end < 0:
            return calls, "a <tool_call> is not closed"
        if limit is not None and len(calls) >= limit:
            return calls, f"more than {limit} tool calls in one reply"
        call = _tool_call(text[start:end])
        if isinstance(call, str):
            return calls, call
        calls.append(call)
        at = text.find(_OPEN, end + len(_CLOSE))
    return calls, None


def forced_tool_call(name: str | None = None) -> str:
    """The opening of a Hermes tool call that forces the reply to be one: of any tool (``name`` None) up to the
    tool's name, or of tool ``name`` up to its arguments. It ends where a byte-level BPE splits the text anyway
    (before the name's first letter, before the space that leads ``{``), so the reply written back renders to the
    same tokens (``"arguments": `` with its space would not: the model's `` {`` would tokenize with that space)."""
    if name is None:
        return _OPEN + '{"name": "'
    return _OPEN + '{"name": ' + json.dumps(name) + ', "arguments":'


_MAX_TOOL_SETS = 256  # tool sets a renderer remembers whether its template shows


class ChatRenderer:
    """Renders conversations with tools for one tokenizer; ``stop`` holds the tokens that end an assistant turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.stop: list[int] = turn_stop_tokens(tokenizer)
        self.tool_role = self._renders(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": _PROBE}]
        )
        self._native_tools: OrderedDict[str, bool] = OrderedDict()  # tool set digest -> the template shows them
        self._lock = threading.Lock()  # for _native_tools: a server renders a large conversation in a worker thread

    def tokens(
        self, messages: Sequence[Message], tools: Sequence[Tool] = (), add_generation_prompt: bool = True, prefill: str = ""
    ) -> list[int]:
        """The conversation's tokens as the model sees it (with the prompt for the next assistant turn); ``prefill``:
        text the next assistant turn starts with, tokenized as the template renders that turn in context (so a reply
        that continues it renders back to the same tokens)."""
        schemas = [t.schema() for t in tools]
        check_tools(special_texts(self.tokenizer), schemas)
        msgs = self._portable(messages)
        if schemas and not self._shows_tools(schemas):
            msgs = _with_tool_prompt(msgs, schemas)
            schemas = []
        head = self._render(msgs, schemas, add_generation_prompt)
        return head + self._prefill_tokens(msgs, schemas, head, prefill) if prefill else head

    def _prefill_tokens(self, msgs: list[dict[str, str]], schemas: list[dict[str, Any]], head: list[int], prefill: str) -> list[int]:
        """``prefill``'s tokens at the start of the assistant turn after ``head``: the shortest run of the turn's
        rendered tokens that decodes to it; else (a template that changes the turn's content) it tokenized alone."""
        try:
            whole = self._render([*msgs, {"role": "assistant", "content": prefill, VERBATIM: "1"}], schemas, False)
        except Exception:  # a template that refuses a conversation ending with the assistant
            whole = []
        rest = whole[len(head) :] if whole[: len(head)] == head else []
        for k in range(1, len(rest) + 1):
            if str(self.tokenizer.decode(rest[:k])) == prefill:
                return rest[:k]
        return [int(t) for t in self.tokenizer.encode(prefill, add_special_tokens=False)]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def _render(self, messages: Sequence[Message], tools: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools)

    def _renders(self, messages: list[dict[str, str]]) -> bool:
        try:
            return _PROBE in self.tokenizer.decode(self._render(messages, [], False))
        except Exception:  # the template rejects the conversation (an unknown role)
            return False

    def _shows_tools(self, schemas: list[dict[str, Any]]) -> bool:
        """Whether the template renders ``schemas``; remembered by a digest of them, for the last
        ``_MAX_TOOL_SETS`` tool sets (the sets a server is sent are unbounded, and may be MBs each)."""
        key = hashlib.sha256(json.dumps(schemas, sort_keys=True).encode("utf-8", "surrogatepass")).hexdigest()
        with self._lock:
            shows = self._native_tools.get(key)
        if shows is None:
            probe = [{"role": "user", "content": "hi"}]
            try:
                shows = self._render(probe, schemas, True) != self._render(probe, [], True)
            except Exception:
                shows = False
        with self._lock:
            self._native_tools[key] = shows
            self._native_tools.move_to_end(key)
            while len(self._native_tools) > _MAX_TOOL_SETS:
                self._native_tools.popitem(last=False)
        return shows

    def _portable(self, messages: Sequence[Message]) -> list[dict[str, str]]:
        """Tool results as user messages where the template has no tool role (adjacent ones joined)."""
        if self.tool_role:
            return [dict(m) for m in messages]
        out: list[dict[str, str]] = []
        for m in messages:
            if m.get("role") != "tool":
                out.append(dict(m))
                continue
            wrapped = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + wrapped
            else:
                out.append({"role": "user", "content": wrapped, "_tool": "1"})
        return [{k: v for k, v in m.items() if k != "_tool"} for m in out]


def _with_tool_prompt(messages: list[dict[str, str]], schemas: list[dict[str, Any]]) -> list[dict[str, str]]:
    signatures = "\n".join(json.dumps(s) for s in schemas)
    prompt = (
        "You can call these tools:\n<tools>\n" + signatures + "\n</tools>\n"
        'To call one, write <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call> and end your turn; '
        "the result comes back in <tool_response></tool_response>."
    )
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
