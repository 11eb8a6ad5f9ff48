"""``POST /v1/responses`` on the in-process front over mock://, through the official openai client: the Responses
API maps onto the chat path (same prompt tokens, tool-call parsing and capture), streamed and plain alike."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from asyncsess import ServiceClient
from asyncsess.rl.capture import build_trajectory
from asyncsess.serve.openai_front import OpenAIFront

from .helpers import CALC, ScriptedSampler

pytestmark = pytest.mark.anyio
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>'
TASK = "What is 2+3? Use the calculator."
TOOL = {"type": "function", "strict": False, **CALC["function"]}  # the Responses API's flat function tool


@pytest.fixture
async def real():
    async with ServiceClient("mock://?max_context=2048") as svc:
        yield await svc.create_sampling_client(base_model="mock/bigram-tiny")


async def responses_agent(client) -> str:
    """A plain Responses-API function-calling loop: the reply's output items go back in ``input``."""
    items: list = [{"role": "user", "content": TASK}]
    for _ in range(3):
        reply = await client.responses.create(model="policy", input=items, tools=[TOOL], instructions="Be brief.")
        items += reply.output
        calls = [o for o in reply.output if o.type == "function_call"]
        if not calls:
            return reply.output_text
        for call in calls:
            result = str(eval(json.loads(call.arguments)["expr"]))  # the test's own calculator
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
    return ""


async def test_a_responses_tool_loop_renders_and_captures_exactly_as_the_chat_loop(real):
    """The same conversation through ``responses.create`` and ``chat.completions.create`` gives the same prompt
    tokens; the Responses rollout merges into one drift-free trajectory."""
    front = OpenAIFront(ScriptedSampler(real, ["Let me compute. " + CALL, "It is 5."] * 2))
    async with front.openai_client("resp") as client:
        assert await responses_agent(client) == "It is 5."
    first, second = front.captures.calls("resp")
    assert first.endpoint == second.endpoint == "responses" and first.request["instructions"] == "Be brief."
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].tool_calls[0]["function"]["name"] == "calc"
    traj = build_trajectory("resp", [first, second], reward=1.0)
    assert traj.drift == [] and len(traj.segments()) == 1

    async with front.openai_client("chat") as client:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TASK}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
        call = reply.choices[0].message.tool_calls[0]
        messages += [reply.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    chat = front.captures.calls("chat")
    assert [c.prompt_tokens for c in chat] == [first.prompt_tokens, second.prompt_tokens]


async def test_the_reply_is_a_response_the_client_parses(real):
    front = OpenAIFront(ScriptedSampler(real, ["Let me compute. " + CALL]))
    async with front.openai_client("r") as client:
        tool = {**TOOL, "strict": None, "description": None, "output_schema": None}  # null keys: not sent
        r = await client.responses.create(model="policy", input=TASK, tools=[tool], metadata={"k": "v"}, store=False, user="u")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed" and r.model == "policy"
    message, fc = r.output
    assert message.type == "message" and message.content[0].type == "output_text" and r.output_text == "Let me compute."
    assert fc.type == "function_call" and fc.name == "calc" and json.loads(fc.arguments) == {"expr": "2+3"}
    [call] = front.captures.calls("r")
    assert fc.call_id == call.choices[0].tool_calls[0]["id"] and r.metadata == {"k": "v"}
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(call.prompt_tokens), len(call.choices[0].tokens))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


