"""Captures merged into trajectories: masks token by token over a multi-turn tool conversation, and drift."""

from __future__ import annotations

import json

import openai
import pytest

from asyncsess import ServiceClient
from asyncsess.rl.capture import build_trajectory, read_trajectories
from asyncsess.serve.capture import CapturedCall, CapturedChoice, CaptureStore
from asyncsess.serve.openai_front import OpenAIFront

from .helpers import CALC, ScriptedSampler

pytestmark = pytest.mark.anyio
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>'
TASK = [{"role": "user", "content": "What is 2+3? Use the calculator."}]


@pytest.fixture
async def real():
    async with ServiceClient("mock://?max_context=2048") as svc:
        yield await svc.create_sampling_client(base_model="mock/bigram-tiny")


async def tool_agent(client, echo_back=lambda message: message) -> str:
    """A plain OpenAI function-calling loop: call the model, run its tool calls, answer with the last reply."""
    messages = list(TASK)
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC], seed=0)
        message = reply.choices[0].message
        sent = echo_back(message)
        messages.append(sent)
        if not message.tool_calls:
            return message.content
        ids = [c["id"] for c in sent["tool_calls"]] if isinstance(sent, dict) else [c.id for c in message.tool_calls]
        for call, call_id in zip(message.tool_calls, ids):  # answered by the ids the echoed message gives them
            result = str(eval(json.loads(call.function.arguments)["expr"]))  # the test's own calculator
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return ""


async def test_tool_calls_round_trip_and_masks_are_right_token_by_token(real):
    front = OpenAIFront(ScriptedSampler(real, ["Let me compute. " + CALL, "It is 5."]))
    async with front.openai_client("r") as client:
        assert await tool_agent(client) == "It is 5."
    first, second = front.captures.calls("r")
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].tool_calls[0]["function"]["name"] == "calc"
    traj = build_trajectory("r", [first, second], reward=1.0)
    assert traj.drift == []
    [seg] = traj.segments()
    tok = real.get_tokenizer()
    r1, r2 = first.choices[0].tokens, second.choices[0].tokens
    assert seg["tokens"] == second.prompt_tokens + r2  # one sequence: the later prompt extends the earlier
    assert seg["tokens"][: len(first.prompt_tokens) + len(r1)] == first.prompt_tokens + r1
    expected = [0.0] * len(seg["tokens"])
    for start, n in ((len(first.prompt_tokens), len(r1)), (len(second.prompt_tokens), len(r2))):
        expected[start : start + n] = [1.0] * n
    assert seg["mask"] == expected
    trained = [t for t, m in zip(seg["tokens"], seg["mask"]) if m]
    assert tok.decode(trained) == "Let me compute. " + CALL + "<|end|>" + "It is 5.<|end|>"
    untrained = tok.decode([t for t, m in zip(seg["tokens"], seg["mask"]) if not m])
    assert "<tool_response>\n5\n</tool_response>" in untrained and "What is 2+3?" in untrained and "calc" in untrained
    lps = [lp for lp, m in zip(seg["logprobs"], seg["mask"]) if m]
    assert lps == first.choices[0].logprobs + second.choices[0].logprobs
    scored = await real.compute_logprobs(seg["tokens"])
    assert lps == [s for s, m in zip(scored, seg["mask"]) if m]  # the sampler's log-probs on the merged tokens
    [(datum, mask)] = traj.datums(0.5)
    assert datum.loss_fn_inputs["advantages"].data == [0.5 * m for m in mask]


