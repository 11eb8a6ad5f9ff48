"""The agent RL loop on mock://: the recipe learns, captures train only sampled tokens, resume, staleness."""

from __future__ import annotations

import json

import anyio
import pytest

from asyncsess.errors import InvalidInputError
from asyncsess.rl import AgentRLConfig, train_agent_rl
from asyncsess.rl.capture import read_trajectories
from asyncsess.runs.metrics import read_metrics
from examples import agent_rl
from tests.recipes.helpers import check_metrics_file

pytestmark = pytest.mark.anyio
FAST = ["max_steps=12", "eval_every=0", "save_every=0", "n_test=4", "group_size=6"]


async def test_recipe_reward_rises_and_metrics_and_trajectories_are_written(tmp_path):
    result = await agent_rl.main([f"run_dir={tmp_path}", *FAST])
    records = check_metrics_file(tmp_path, {"env/all/reward/total", "env/all/calls", "env/all/drift", "async/staleness_max", "optim/loss"})
    rewards = [r["env/all/reward/total"] for r in records if "env/all/reward/total" in r]
    assert len(rewards) == 12 and sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert result.after["test/env/all/reward/total"] > result.before["test/env/all/reward/total"]
    lines = read_trajectories(tmp_path / "trajectories.jsonl")
    final = result.final_checkpoint.extra
    pending = json.loads((tmp_path / final["pending_file"]).read_text()) if "pending_file" in final else []
    # every training rollout, those sampled for the next steps (saved with the final checkpoint), the held-out ones
    assert len(lines) == 12 * 4 * 6 + len(pending) * 6 + 2 * 4
    assert {line["temperature"] for line in lines} == {0.0, 1.0}
    for line in lines:
        assert line["calls"] and all(c["request"]["tools"][0]["function"]["name"] == "calc" for c in line["calls"])


async def test_the_same_seed_gives_the_same_run_whatever_order_the_calls_arrive_in(tmp_path):
    """Rollouts run concurrently, so their calls reach the sampler in an order the event loop picks; each
    rollout samples with its own seed, so two runs with the same seed draw the same tokens."""
    runs = []
    for name in ("a", "b"):
        await agent_rl.main([f"run_dir={tmp_path / name}", "max_steps=3", "eval_every=0", "save_every=0", "n_test=2", "group_size=6"])
        runs.append([r["env/all/reward/total"] for r in read_metrics(tmp_path / name) if "env/all/reward/total" in r])
    assert len(runs[0]) == 3 and runs[0] == runs[1]


def sampled(line: dict) -> tuple[list[int], list[float]]:
    """The tokens the model sampled on the rollout's path, and their log-probs, from the raw calls."""
    tokens, lps = [], []
    for call, k in zip(line["calls"], line["chosen"]):
        tokens += call["choices"][k]["tokens"]
        lps += call["choices"][k]["logprobs"]
    return tokens, lps


async def test_multi_turn_agent_trains_only_what_the_model_sampled(tmp_path):
    async def chatty(client, task) -> float:
        messages = [{"role": "user", "content": task}]
        for turn in range(3):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": f"go on {turn}"}]
        return float(sum(c.isdigit() for m in messages[1::2] for c in m["content"]))

    cfg = AgentRLConfig(url="mock://?max_context=2048", groups_per_batch=2, group_size=4, max_steps=3, learning_rate=0.5, max_tokens=12)
    await train_agent_rl(cfg, chatty, ["a", "b", "c"], [], tmp_path, progress=False)
    lines = read_trajectories(tmp_path / "trajectories.jsonl")
    assert len(lines) == 3 * 2 * 4
    drifts = 0
    for line in lines:
        assert len(line["calls"]) == 3 and [c["call_index"] for c in line["calls"]] == [0, 1, 2]
        assert len(line["segments"]) == 1 + len(line["drift"])  # every drift splits, nothing else does
        drifts += len(line["drift"])
        trained = [t for s in line["segments"] for t, m in zip(s["tokens"], s["mask"]) if m]
        trained_lps = [lp for s in line["segments"] for lp, m in zip(s["logprobs"], s["mask"]) if m]
        assert (trained, trained_lps) == sampled(line)  # exactly the sampled tokens, with the sampler's log-probs
    steps = [r for r in read_metrics(tmp_path) if "env/all/drift" in r]
    assert sum(r["env/all/drift"] for r in steps) * 8 == pytest.approx(drifts)  # the per-episode mean, 8 episodes a step


