"""``strict`` function tools (the Agents SDK's default) on chat and Responses: accepted, sampled unconstrained, and
each call's arguments checked against its tool's schema after sampling; a call that breaks it is still returned
(it is the policy's output) and flagged in the capture (``CapturedChoice.schema_errors``) for a reward to see."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncsess import ServiceClient
from asyncsess.serve import tool_schema
from asyncsess.serve.openai_front import OpenAIFront
from asyncsess.serve.tool_schema import schema_error

from .helpers import CALC, ScriptedSampler

pytestmark = pytest.mark.anyio
STRICT = {**CALC["function"], "parameters": {**CALC["function"]["parameters"], "additionalProperties": False}, "strict": True}
GOOD = '<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>'
NUMBER = '<tool_call>{"name": "calc", "arguments": {"expr": 5}}</tool_call>'
EXTRA = '<tool_call>{"name": "calc", "arguments": {"expr": "1", "x": 1}}</tool_call>'


@pytest.fixture
async def real():
    async with ServiceClient("mock://?max_context=2048") as svc:
        yield await svc.create_sampling_client(base_model="mock/bigram-tiny")


async def _call(front: OpenAIFront, route: str, strict: bool) -> tuple[str, dict]:
    """One call with the calc tool (strict or not) through the official client: the returned call's id and arguments."""
    tool = {**STRICT, "strict": strict}
    async with front.openai_client("r") as client:
        if route == "chat":
            reply = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "2+3?"}], tools=[{"type": "function", "function": tool}]
            )
            call = reply.choices[0].message.tool_calls[0]
            return call.id, {"name": call.function.name, "arguments": call.function.arguments}
        r = await client.responses.create(model="policy", input="2+3?", tools=[{"type": "function", **tool}])
        [fc] = [o for o in r.output if o.type == "function_call"]
        return fc.call_id, {"name": fc.name, "arguments": fc.arguments}


CASES = [
    (GOOD, True, None),
    (NUMBER, True, "arguments.expr: expected string, got integer"),
    (EXTRA, True, "arguments: unexpected property 'x'"),
    (NUMBER, False, None),  # a tool that is not strict promises nothing: not checked
]


@pytest.mark.parametrize("route", ["chat", "responses"])
@pytest.mark.parametrize(("reply", "strict", "error"), CASES, ids=["valid", "wrong-type", "extra-key", "not-strict"])
async def test_a_strict_tools_call_is_returned_as_sampled_and_flagged_in_the_capture_when_it_breaks_the_schema(
    real, route, reply, strict, error
):
    front = OpenAIFront(ScriptedSampler(real, [reply]))
    call_id, returned = await _call(front, route, strict)
    assert returned["name"] == "calc" and returned["arguments"] == reply.split('"arguments": ')[1].removesuffix("}</tool_call>")
    [captured] = front.captures.calls("r")
    assert captured.choices[0].finish_reason == "tool_calls"
    assert captured.choices[0].schema_errors == ({call_id: error} if error else {})
    assert captured.model_dump(mode="json")["choices"][0]["schema_errors"] == captured.choices[0].schema_errors


DEFAULTS = [  # the forms the Agents SDK and the openai client send by default
    {"include": []},
    {"text": {"format": {"type": "text"}}},
    {"text": {"format": {"type": "text"}, "verbosity": None}},
    {"truncation": "disabled"},
    {"reasoning": {"effort": None, "summary": None}},
    {"tools": [{"type": "function", **STRICT}]},
]


@pytest.mark.parametrize("change", DEFAULTS, ids=[next(iter(c)) + str(i) for i, c in enumerate(DEFAULTS)])
async def test_the_default_forms_of_include_text_truncation_reasoning_are_accepted(real, change):
    front = OpenAIFront(real)
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        r = await http.post("/v1/responses", json={"model": "policy", "input": "hi", "max_output_tokens": 4, **change})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response" and len(front.captures.calls("default")) == 1