async def test_reformatted_tool_call_is_detected_as_drift_and_not_trained(real):
    """The agent rebuilds the assistant message itself (new ids, re-serialised arguments): the next prompt
    no longer extends the tokens the model produced."""

    def rebuilt(message):
        calls = [
            {"id": "mine-" + c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls or []
        ]
        return {"role": "assistant", "content": message.content, **({"tool_calls": calls} if calls else {})}

    front = OpenAIFront(ScriptedSampler(real, ['<tool_call>{"name":"calc","arguments":{"expr":"2+3"}}</tool_call>', "5"]))
    async with front.openai_client("d") as client:
        assert await tool_agent(client, rebuilt) == "5"
    first, second = front.captures.calls("d")
    traj = build_trajectory("d", [first, second], reward=1.0)
    [drift] = traj.drift
    assert drift.reason == "completion_retokenized" and drift.call_index == 1 and drift.handling == "split"
    assert len(first.prompt_tokens) <= drift.position < len(first.prompt_tokens) + len(first.choices[0].tokens)
    a, b = traj.segments()
    assert a["tokens"] == first.prompt_tokens + first.choices[0].tokens
    assert b["tokens"] == second.prompt_tokens + second.choices[0].tokens
    trained_b = [t for t, m in zip(b["tokens"], b["mask"]) if m]
    assert trained_b == second.choices[0].tokens  # the re-rendered call in the new prompt is not trained
    assert traj.trajectory().metrics["drift"] == 1.0


async def test_edited_history_is_prompt_changed_drift(real):
    front = OpenAIFront(real)
    async with front.openai_client("e") as client:
        r = await client.chat.completions.create(model="policy", messages=TASK, max_tokens=6, seed=1)
        edited = [{"role": "user", "content": "Something else."}, {"role": "assistant", "content": r.choices[0].message.content}]
        await client.chat.completions.create(model="policy", messages=edited, max_tokens=6, seed=1)
    traj = build_trajectory("e", front.captures.calls("e"), 0.0)
    assert [d.reason for d in traj.drift] == ["prompt_changed"] and len(traj.segments()) == 2


async def test_n_choices_follow_the_one_the_agent_continued(real):
    front = OpenAIFront(real)
    async with front.openai_client("n") as client:
        r = await client.chat.completions.create(model="policy", messages=TASK, n=4, max_tokens=6, seed=2, stop=[])
        picked = r.choices[2].message.content
        msgs = [*TASK, {"role": "assistant", "content": picked}, {"role": "user", "content": "ok"}]
        await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6, seed=3)
    calls = front.captures.calls("n")
    traj = build_trajectory("n", calls, 1.0)
    assert traj.chosen[0] == 2 and traj.drift == [] and len(traj.segments()) == 1


async def test_store_jsonl_and_trajectory_records_round_trip(real, tmp_path):
    store = CaptureStore()
    front = OpenAIFront(real, captures=store, version=3)
    async with front.openai_client("j") as client:
        await client.chat.completions.create(model="policy", messages=TASK, max_tokens=5, seed=4)
    assert store.write_jsonl(tmp_path / "calls.jsonl") == 1
    line = json.loads((tmp_path / "calls.jsonl").read_text())
    assert line["weight_version"] == 3 and line["rollout_id"] == "j" and line["request"]["seed"] == 4
    traj = build_trajectory("j", store.pop("j"), 0.25)
    (tmp_path / "t.jsonl").write_text(json.dumps(traj.record()) + "\n")
    [rec] = read_trajectories(tmp_path / "t.jsonl")
    assert rec["reward"] == 0.25 and rec["weight_versions"] == [3] and rec["segments"] == traj.segments()
    assert store.calls("j") == [] and store.reserve("j") == 0


def _call(rollout: str, index: int, tokens: int) -> CapturedCall:
    choice = CapturedChoice(index=0, tokens=[7] * tokens, logprobs=[-1.0] * tokens, finish_reason="length")
    return CapturedCall(
        rollout_id=rollout,
        call_index=index,
        endpoint="completions",
        model="m",
        sampler_id="s",
        weight_version=0,
        prompt_tokens=[1] * tokens,
        choices=[choice],
        usage={},
    )


def test_a_bounded_store_drops_the_oldest_rollouts_first():
    store = CaptureStore(max_tokens=100)
    for r in ("a", "b", "c"):
        store.add(_call(r, store.reserve(r), 15))  # 30 tokens each
    assert store.tokens == 90 and store.dropped_calls == 0
    store.add(_call("a", store.reserve("a"), 15))  # "a" is now the most recent rollout: "b" goes
    assert store.rollout_ids() == ["c", "a"] and store.dropped_calls == 1 and store.tokens == 90
    assert [c.call_index for c in store.calls("a")] == [0, 1]
    assert store.calls("b") == [] and store.reserve("b") == 0  # a dropped rollout starts again at call 0
    store.add(_call("d", store.reserve("d"), 200))  # one call over the whole bound: kept alone until taken
    assert store.rollout_ids() == ["d"] and store.dropped_calls == 4 and store.tokens == 400
    store.add(_call("d", store.reserve("d"), 10))  # the same rollout grows: its oldest call goes
    assert [c.call_index for c in store.calls("d")] == [1] and store.tokens == 20
    assert [c.call_index for c in store.pop("d")] == [1] and store.tokens == 0