async def test_a_responses_api_agent_is_trained_as_a_chat_agent(tmp_path):
    """An agent written with ``client.responses.create`` (its output items sent back in ``input``) trains as the chat
    agent above does: exactly the sampled tokens, with the sampler's log-probs (a reply cut at max_output_tokens
    drifts: the template closes the turn the model did not)."""

    async def agent(client, task) -> float:
        items: list = [{"role": "user", "content": task}]
        for turn in range(2):
            reply = await client.responses.create(model="policy", input=items, instructions="Count.", max_output_tokens=12)
            items += [*reply.output, {"role": "user", "content": f"go on {turn}"}]
        return float(sum(c.isdigit() for c in reply.output_text))

    cfg = AgentRLConfig(url="mock://?max_context=2048", groups_per_batch=1, group_size=2, max_steps=2, max_tokens=12)
    await train_agent_rl(cfg, agent, ["a", "b"], [], tmp_path, progress=False)
    lines = read_trajectories(tmp_path / "trajectories.jsonl")
    assert len(lines) >= 2 * 2
    for line in lines:
        assert [c["endpoint"] for c in line["calls"]] == ["responses", "responses"]
        assert len(line["segments"]) == 1 + len(line["drift"])
        trained = [t for s in line["segments"] for t, m in zip(s["tokens"], s["mask"]) if m]
        trained_lps = [lp for s in line["segments"] for lp, m in zip(s["logprobs"], s["mask"]) if m]
        assert (trained, trained_lps) == sampled(line)


async def test_resume_continues_the_run(tmp_path):
    await agent_rl.main([f"run_dir={tmp_path}", "max_steps=4", "save_every=2", "eval_every=0", "n_test=2", "group_size=4"])
    await agent_rl.main([f"run_dir={tmp_path}", "max_steps=6", "save_every=2", "eval_every=0", "n_test=2", "group_size=4"])
    records = check_metrics_file(tmp_path, {"env/all/reward/total"})
    assert [r["step"] for r in records if "env/all/reward/total" in r] == list(range(6))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["max_steps"] == 6 and config["model_name"] == "policy"


async def test_staleness_bound_holds_with_async_groups(tmp_path):
    cfg = AgentRLConfig(url="mock://?max_context=4096", groups_per_batch=2, group_size=4, max_steps=5, max_staleness=1, max_tokens=8)

    async def agent(client, task) -> float:
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task}])
        return float(len(reply.choices[0].message.content or ""))

    await train_agent_rl(cfg, agent, ["x", "y", "z"], [], tmp_path, progress=False)
    lines = read_trajectories(tmp_path / "trajectories.jsonl")
    assert all(len(line["calls"][0]["choices"][0]["tokens"]) <= 8 for line in lines)  # the loop's max_tokens is the default
    steps = [r for r in read_metrics(tmp_path) if "async/staleness_max" in r]
    assert len(steps) == 5 and max(r["async/staleness_max"] for r in steps) <= 1


async def test_an_agent_error_stops_the_run_with_that_error(tmp_path):
    async def broken(client, task) -> float:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        raise RuntimeError("agent bug")

    cfg = AgentRLConfig(url="mock://", groups_per_batch=1, group_size=2, max_steps=2)
    with pytest.raises(RuntimeError, match="agent bug"):
        await train_agent_rl(cfg, broken, ["t"], [], tmp_path, progress=False)


