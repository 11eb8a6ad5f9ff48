"""Hostile model output through the OpenAI front (the official openai client) and into the example calculator tool:
a reply the front cannot turn into valid tool calls is served as text, and the calculator answers every
expression with a short string."""

from __future__ import annotations

import json

import pytest

from asyncsess import ServiceClient
from asyncsess.serve.openai_front import OpenAIFront
from examples.calculator_agent import MAX_EXPR, calc

from .helpers import CALC, ScriptedSampler

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "2+3?"}]


@pytest.fixture
async def real():
    async with ServiceClient("mock://?max_context=16384") as svc:
        yield await svc.create_sampling_client(base_model="mock/bigram-tiny")


@pytest.mark.parametrize(
    "reply",
    [
        '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',  # was a UnicodeEncodeError out of the front
        '<tool_call>{"name": "calc", "arguments": {"expr": 1e999}}</tool_call>',  # was served as {"expr": Infinity}
        '<tool_call>{"name": "calc", "arguments": {"expr": ' + "9" * 5000 + "}}</tool_call>",
    ],
)
async def test_a_reply_whose_calls_are_not_valid_json_tools_is_served_as_text(real, reply):
    front = OpenAIFront(ScriptedSampler(real, [reply, reply]))
    async with front.openai_client("r") as client:
        plain = await client.chat.completions.create(model="policy", messages=HI, tools=[CALC])
        stream = await client.chat.completions.create(model="policy", messages=HI, tools=[CALC], stream=True)
        chunks = [c async for c in stream]
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == reply
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


async def test_served_arguments_are_json_any_reader_takes(real):
    reply = '<tool_call>{"name": "calc", "arguments": {"expr": "\\ud800", "x": 1e308}}</tool_call>'
    front = OpenAIFront(ScriptedSampler(real, [reply]))
    async with front.openai_client("r") as client:
        out = await client.chat.completions.create(model="policy", messages=HI, tools=[CALC])
    [call] = out.choices[0].message.tool_calls
    assert call.function.arguments.isascii()
    assert json.loads(call.function.arguments, parse_constant=lambda c: pytest.fail(c)) == {"expr": "\ud800", "x": 1e308}


@pytest.mark.parametrize(
    ("expr", "result"),
    [
        ("9**9**9", "error: only numbers and + - * /"),  # an exponent bomb is not an operation it has
        ("().__class__", "error: only numbers and + - * /"),
        ("__import__('os').system('true')", "error: only numbers and + - * /"),
        ("True + True", "error: only numbers and + - * /"),
        ("1/0", "error: division by zero"),
        ("*".join(["99999999999"] * 20), "error: a number beyond 1e+100"),  # was an OverflowError out of calc
        ("(" + "*".join(["99999999999"] * 20) + ")/3", "error: a number beyond 1e+100"),  # OverflowError too
        ("1e308*10", "error: a number beyond 1e+100"),  # was "inf"
        ("1e308*10 - 1e308*10", "error: a number beyond 1e+100"),  # was "nan"
        ("-" * 100_000 + "1", f"error: the expression is longer than {MAX_EXPR} characters"),  # was a MemoryError
        ("1+" * 5_000_000 + "1", f"error: the expression is longer than {MAX_EXPR} characters"),
        ("9" * 5000, f"error: the expression is longer than {MAX_EXPR} characters"),
        ("99*99", "9801"),
        ("7/2", "3.5"),
        ("-0.0", "0"),
    ],
)
def test_the_calculator_answers_every_expression_with_a_short_string(expr, result):
    assert calc(expr) == result


@pytest.mark.parametrize("expr", ["(" * 400 + "1" + ")" * 400, "-" * 999 + "1", "1+\ud800", "1\x00+2", "1 +"])
def test_the_calculator_refuses_deep_or_broken_expressions(expr):
    assert calc(expr).startswith("error: ")