def test_calls_in_flight_when_their_rollout_is_taken_are_late():
    """Taken with two calls in flight: both are late (not captured), and calls made meanwhile under the same id
    number on after them (indices never collide); once nothing of the rollout is left it starts again at 0."""
    store = CaptureStore()
    first, second = store.reserve("r"), store.reserve("r")
    assert store.pop("r") == []
    third = store.reserve("r")
    assert third == 2
    store.add(_call("r", second, 3))
    assert not store.release("r", first)  # a late call gives nothing back
    store.add(_call("r", third, 3))
    assert [c.call_index for c in store.calls("r")] == [2] and store.late_calls == 1  # the released one had nothing
    assert [c.call_index for c in store.pop("r")] == [2] and store.reserve("r") == 0
    dropped = CaptureStore(max_tokens=10)
    late = dropped.reserve("a")
    dropped.add(_call("b", dropped.reserve("b"), 3))
    dropped.add(_call("c", dropped.reserve("c"), 3))  # over the bound: "b" is dropped whole
    dropped.add(_call("a", late, 1))  # "a" was never dropped: captured
    assert [c.call_index for c in dropped.calls("a")] == [0] and dropped.late_calls == 0


def test_an_unbounded_store_keeps_everything():
    store = CaptureStore()
    for i in range(50):
        store.add(_call(str(i), 0, 1000))
    assert len(store.rollout_ids()) == 50 and store.dropped_calls == 0


async def test_a_tool_call_that_is_not_json_is_returned_as_text(real):
    """NaN is no JSON value: a reply calling a tool with it is text (finish "stop"), never tool_calls whose
    ``arguments`` a JSON reader (JavaScript's, or json.loads with strict constants) would refuse."""
    written = '<tool_call>{"name": "calc", "arguments": {"expr": NaN}}</tool_call>'
    front = OpenAIFront(ScriptedSampler(real, [written]))
    async with front.openai_client("nan") as client:
        reply = await client.chat.completions.create(model="policy", messages=TASK, tools=[CALC], seed=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls and choice.message.content == written


async def test_parallel_tool_results_reach_the_model_in_the_order_of_its_calls(real):
    """An agent that appends tool results as they complete answers parallel calls out of order. The template shows
    results without their tool_call_id, so they were rendered in the order sent: the model read 6 as the answer to
    1+1. They now follow the calls' order; a result for no call, a second one for a call, or a call left unanswered
    is a 400 naming the message (as OpenAI's API answers) that takes no call index."""
    calls = ['<tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call>']
    calls.append('<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>')
    front = OpenAIFront(ScriptedSampler(real, ["\n".join(calls), "2 and 6."]))
    async with front.openai_client("p") as client:
        reply = await client.chat.completions.create(model="policy", messages=TASK, tools=[CALC], seed=0)
        message = reply.choices[0].message
        first, second = message.tool_calls
        answers = [
            {"role": "tool", "tool_call_id": c.id, "content": str(eval(json.loads(c.function.arguments)["expr"]))} for c in (second, first)
        ]
        bad = [
            ([answers[0]], "messages.1.tool_calls.0.id"),  # the first call has no answer
            ([answers[0], {**answers[1], "tool_call_id": "call_other"}], "messages.3.tool_call_id"),
            ([answers[0], answers[0]], "messages.3.tool_call_id"),
            (
                [*answers, {"role": "user", "content": "and?"}, {"role": "tool", "tool_call_id": first.id, "content": "2"}],
                "messages.5.role",
            ),
        ]
        for tail, param in bad:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="policy", messages=[*TASK, message, *tail], tools=[CALC], seed=0)
            assert info.value.body["param"] == param, info.value.body
        final = await client.chat.completions.create(model="policy", messages=[*TASK, message, *answers], tools=[CALC], seed=0)
    assert final.choices[0].message.content == "2 and 6."
    one, two = front.captures.calls("p")
    assert two.call_index == 1  # the refused calls took no index
    rendered = real.get_tokenizer().decode(two.prompt_tokens[len(one.prompt_tokens) + len(one.choices[0].tokens) :])
    assert rendered.index("<tool_response>\n2\n") < rendered.index("<tool_response>\n6\n"), rendered