@pytest.mark.parametrize("reward", [None, "1.0", float("nan")])
async def test_an_agent_whose_reward_is_not_a_number_stops_the_run_naming_it(tmp_path, reward):
    """None was a TypeError, "1.0" was trained on as 1.0, NaN failed later as the datums' advantages."""

    async def agent(client, task):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task}], max_tokens=4)
        return reward

    cfg = AgentRLConfig(url="mock://?max_context=2048", groups_per_batch=1, group_size=2, max_steps=1, max_tokens=4)
    with pytest.raises(InvalidInputError) as err:
        await train_agent_rl(cfg, agent, ["a"], [], tmp_path, progress=False)
    assert err.value.field == "reward" and "the agent" in str(err.value)


async def test_a_killed_runs_torn_trajectory_line_is_cut_before_the_resumed_run_appends(tmp_path):
    """The resumed run appended its first record to the torn line, and read_trajectories then failed on the whole
    file with a JSONDecodeError."""

    async def agent(client, task):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task}], max_tokens=4)
        return float(len(task))

    cfg = AgentRLConfig(url="mock://?max_context=2048", groups_per_batch=1, group_size=2, max_steps=1, max_tokens=4, save_every=1)
    await train_agent_rl(cfg, agent, ["a", "bb"], [], tmp_path, progress=False)
    whole = read_trajectories(tmp_path / "trajectories.jsonl")
    with open(tmp_path / "trajectories.jsonl", "a") as f:
        f.write('{"rollout_id": "rollout-to')  # SIGKILL mid-write
    assert read_trajectories(tmp_path / "trajectories.jsonl") == whole  # the torn line left out
    await train_agent_rl(cfg.model_copy(update={"max_steps": 2}), agent, ["a", "bb"], [], tmp_path, progress=False)
    lines = read_trajectories(tmp_path / "trajectories.jsonl")
    assert lines[: len(whole)] == whole and len(lines) > len(whole) and "rollout-to" not in (tmp_path / "trajectories.jsonl").read_text()


async def test_an_agent_past_its_time_limit_scores_0_and_the_run_goes_on(tmp_path, caplog):
    """An agent that never returned (a tool call waiting forever) hung the whole run."""
    hangs = anyio.Event()  # set at teardown: nothing waits on it past the test

    async def agent(client, task) -> float:
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task}], max_tokens=4)
        if task == "hang" and reply.choices[0].message.content is not None:
            await hangs.wait()
        return 1.0

    cfg = AgentRLConfig(url="mock://?max_context=2048", groups_per_batch=2, group_size=2, max_steps=2, max_tokens=4, agent_timeout_s=0.5)
    with caplog.at_level("WARNING", logger="asyncsess.rl"), anyio.fail_after(60):  # a hang guard, not a timing check
        result = await train_agent_rl(cfg, agent, ["hang", "fine"], [], tmp_path, progress=False)
    hangs.set()
    assert result.steps == 2
    steps = [r for r in read_metrics(tmp_path) if "env/all/reward/total" in r]
    assert [r["env/all/agent_timeouts"] for r in steps] == [2.0, 2.0]  # both rollouts of "hang", each step
    assert [r["env/all/reward/total"] for r in steps] == [0.5, 0.5]  # "fine" scored 1, "hang" 0
    lines = read_trajectories(tmp_path / "trajectories.jsonl")
    late = [line for line in lines if line.get("timed_out")]
    assert len(late) == 4 and all(line["reward"] == 0.0 and len(line["calls"]) == 1 for line in late)  # the call it made is kept
    assert sum("agent_timeout_s" in r.getMessage() for r in caplog.records) == 1  # warned once


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), 10**9])
def test_an_agent_time_limit_is_a_finite_number_of_seconds(bad):
    with pytest.raises(ValueError, match="agent_timeout_s"):
        AgentRLConfig(agent_timeout_s=bad)