SCHEMA_CASES = [  # (schema, value, error)
    ({"type": "object", "properties": {"n": {"type": "integer"}}}, {"n": 2.0}, None),  # JSON: 2.0 is an integer
    ({"type": "object", "properties": {"n": {"type": "integer"}}}, {"n": True}, "arguments.n: expected integer, got boolean"),
    ({"type": "object", "properties": {"n": {"type": "number", "minimum": 0}}}, {"n": -1}, "arguments.n: -1 breaks minimum 0"),
    ({"type": "object", "required": ["a"]}, {}, "arguments: missing required property 'a'"),
    ({"properties": {"u": {"enum": ["c", "f"]}}}, {"u": "k"}, "arguments.u: 'k' is not one of ['c', 'f']"),
    ({"properties": {"v": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}, {"v": None}, None),
    ({"properties": {"v": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}, {"v": 1}, "arguments.v: matches 0 of the anyOf schemas"),
    (
        {
            "$defs": {"P": {"type": "object", "properties": {"x": {"type": "string"}}}},
            "properties": {"ps": {"items": {"$ref": "#/$defs/P"}}},
        },
        {"ps": [{"x": "a"}, {"x": 1}]},
        "arguments.ps.1.x: expected string, got integer",
    ),
    ({"$defs": {"L": {"$ref": "#/$defs/L"}}, "$ref": "#/$defs/L"}, {"a": 1}, None),  # a cycle that consumes nothing ends
    (
        {"properties": {"s": {"type": "string", "maxLength": 3}}},
        {"s": "abcd"},
        "arguments.s: 4 characters, at most 3",
    ),
]


@pytest.mark.parametrize(("schema", "value", "error"), SCHEMA_CASES)
def test_schema_error_names_the_first_violation(schema, value, error):
    assert schema_error(schema, value) == error


HOSTILE = [  # a client's schema, checked on the event loop every tenant shares: bounded work, or not checked
    ({"properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}}, {"s": "a" * 40 + "b"}),  # backtracks for hours
    ({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"}, {"x": 1}),  # 2**256 paths
]


@pytest.mark.parametrize(("schema", "value"), HOSTILE, ids=["regex-backtracking", "anyOf-ref-cycle"])
def test_a_hostile_schema_costs_bounded_work_and_is_left_unchecked(schema, value):
    assert schema_error(schema, value) is None


def test_a_long_enum_costs_its_length_in_steps(monkeypatch):
    """Each check scanned a keyword's whole list (``enum``, ``required``, ``type``) for one step: an 18 kB schema, a
    2,000-value enum behind ``anyOf`` of ``$ref``s, took 100,000 steps of 2,000 comparisons, 90 s on the event loop
    every tenant shares. A list now spends its length: the check stops within the budget, unchecked."""
    compared = 0
    same = tool_schema._same

    def counting(a, b):
        nonlocal compared
        compared += 1
        return same(a, b)

    monkeypatch.setattr(tool_schema, "_same", counting)
    schema = {"$defs": {"e": {"enum": [str(i) for i in range(2000)]}}, "properties": {"x": {"anyOf": [{"$ref": "#/$defs/e"}] * 100}}}
    assert schema_error(schema, {"x": "nope"}) is None and compared <= tool_schema.MAX_STEPS
    assert (
        schema_error({"properties": {"x": {"enum": list(range(100))}}}, {"x": 500})
        == "arguments.x: 500 is not one of [0, 1, 2, 3, 4, 5, 6, 7, ...]"
    )


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)
_KEYWORDS = ["type", "enum", "const", "properties", "required", "additionalProperties", "items", "anyOf", "oneOf", "allOf", "$ref"]
_KEYWORDS += ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "minItems", "maxItems"]
_SCHEMA = st.recursive(
    st.dictionaries(st.sampled_from(_KEYWORDS), _JSON, max_size=3),
    lambda inner: st.dictionaries(st.sampled_from(_KEYWORDS), inner | st.lists(inner, max_size=2) | _JSON, max_size=4),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(_SCHEMA, st.dictionaries(st.text(max_size=4), _JSON, max_size=3))
def test_any_schema_of_a_client_gives_an_answer_never_an_exception(schema, value):
    """The check runs while a call is served: a schema with keywords of any type (``"allOf": 5``) was a 500."""
    assert schema_error(schema, value) is None or isinstance(schema_error(schema, value), str)


async def test_a_strict_call_from_the_chat_stream_helper_goes_back_as_the_client_gives_it(real):
    """The stream helper parses a strict tool's arguments into ``parsed_arguments``; the message sent back with it was
    a 400 (only null was taken)."""
    front = OpenAIFront(ScriptedSampler(real, [GOOD, "It is 5."]))
    tools = [{"type": "function", "function": STRICT}]
    messages: list = [{"role": "user", "content": "2+3?"}]
    async with front.openai_client("r") as client:
        async with client.chat.completions.stream(model="policy", messages=messages, tools=tools) as stream:
            final = await stream.get_final_completion()
        message = final.choices[0].message
        assert message.tool_calls[0].function.parsed_arguments == {"expr": "2+3"}
        messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
    assert reply.choices[0].message.content == "It is 5."