async def test_the_stream_helpers_message_can_be_sent_back(real):
    """``client.chat.completions.stream(...)`` gives a ParsedChatCompletionMessage whose tool calls carry ``index``
    and ``function.parsed_arguments`` and which carries ``parsed``; sent back as it is (or dumped), each was a 400
    'unsupported parameter'. They are accepted (the empty values the client fills in) and the rollout extends."""
    front = OpenAIFront(ScriptedSampler(real, [CALL, "It is 5.", "It is 5.", "It is 5."]))
    async with front.openai_client("h") as client:
        async with client.chat.completions.stream(model="policy", messages=TASK, tools=[CALC], seed=0) as stream:
            message = (await stream.get_final_completion()).choices[0].message
        [call] = message.tool_calls
        answer = {"role": "tool", "tool_call_id": call.id, "content": "5"}
        for sent in (message, message.model_dump(), message.model_dump(exclude_none=True)):
            reply = await client.chat.completions.create(model="policy", messages=[*TASK, sent, answer], tools=[CALC], seed=0)
            assert reply.choices[0].message.content == "It is 5."
    first, *later = front.captures.calls("h")
    for call_ in later:
        assert build_trajectory("h", [first, call_], 1.0).drift == []


async def test_a_streamed_tool_call_reply_adds_up_to_the_plain_one(real):
    """A reply that is only tool calls has content null; streamed, its deltas carried content "", so the stream
    helper's message had content "" where the plain reply's had None."""
    front = OpenAIFront(ScriptedSampler(real, [CALL, CALL, "Let me see. " + CALL, "Let me see. " + CALL]))
    async with front.openai_client("s") as client:
        for _ in range(2):
            plain = (await client.chat.completions.create(model="policy", messages=TASK, tools=[CALC], seed=0)).choices[0]
            async with client.chat.completions.stream(model="policy", messages=TASK, tools=[CALC], seed=0) as stream:
                streamed = (await stream.get_final_completion()).choices[0]
            assert streamed.message.content == plain.message.content and streamed.finish_reason == plain.finish_reason == "tool_calls"
            assert [c.function.model_dump(exclude={"parsed_arguments"}) for c in streamed.message.tool_calls] == [
                c.function.model_dump() for c in plain.message.tool_calls
            ]
    assert [c.choices[0].tool_calls[0]["function"]["name"] for c in front.captures.calls("s")] == ["calc"] * 4


def _nested_tool(depth: int) -> dict:
    value: object = "v"
    for _ in range(depth):
        value = [value]
    return {"type": "function", "function": {"name": "f", "parameters": {"enum": value}}}


async def test_a_tool_schema_nested_too_deeply_is_refused_before_it_is_captured(real):
    """A tool schema nested 300 levels deep was served and captured, and then every GET and DELETE of the rollout
    was a 500 (pydantic's 'Maximum serialization depth exceeded'; DELETE had dropped the captures first). A body
    nested past 64 levels is now a 400 naming where; one within it is captured and read back."""
    front = OpenAIFront(real)
    async with front.openai_client("deep") as client:
        await client.chat.completions.create(model="policy", messages=TASK, tools=[_nested_tool(20)], max_tokens=2)
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="policy", messages=TASK, tools=[_nested_tool(300)], max_tokens=2)
        assert info.value.body["param"].startswith("tools.0.function.parameters.enum.0.0") and "64 levels" in info.value.message
        for method in ("GET", "DELETE"):
            got = await client._client.request(method, "http://asyncsess-front/v1/asyncsess/rollouts/deep")
            assert got.status_code == 200 and [c["call_index"] for c in got.json()["calls"]] == [0], got.text


async def test_remembered_replies_are_bounded_by_their_text_too(real, monkeypatch):
    """The exact text behind each tool-call id was kept for the last 100,000 ids, however long: forced calls with
    n=64 and long replies held GBs per front. Past a bound on their characters the oldest are forgotten; one sent
    back then renders from the message's fields (here: reformatted JSON, so drift), the newer ones exactly."""
    from asyncsess.serve import openai_front

    monkeypatch.setattr(openai_front, "_MAX_REMEMBERED_CHARS", len(CALL) + 10)
    compact = '<tool_call>{"name":"calc","arguments":{"expr":"2+3"}}</tool_call>'
    front = OpenAIFront(ScriptedSampler(real, [compact, compact, "5", "5"]))
    async with front.openai_client("r") as client:
        old, new = [(await client.chat.completions.create(model="policy", messages=TASK, tools=[CALC])).choices[0].message for _ in "ab"]
        for message in (old, new):
            answer = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}
            await client.chat.completions.create(model="policy", messages=[*TASK, message, answer], tools=[CALC])
    first, second, after_old, after_new = front.captures.calls("r")
    assert [d.reason for d in build_trajectory("r", [first, after_old], 1.0).drift] == ["completion_retokenized"]
    assert build_trajectory("r", [second, after_new], 1.0).drift == []
