"""The environment API: tool calls and results in the chat template, sequence-extension datums, stop reasons."""

from __future__ import annotations

import json

import pytest

from asyncsess.chat import ChatRenderer, Tool, parse_tool_calls
from asyncsess.rl import (
    StepResult,
    TokensWithLogprobs,
    Trajectory,
    TrajectoryGroup,
    Transition,
    do_rollout,
    group_datums,
    rollout_metrics,
    trajectory_datums,
)
from asyncsess.rl.tool_env import ToolEnv
from asyncsess.types import ModelInput
from asyncsess_mock import CharTokenizer

pytestmark = pytest.mark.anyio
TOK = CharTokenizer()


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class ToolRoleTokenizer(CharTokenizer):
    """A template with a tool role and a tools header, as tool-aware HF templates have."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, tools=None, **_):
        text = "<|bos|>" + (f"<|system|>TOOLS {json.dumps(tools)}<|end|>" if tools else "")
        for m in messages:
            role = "user" if m["role"] == "tool" else m["role"]
            body = f"[tool]{m['content']}" if m["role"] == "tool" else m["content"]
            text += f"<|{role}|>{body}<|end|>"
        text += "<|assistant|>" if add_generation_prompt else ""
        return self.encode(text, add_special_tokens=False) if tokenize else text


def echo_tool(calls: list) -> Tool:
    async def run(arguments):
        calls.append(dict(arguments))
        return json.dumps({"echo": arguments.get("x")}), {"echo/calls": 1.0}

    return Tool("echo", "Echo x.", {"type": "object", "properties": {"x": {"type": "string"}}}, run)


async def final_grade(text: str) -> tuple[float, dict[str, float]]:
    return (1.0 if "DONE" in text else 0.0), {"done": float("DONE" in text)}


def reply(text: str, stop: bool = True) -> list[int]:
    return enc(text) + ([TOK.convert_tokens_to_ids("<|end|>")] if stop else [])


def test_parse_tool_calls():
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    assert parse_tool_calls("no call") == ([], None)
    calls, err = parse_tool_calls(f"x {call} y {call}")
    assert err is None and [(c.name, c.arguments) for c in calls] == [("f", {"a": 1})] * 2
    assert parse_tool_calls("<tool_call>{oops</tool_call>")[1].startswith("a tool call is not JSON")
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] is not None
    assert parse_tool_calls(call + '<tool_call>{"name": "f"')[1] == "a <tool_call> is not closed"
    deep = '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}</tool_call>"
    assert parse_tool_calls(deep) == ([], "a tool call nests too deeply")  # a model's reply, not a RecursionError
    for constant in ("NaN", "Infinity", "-Infinity"):  # Python's json reads them; the calls' JSON readers do not
        bad = '<tool_call>{"name": "f", "arguments": {"a": ' + constant + "}}</tool_call>"
        assert parse_tool_calls(bad)[1] == f"a tool call is not JSON: {constant} is not a JSON value"


def test_renderer_falls_back_where_the_template_has_no_tool_role():
    renderer = ChatRenderer(TOK)  # the mock template rejects role "tool" and ignores tools=
    assert not renderer.tool_role and renderer.stop == [TOK.convert_tokens_to_ids("<|end|>"), TOK.eos_token_id]
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "R1"},
        {"role": "tool", "content": "R2"},
    ]
    text = TOK.decode(renderer.tokens(msgs, [echo_tool([])]))
    assert text.startswith('<|bos|><|system|>You can call these tools:\n<tools>\n{"type": "function", "function": {"name": "echo"')
    assert text.endswith(
        "<|user|>q<|end|><|assistant|>a<|end|><|user|><tool_response>\nR1\n</tool_response>\n<tool_response>\nR2\n</tool_response><|end|><|assistant|>"
    )


def test_renderer_uses_a_native_tool_role_and_tools_header():
    tok = ToolRoleTokenizer()
    renderer = ChatRenderer(tok)
    assert renderer.tool_role
    text = tok.decode(renderer.tokens([{"role": "user", "content": "q"}, {"role": "tool", "content": "R"}], [echo_tool([])]))
    assert text.startswith('<|bos|><|system|>TOOLS [{"type": "function"') and "You can call" not in text
    assert text.endswith("<|user|>q<|end|><|user|>[tool]R<|end|><|assistant|>")


async def test_tool_turn_then_answer_merges_into_one_datum():
    calls: list = []
    env = ToolEnv(ChatRenderer(TOK), [{"role": "user", "content": "go"}], [echo_tool(calls)], final_grade, max_turns=2)
    ob0, stop = await env.initial_observation()
    assert stop == [TOK.convert_tokens_to_ids("<|end|>"), TOK.eos_token_id]
    ac0 = reply('<tool_call>{"name": "echo", "arguments": {"x": "hi"}}</tool_call>')
    r0 = await env.step(ac0)
    assert not r0.episode_done and r0.reward == 0.0 and r0.metrics == {"echo/calls": 1.0} and calls == [{"x": "hi"}]
    ob1 = r0.next_observation.to_ints()
    assert ob1[: ob0.length + len(ac0)] == ob0.to_ints() + ac0  # the result is rendered after the model's own tokens
    assert TOK.decode(ob1[ob0.length + len(ac0) :]) == '<|user|><tool_response>\n{"echo": "hi"}\n</tool_response><|end|><|assistant|>'
    ac1 = reply("DONE")
    r1 = await env.step(ac1)
    assert r1.episode_done and r1.reward == 1.0 and r1.stop_reason == "completed" and r1.metrics == {"done": 1.0, "tool_calls": 1.0}

    traj = Trajectory(
        [
            Transition(ob0, TokensWithLogprobs(ac0, [-0.5] * len(ac0), "stop"), 0.0, False),
            Transition(r0.next_observation, TokensWithLogprobs(ac1, [-0.25] * len(ac1), "stop"), 1.0, True),
        ],
        "completed",
    )
    [(datum, mask)] = trajectory_datums(traj, advantage=2.0)
    full = ob1 + ac1
    assert datum.model_input.to_ints() == full[:-1] and datum.loss_fn_inputs["target_tokens"].data == full[1:]
    n_ob0, n_res = ob0.length - 1, len(ob1) - ob0.length - len(ac0)
    expect_mask = [0.0] * n_ob0 + [1.0] * len(ac0) + [0.0] * n_res + [1.0] * len(ac1)
    assert mask == expect_mask
    assert datum.loss_fn_inputs["advantages"].data == [2.0 * m for m in expect_mask]
    assert datum.loss_fn_inputs["logprobs"].data == [0.0] * n_ob0 + [-0.5] * len(ac0) + [0.0] * n_res + [-0.25] * len(ac1)


def test_an_observation_that_does_not_extend_starts_a_new_datum():
    ob0, ac0 = enc("abc"), enc("de")
    ob1, ac1 = enc("abXde!"), enc("f")  # re-rendered differently: not a prefix extension
    traj = Trajectory(
        [
            Transition(ModelInput.from_ints(ob0), TokensWithLogprobs(ac0, [-1.0, -1.0], "stop"), 0.0, False),
            Transition(ModelInput.from_ints(ob1), TokensWithLogprobs(ac1, [-2.0], "stop"), 1.0, True),
        ],
        "completed",
    )
    (d0, m0), (d1, m1) = trajectory_datums(traj, advantage=-1.0)
    assert d0.loss_fn_inputs["target_tokens"].data == (ob0 + ac0)[1:] and m0 == [0.0, 0.0, 1.0, 1.0]
    assert d1.loss_fn_inputs["target_tokens"].data == (ob1 + ac1)[1:] and m1 == [0.0] * 5 + [1.0]
    assert d1.loss_fn_inputs["advantages"].data == [0.0] * 5 + [-1.0]


def test_group_advantages_are_centred_and_constant_groups_give_no_datums():
    def traj(reward: float) -> Trajectory:
        return Trajectory(
            [Transition(ModelInput.from_ints(enc("ab")), TokensWithLogprobs(enc("c"), [-1.0], "stop"), reward, True)], "completed"
        )

    group = TrajectoryGroup([traj(1.0), traj(0.0), traj(0.0)], [0.5, 0.0, 0.0], [{}, {}, {}])
    assert group.total_rewards == [1.5, 0.0, 0.0]
    advs = [d.loss_fn_inputs["advantages"].data[-1] for d, _ in group_datums(group)]
    assert advs == pytest.approx([1.0, -0.5, -0.5])
    assert group_datums(TrajectoryGroup([traj(1.0), traj(1.0)], [0.0, 0.0], [{}, {}])) == []


class Scripted:
    def __init__(self, *replies: tuple[str, str]):
        self.replies = list(replies)

    async def __call__(self, model_input, stop):
        text, reason = self.replies.pop(0)
        tokens = reply(text, stop=reason == "stop")
        return TokensWithLogprobs(tokens, [-1.0] * len(tokens), reason)


@pytest.mark.parametrize(
    ("replies", "reason", "turns", "reward"),
    [
        ([("DONE", "stop")], "completed", 1, 1.0),
        ([('<tool_call>{"name": "echo", "arguments": {}}</tool_call>', "stop")] * 2, "max_turns", 2, 0.0),
        ([("<tool_call>{bad</tool_call> DONE", "stop")], "parse_error", 1, 1.0),
        ([('<tool_call>{"name": "echo", "arguments": {}}</tool_call>', "stop"), ("DONE and more", "length")], "max_tokens", 2, 1.0),
    ],
)
async def test_stop_reasons(replies, reason, turns, reward):
    env = ToolEnv(ChatRenderer(TOK), [{"role": "user", "content": "go"}], [echo_tool([])], final_grade, max_turns=2)
    traj = await do_rollout(env, Scripted(*replies))
    assert (traj.stop_reason, len(traj.transitions), traj.reward) == (reason, turns, reward)
    metrics = rollout_metrics([TrajectoryGroup([traj], [0.0], [{}])])
    assert metrics[f"stop/{reason}"] == 1.0 and metrics["env/all/turns_per_episode"] == turns


async def test_context_overflow_ends_the_episode_with_the_overflow_reward():
    env = ToolEnv(
        ChatRenderer(TOK),
        [{"role": "user", "content": "go"}],
        [echo_tool([])],
        final_grade,
        max_trajectory_tokens=200,
        overflow_reward=-0.1,
    )
    await env.initial_observation()
    result = await env.step(reply('<tool_call>{"name": "echo", "arguments": {"x": "' + "y" * 100 + '"}}</tool_call>'))
    assert result == StepResult(-0.1, True, metrics={"echo/calls": 1.0, "tool_calls": 1.0}, stop_reason="context_overflow")


async def test_unknown_tool_gets_an_error_result():
    env = ToolEnv(ChatRenderer(TOK), [{"role": "user", "content": "go"}], [echo_tool([])], final_grade)
    await env.initial_observation()
    result = await env.step(reply('<tool_call>{"name": "nope", "arguments": {}}</tool_call>'))
    assert "unknown tool 'nope'; available: ['echo']" in TOK.decode(result.next_observation.to_ints())
