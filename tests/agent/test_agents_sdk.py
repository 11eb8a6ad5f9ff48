"""Agents written with the OpenAI Agents SDK (``openai-agents``), as a stranger writes them: a default ``Agent`` with a
``function_tool`` (strict by default), run by ``Runner.run`` on ``OpenAIResponsesModel`` or
``OpenAIChatCompletionsModel`` over the in-process front on mock://. Its default request fields (``include: []``,
strict tools) were 400s; now every call is served and captured as one rollout, and the agent loop trains on it."""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunConfig, Runner, function_tool
from agents.exceptions import ModelBehaviorError

from asyncsess import ServiceClient
from asyncsess.backends import load_backend
from asyncsess.rl import AgentRLConfig, train_agent_rl
from asyncsess.rl.capture import build_trajectory, read_trajectories
from asyncsess.serve.openai_front import OpenAIFront
from asyncsess.serve.tinker_api import create_app

from .helpers import ScriptedSampler

pytestmark = pytest.mark.anyio
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>'
OFFLINE = RunConfig(tracing_disabled=True)  # (tracing would export to OpenAI's servers)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the Agents SDK runs on asyncio only


@function_tool
def calc(expr: str) -> str:
    """Evaluate an arithmetic expression."""
    return str(eval(expr, {"__builtins__": {}}))


def sdk_model(kind: str, client):
    return OpenAIResponsesModel("policy", client) if kind == "responses" else OpenAIChatCompletionsModel("policy", client)


@pytest.fixture
async def real():
    async with ServiceClient("mock://?max_context=4096") as svc:
        yield await svc.create_sampling_client(base_model="mock/bigram-tiny")


@pytest.mark.parametrize("kind", ["responses", "chat"])
async def test_a_default_agent_runs_its_tool_to_a_final_output_and_is_captured_as_one_rollout(real, kind):
    front = OpenAIFront(ScriptedSampler(real, ["Let me compute. " + CALL, "It is 5."]))
    async with front.openai_client("sdk") as client:
        agent = Agent(name="calc", instructions="Be brief.", tools=[calc], model=sdk_model(kind, client))
        result = await Runner.run(agent, "What is 2+3?", run_config=OFFLINE)
    assert result.final_output == "It is 5."
    assert [item.output for item in result.new_items if item.type == "tool_call_output_item"] == ["5"]  # the tool ran
    first, second = front.captures.calls("sdk")
    endpoint = "responses" if kind == "responses" else "chat.completions"
    assert first.endpoint == second.endpoint == endpoint and [first.call_index, second.call_index] == [0, 1]
    tools = first.request["tools"]
    assert (tools[0] if kind == "responses" else tools[0]["function"])["strict"] is True  # the SDK's default
    if kind == "responses":
        assert first.request["include"] == [] and first.request["instructions"] == "Be brief."
    [tool_call] = first.choices[0].tool_calls
    assert json.loads(tool_call["function"]["arguments"]) == {"expr": "2+3"} and first.choices[0].schema_errors == {}
    traj = build_trajectory("sdk", [first, second], reward=1.0)
    assert traj.drift == [] and len(traj.segments()) == 1  # the SDK sends the model's turn back as it rendered


async def test_the_agent_loop_trains_a_default_sdk_agent(tmp_path):
    async def agent(client, task) -> float:
        sdk = Agent(name="calc", instructions="Answer.", tools=[calc], model=OpenAIResponsesModel("policy", client))
        try:
            result = await Runner.run(sdk, task, run_config=OFFLINE)
        except ModelBehaviorError:  # a reply cut at max_tokens is `incomplete`, which the SDK raises, as with OpenAI
            return 0.0
        return float(sum(c.isdigit() for c in str(result.final_output)))

    cfg = AgentRLConfig(url="mock://?max_context=2048", groups_per_batch=1, group_size=2, max_steps=1, max_tokens=8, max_staleness=0)
    await train_agent_rl(cfg, agent, ["2+3?"], [], tmp_path, progress=False)
    lines = read_trajectories(tmp_path / "trajectories.jsonl")
    assert len(lines) >= 2
    for line in lines:
        [call] = line["calls"]  # the bigram model calls no tool: one turn, its output final
        assert call["endpoint"] == "responses" and call["request"]["tools"][0]["strict"] is True
        trained = [t for s in line["segments"] for t, m in zip(s["tokens"], s["mask"]) if m]
        assert trained == call["choices"][0]["tokens"] != []


@pytest.mark.parametrize("kind", ["responses", "chat"])
async def test_a_default_agent_is_served_by_the_serve_door(kind):
    """``asyncsess serve``'s ``/v1`` (in-process, mock://): the SDK's default requests are served and captured per key."""
    app = create_app(load_backend("mock://"), {"key"}, poll_timeout=5.0)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve", timeout=30) as http:
            client = openai.AsyncOpenAI(
                base_url="http://serve/v1", api_key="key", http_client=http, max_retries=0, default_headers={"X-Rollout-Id": "r"}
            )
            model = sdk_model(kind, client)
            model.model = "mock/bigram-tiny"
            agent = Agent(name="calc", instructions="Be brief.", tools=[calc], model=model, model_settings=ModelSettings(max_tokens=4))
            with contextlib.suppress(ModelBehaviorError):  # (a Responses reply cut at max_tokens is incomplete)
                await Runner.run(agent, "What is 2+3?", run_config=OFFLINE)
            calls = (await http.get("/v1/asyncsess/rollouts/r", headers={"X-API-Key": "key"})).json()["calls"]
    [call] = calls
    assert call["endpoint"] == ("responses" if kind == "responses" else "chat.completions") and call["choices"][0]["tokens"]


@pytest.mark.parametrize("kind", ["responses", "chat"])
@pytest.mark.parametrize(
    ("tool_choice", "rest"), [("required", CALL[len('<tool_call>{"name": "') :]), ("calc", ' {"expr": "2+3"}}</tool_call>')]
)
async def test_an_agent_forcing_its_tool_gets_the_call_and_a_final_output(real, kind, tool_choice, rest):
    """``ModelSettings(tool_choice="required")`` or a tool's name (400s before): the first reply is forced to open a call,
    the model writes the rest; the SDK runs the tool, then (its ``reset_tool_choice``) asks freely for the final output."""
    front = OpenAIFront(ScriptedSampler(real, [rest, "It is 5."]))
    async with front.openai_client("sdk") as client:
        settings = ModelSettings(tool_choice=tool_choice)
        agent = Agent(name="calc", instructions="Be brief.", tools=[calc], model=sdk_model(kind, client), model_settings=settings)
        result = await Runner.run(agent, "What is 2+3?", run_config=OFFLINE)
    assert result.final_output == "It is 5."
    assert [item.output for item in result.new_items if item.type == "tool_call_output_item"] == ["5"]
    first, second = front.captures.calls("sdk")
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].tool_choice_error is None
    assert build_trajectory("sdk", [first, second], reward=1.0).drift == []
