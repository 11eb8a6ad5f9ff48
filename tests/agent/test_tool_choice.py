"""``tool_choice`` "required" and a named function (chat and Responses) on mock://, through the official openai client.

The front forces the reply to open a Hermes tool call by putting the opening (``<tool_call>{"name": "`` or
``<tool_call>{"name": "calc", "arguments":``) after the generation prompt: those tokens are the prompt's (captured
there, never trained, no log-probs), and the reply continues them. Both were 400s before."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from asyncsess import ServiceClient
from asyncsess.chat import ChatRenderer, Tool, forced_tool_call
from asyncsess.rl.capture import build_trajectory
from asyncsess.serve.openai_front import OpenAIFront

from .helpers import CALC, ScriptedSampler

pytestmark = pytest.mark.anyio
TASK = [{"role": "user", "content": "What is 2+3? Use the calculator."}]
ECHO = {"type": "function", "function": {"name": "echo", "description": "Say it.", "parameters": {"type": "object"}}}
TOOLS = [CALC, ECHO]
NAMED = {"type": "function", "function": {"name": "calc"}}
REST_OF_CALL = 'calc", "arguments": {"expr": "2+3"}}</tool_call>'  # what the model writes after the forced opening
REST_OF_ARGS = ' {"expr": "2+3"}}</tool_call>'


@pytest.fixture
async def real():
    async with ServiceClient("mock://?max_context=2048") as svc:
        yield await svc.create_sampling_client(base_model="mock/bigram-tiny")


def _tools() -> list[Tool]:
    return [Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"], None) for t in TOOLS]  # type: ignore[arg-type]


@pytest.mark.parametrize(("choice", "reply", "forced"), [("required", REST_OF_CALL, None), (NAMED, REST_OF_ARGS, "calc")])
async def test_a_forced_call_is_a_tool_call_whose_opening_is_prompt_side_and_the_next_turn_extends_it(real, choice, reply, forced):
    front = OpenAIFront(ScriptedSampler(real, [reply, "It is 5."]))
    tok = real.get_tokenizer()
    async with front.openai_client("r") as client:
        first = await client.chat.completions.create(model="policy", messages=TASK, tools=TOOLS, tool_choice=choice, logprobs=True)
        [call] = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
        assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expr": "2+3"}
        answer = {"role": "tool", "tool_call_id": call.id, "content": "5"}
        second = await client.chat.completions.create(model="policy", messages=[*TASK, first.choices[0].message, answer], tools=TOOLS)
    assert second.choices[0].message.content == "It is 5."
    a, b = front.captures.calls("r")
    opening = tok.encode(forced_tool_call(forced), add_special_tokens=False)
    assert a.prompt_tokens == ChatRenderer(tok).tokens(TASK, _tools()) + opening  # the opening ends the prompt
    assert a.choices[0].tokens == [*tok.encode(reply, add_special_tokens=False), tok.convert_tokens_to_ids("<|end|>")]
    assert len(first.choices[0].logprobs.content) == len(a.choices[0].tokens) - 1  # the sampled text's only
    assert a.choices[0].tool_choice_error is None and a.request["tool_choice"] == choice
    traj = build_trajectory("r", [a, b], 1.0)
    assert traj.drift == []  # the reply sent back renders to the opening and the sampled tokens
    [segment] = traj.segments()
    trained = [t for t, m in zip(segment["tokens"], segment["mask"]) if m]
    assert trained == a.choices[0].tokens + b.choices[0].tokens  # never the forced opening


async def test_a_forced_call_streams_as_it_replies_with_n_choices(real):
    front = OpenAIFront(ScriptedSampler(real, [REST_OF_ARGS, REST_OF_ARGS]))
    kwargs = dict(model="policy", messages=TASK, tools=TOOLS, tool_choice=NAMED, n=2, logprobs=True)
    async with front.openai_client("p") as client:
        plain = await client.chat.completions.create(**kwargs)
    async with front.openai_client("s") as client:
        chunks = [c async for c in await client.chat.completions.create(**kwargs, stream=True)]
    assert [c.finish_reason for c in plain.choices] == ["tool_calls", "tool_calls"]
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        [delta] = [d for c in mine for d in c.delta.tool_calls or []]
        assert (delta.function.name, delta.function.arguments) == ("calc", choice.message.tool_calls[0].function.arguments)
        assert [c.finish_reason for c in mine if c.finish_reason] == ["tool_calls"]
    [p], [s] = front.captures.calls("p"), front.captures.calls("s")
    assert p.prompt_tokens == s.prompt_tokens and [c.tokens for c in p.choices] == [c.tokens for c in s.choices]


async def test_a_reply_that_is_no_call_comes_back_as_written_and_is_flagged_in_the_capture(real):
    """No grammar constrains sampling (the policy's own distribution is what is trained): a continuation that is no
    call to an allowed tool is returned as the model wrote it, opening included, and flagged for the reward."""
    front = OpenAIFront(
        ScriptedSampler(real, ["oops", "oops", ' {}}</tool_call>\n<tool_call>{"name": "echo", "arguments": {}}</tool_call>'])
    )
    opening = forced_tool_call()
    async with front.openai_client("r") as client:
        plain = await client.chat.completions.create(model="policy", messages=TASK, tools=TOOLS, tool_choice="required", logprobs=True)
        stream = await client.chat.completions.create(model="policy", messages=TASK, tools=TOOLS, tool_choice="required", stream=True)
        chunks = [c async for c in stream]
        other = await client.chat.completions.create(model="policy", messages=TASK, tools=TOOLS, tool_choice=NAMED)
    assert plain.choices[0].message.content == opening + "oops" and plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.tool_calls is None
    assert [e.token for e in plain.choices[0].logprobs.content] == list("oops")  # the sampled tokens only
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == opening + "oops"
    assert [c.function.name for c in other.choices[0].message.tool_calls] == ["calc", "echo"]  # returned as written
    plain_call, streamed, named = front.captures.calls("r")
    assert plain_call.choices[0].text == opening + "oops"
    assert "not a tool call" in plain_call.choices[0].tool_choice_error == streamed.choices[0].tool_choice_error
    assert "'echo'" in named.choices[0].tool_choice_error


async def test_the_responses_api_forces_a_call_named_in_its_own_form(real):
    tool = {"type": "function", "strict": False, **CALC["function"]}
    front = OpenAIFront(ScriptedSampler(real, [REST_OF_ARGS, REST_OF_CALL]))
    async with front.openai_client("r") as client:
        named = await client.responses.create(model="policy", input=TASK, tools=[tool], tool_choice={"type": "function", "name": "calc"})
        required = await client.responses.create(model="policy", input=TASK, tools=[tool], tool_choice="required")
    for response in (named, required):
        [item] = response.output
        assert item.type == "function_call" and item.name == "calc" and json.loads(item.arguments) == {"expr": "2+3"}
    assert named.tool_choice.name == "calc" and required.tool_choice == "required"
    a, b = front.captures.calls("r")
    opening = real.get_tokenizer().encode(forced_tool_call("calc"), add_special_tokens=False)
    assert a.prompt_tokens[-len(opening) :] == opening
    assert a.choices[0].finish_reason == b.choices[0].finish_reason == "tool_calls"


async def test_sampled_forced_calls_are_captured_with_the_samplers_log_probs(real):
    """The real sampler continues the opening (the bigram model writes no call: each reply is flagged): the opening is
    in the sampled prompt, and the captured log-probs are the sampler's for the tokens after it."""
    front = OpenAIFront(real)
    async with front.openai_client("r") as client:
        reply = await client.chat.completions.create(
            model="policy", messages=TASK, tools=TOOLS, tool_choice="required", n=3, seed=4, max_tokens=12, logprobs=True, top_logprobs=2
        )
    [call] = front.captures.calls("r")
    opening = real.get_tokenizer().encode(forced_tool_call(), add_special_tokens=False)
    assert call.prompt_tokens[-len(opening) :] == opening
    for choice, served in zip(call.choices, reply.choices):
        scored = await real.compute_logprobs(call.prompt_tokens + choice.tokens)
        assert choice.logprobs == scored[len(call.prompt_tokens) :]
        assert served.message.content.startswith(forced_tool_call()) and choice.tool_choice_error is not None


BAD = [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": NAMED}, "needs tools"),
    ({"tools": [ECHO], "tool_choice": NAMED}, "not in tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "c" * 65}}}, "at most 64"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "calc"}}, "missing"),  # the Responses form, on chat
    ({"tools": TOOLS, "tool_choice": "any"}, "'required'"),
]


@pytest.mark.parametrize(("change", "says"), BAD, ids=[str(i) for i in range(len(BAD))])
async def test_a_tool_choice_no_tool_answers_is_a_400_naming_it_before_a_call_index(real, change, says):
    front = OpenAIFront(real)
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        r = await http.post("/v1/chat/completions", json={"model": "policy", "messages": TASK, **change})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tool_choice") and says in r.json()["error"]["message"], r.text
    assert front.captures.rollout_ids() == []
    async with front.openai_client() as client:
        with pytest.raises(openai.BadRequestError):  # the official client's form of it
            await client.chat.completions.create(model="policy", messages=TASK, tool_choice="required")


async def test_a_template_that_refuses_a_trailing_assistant_turn_gets_the_opening_tokenized_alone(real):
    """The opening is tokenized as the template renders the assistant turn in context; a template that raises on a
    conversation ending with the assistant (it renders only prompts) made the call a 400 naming ``messages``."""
    tok = real.get_tokenizer()
    renderer = ChatRenderer(tok)
    render = renderer._render

    def prompts_only(messages, tools, add_generation_prompt):
        if messages[-1]["role"] == "assistant":
            raise ValueError("this template renders prompts only")
        return render(messages, tools, add_generation_prompt)

    renderer._render = prompts_only  # type: ignore[method-assign]
    opening = tok.encode(forced_tool_call("calc"), add_special_tokens=False)
    assert renderer.tokens(TASK, _tools(), prefill=forced_tool_call("calc")) == renderer.tokens(TASK, _tools()) + opening