async def test_streamed_and_plain_replies_and_captures_agree(real):
    """(The Responses API has no ``seed``: each rollout is bound with the same one, so each samples the same tokens.)"""
    front = OpenAIFront(real)
    for rollout in ("plain", "helper", "raw"):
        front.bind(rollout, real, 0, seed=5)
    kwargs = dict(model="policy", input="Say hi.", temperature=0.8, max_output_tokens=256)
    async with front.openai_client("plain") as client:
        plain = await client.responses.create(**kwargs)
    async with front.openai_client("helper") as client:
        async with client.responses.stream(**kwargs) as stream:
            kinds = [e.type async for e in stream]
            final = await stream.get_final_response()
    async with front.openai_client("raw") as client:
        events = [e async for e in await client.responses.create(**kwargs, stream=True)]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-3:] == ["response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [a], [b], [c] = (front.captures.calls(r) for r in ("plain", "helper", "raw"))
    assert a.model_dump(exclude={"rollout_id"}) == b.model_dump(exclude={"rollout_id"}) == c.model_dump(exclude={"rollout_id"})
    assert deltas == final.output_text == plain.output_text == events[-1].response.output_text != ""


async def test_a_reply_cut_by_max_output_tokens_is_incomplete(real):
    front = OpenAIFront(real)
    front.bind("r", real, 0, seed=1)  # (a reply that ends on its first token would be complete)
    async with front.openai_client("r") as client:
        r = await client.responses.create(model="policy", input="Say hi.", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and front.captures.calls("r")[0].choices[0].finish_reason == "length"


BAD = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation in 'input'"),
    ({"conversation": "conv_1"}, "conversation", "stores no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", '"web_search" is not supported'),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type", '"reasoning" is not supported'),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type", "input_text"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "5"}]}, "input.0", "function_call_output item"),
    (
        {"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{"}]},
        "input.1.arguments",
        "not JSON",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"}, {"role": "user", "content": "x"}]},
        "input.0.call_id",
        "has no answer",
    ),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort", "unsupported parameter"),
    ({"include": ["reasoning.encrypted_content"]}, "include.0", "send []"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format.type", "structured output"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "unsupported parameter"),
    ({"truncation": "auto"}, "truncation", "invalid value"),
    ({"input": [{"role": "user", "content": []}]}, "input.0.content", "empty array"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "name": "calc"}}, "tool_choice", "needs tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "absent"}}, "tool_choice", "not in tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice.type", "invalid value"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "not supported"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation", "obfuscation"),
]


@pytest.mark.parametrize(("change", "param", "says"), BAD, ids=[p for _, p, _ in BAD])
async def test_bad_requests_are_a_400_naming_the_responses_field(real, change, param, says):
    front = OpenAIFront(real)
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        r = await http.post("/v1/responses", json={"model": "policy", "input": "hi", **change})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert front.captures.rollout_ids() == []


async def test_the_official_client_gets_a_bad_request_error_for_previous_response_id(real):
    front = OpenAIFront(real)
    async with front.openai_client() as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="policy", input="hi", previous_response_id="resp_1")
    assert err.value.body["param"] == "previous_response_id"


async def test_output_items_come_back_as_the_client_gives_them(real):
    """The stream helper's final output (``parsed``, ``parsed_arguments``, ``phase``: null) and ``model_dump()`` of
    the items were 400s (unsupported parameter); null keys in items count as not sent, as the request's own do."""
    front = OpenAIFront(ScriptedSampler(real, ["Let me compute. " + CALL, "It is 5.", "It is 5."]))
    async with front.openai_client("r") as client:
        async with client.responses.stream(model="policy", input=TASK, tools=[TOOL]) as stream:
            final = await stream.get_final_response()
        message, call = final.output
        answer = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
        for sent in (final.output, [o.model_dump() for o in final.output]):
            items = [{"role": "user", "content": TASK}, *sent, answer]
            assert (await client.responses.create(model="policy", input=items, tools=[TOOL])).output_text == "It is 5."
    first, *later = front.captures.calls("r")
    assert all(build_trajectory("r", [first, c], 1.0).drift == [] for c in later)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize("route", ["/v1/responses", "/v1/chat/completions"])
async def test_a_number_json_has_not_is_a_400_naming_where_it_is(real, route, number):
    """NaN, ±Infinity and 1e400 (infinity once decoded) are no JSON numbers. In a tool's parameters, which a Responses
    reply echoes back, the reply could not be written (a 500); a chat rendered them into the prompt as they came."""
    front = OpenAIFront(real)
    function = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"maximum": 0}}}}
    body = {"model": "policy", "input": "hi", "tools": [{"type": "function", **function}], "max_output_tokens": 2}
    if route == "/v1/chat/completions":
        messages = [{"role": "user", "content": "hi"}]
        body = {"model": "policy", "messages": messages, "tools": [{"type": "function", "function": function}], "max_tokens": 2}
    raw = json.dumps(body).replace('"maximum": 0', f'"maximum": {number}')
    async with httpx.AsyncClient(transport=front.transport(), base_url="http://front") as http:
        r = await http.post(route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        param = r.json()["error"]["param"]
        assert param.startswith("tools.0.") and param.endswith("parameters.properties.x.maximum"), r.text
        assert (await http.post(route, content=raw.replace(number, "0"), headers={"content-type": "application/json"})).status_code == 200
    assert len(front.captures.calls("default")) == 1
