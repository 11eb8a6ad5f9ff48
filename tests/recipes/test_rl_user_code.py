"""The RL loop's boundary with user code on mock://: graders, envs and datasets that return what a run cannot
train on stop it with a typed error naming the culprit and the field; their own exceptions come out as themselves."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time

import anyio
import numpy as np
import pytest

from asyncsess.chat import ChatRenderer
from asyncsess.errors import InvalidInputError
from asyncsess.rl import (
    EnvGroupBuilder,
    Problem,
    ProblemGroupBuilder,
    PromptRenderer,
    RLConfig,
    StepResult,
    grading,
    problem_datasets,
    train_rl,
)
from asyncsess.rl.tool_env import ToolEnv
from asyncsess.rl.types import Env, TokensWithLogprobs
from asyncsess.runs.metrics import read_metrics
from asyncsess.types import ModelInput
from asyncsess_mock import CharTokenizer

from .helpers import digit_share

pytestmark = pytest.mark.anyio
PROBLEMS = [Problem(f"Code {i}:", "0") for i in range(4)]
CFG = RLConfig(url="mock://", groups_per_batch=2, group_size=2, max_tokens=4, learning_rate=0.3, lora_rank=4, max_steps=2)


def grader_returning(value):
    def grade(problem, reply):
        return value

    return grade


async def train(grader, run_dir, test=()):
    return await train_rl(CFG, problem_datasets(PROBLEMS, list(test), grader, CFG), run_dir, progress=False)


@pytest.mark.parametrize(
    "returned, field",
    [
        ((math.nan, {}), "reward"),  # was an error about the datums' advantages, after the batch was built
        ((math.inf, {}), "reward"),  # was a silently skipped batch (inf - inf), logged as null
        ((1e308, {}), "reward"),  # the group's mean overflowed to inf
        ((None, {}), "reward"),  # was a TypeError inside an ExceptionGroup
        (("1.0", {}), "reward"),  # was trained on as 1.0
        ((np.array([1.0, 2.0]), {}), "reward"),
        ((0.5, {"x": math.nan}), "metrics"),  # was logged as null, hiding the other episodes' values
        ((0.5, {"x": "yes"}), "metrics"),  # was a TypeError when the step's metrics were averaged
        ((0.5, None), "metrics"),
        (0.5, "grader"),  # not a (reward, metrics) pair
    ],
)
async def test_a_grader_that_returns_no_number_stops_the_run_naming_it(tmp_path, returned, field):
    with pytest.raises(InvalidInputError) as err:
        await train(grader_returning(returned), tmp_path)
    assert err.value.field == field and "grader_returning" in str(err.value) and err.value.fix
    assert read_metrics(tmp_path) == []  # no step was trained or logged


async def test_numpy_and_bool_rewards_are_numbers(tmp_path):
    result = await train(grader_returning((np.float32(0.25), {"correct": True, "n": np.int64(3)})), tmp_path)
    assert result.steps == 2 and read_metrics(tmp_path)[0]["env/all/n"] == 3.0


class GraderError(Exception):
    pass


def raising(problem, reply):
    raise GraderError("cannot grade")


@pytest.mark.parametrize("held_out", [False, True])
async def test_a_grader_that_raises_stops_the_run_with_its_own_error(tmp_path, held_out):
    """In a training group or a held-out evaluation: the grader's exception as itself, not an ExceptionGroup."""
    with pytest.raises(GraderError, match="cannot grade"):
        await train(raising, tmp_path, PROBLEMS[:3] if held_out else ())


class NaNEnv(Env):
    async def initial_observation(self):
        return ModelInput.from_ints([1, 2, 3]), []

    async def step(self, action):
        return StepResult(math.nan, True)


class Builder(EnvGroupBuilder):
    def __init__(self, env: type[Env], group_reward: object = 0.0) -> None:
        self.env, self.group_reward = env, group_reward

    async def make_envs(self):
        return [self.env() for _ in range(CFG.group_size)]

    async def compute_group_rewards(self, trajectories, envs):
        return [(self.group_reward, {}) for _ in trajectories]


class ShortGroupRewards(EnvGroupBuilder):
    """Group rewards for one trajectory of two: the other was dropped from the group silently."""

    async def make_envs(self):
        return [OneEnv() for _ in range(CFG.group_size)]

    async def compute_group_rewards(self, trajectories, envs):
        return [(0.0, {})]


async def test_group_rewards_not_one_per_trajectory_are_refused(tmp_path):
    with pytest.raises(InvalidInputError) as err:
        await train_rl(CFG, lambda tok: (Batches(ShortGroupRewards()), []), tmp_path, progress=False)
    assert err.value.field == "compute_group_rewards" and "ShortGroupRewards" in str(err.value)


class OneEnv(NaNEnv):
    async def step(self, action):
        return StepResult(1.0, True)


class Batches:
    def __init__(self, builder: EnvGroupBuilder) -> None:
        self.builder = builder

    def get_batch(self, index):
        return [self.builder] * CFG.groups_per_batch

    def __len__(self):
        return 1


@pytest.mark.parametrize(
    ("builder", "culprit"), [(Builder(NaNEnv), "NaNEnv.step()"), (Builder(OneEnv, None), "Builder.compute_group_rewards()")]
)
async def test_an_env_or_group_reward_that_is_not_a_number_names_the_class(tmp_path, builder, culprit):
    with pytest.raises(InvalidInputError) as err:
        await train_rl(CFG, lambda tok: (Batches(builder), []), tmp_path, progress=False)
    assert err.value.field == "reward" and culprit in str(err.value)


class Finite:
    """A cookbook-style dataset: batch ``i`` is a slice of the problems, so it ends."""

    def __init__(self, tokenizer, mistake: str) -> None:
        self.renderer, self.mistake = PromptRenderer(tokenizer), mistake

    def get_batch(self, index):
        if self.mistake == "problems":  # the items, not builders
            return PROBLEMS[:2]
        if self.mistake == "none":
            return None
        if self.mistake == "raises" and index >= len(self):
            raise IndexError("batch index out of range")
        return [ProblemGroupBuilder(self.renderer, p, grader_returning((0.0, {})), 2) for p in PROBLEMS[2 * index : 2 * index + 2]]

    def __len__(self):
        return 2


@pytest.mark.parametrize(
    ("mistake", "steps", "message"),
    [
        ("problems", 0, "gave a Problem"),  # was an AttributeError ('Problem' object has no attribute 'make_envs')
        ("none", 0, "gave a NoneType"),  # was a TypeError
        ("slices", 2, "past the end of a finite dataset"),  # was an IndexError at step 2
        ("raises", 2, "raised IndexError"),
    ],
)
async def test_a_batch_that_is_not_groups_per_batch_builders_names_the_dataset(tmp_path, mistake, steps, message):
    cfg = CFG.model_copy(update={"max_steps": 4, "save_every": 1})
    with pytest.raises(InvalidInputError) as err:
        await train_rl(cfg, lambda tok: (Finite(tok, mistake), []), tmp_path, progress=False)
    assert err.value.field == "get_batch" and f"Finite.get_batch({steps})" in str(err.value) and message in str(err.value)
    assert len(read_metrics(tmp_path)) == steps  # the steps before it trained and logged
    assert err.value.fix


async def test_an_empty_problem_list_is_refused_before_the_run(tmp_path):
    with pytest.raises(InvalidInputError) as err:
        problem_datasets([], PROBLEMS, grader_returning((0.0, {})), CFG)
    assert err.value.field == "train"


class ProblemStream:
    """A stateful dataset that yields the problems themselves, not group builders."""

    def next_batch(self):
        return PROBLEMS[:2]

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


async def test_a_stream_of_problems_is_refused_naming_next_batch(tmp_path):
    with pytest.raises(InvalidInputError) as err:  # was an AttributeError ('Problem' object has no attribute 'make_envs')
        await train_rl(CFG, lambda tok: (ProblemStream(), []), tmp_path, progress=False)
    assert err.value.field == "next_batch" and "ProblemStream.next_batch() at batch 0 gave a Problem" in str(err.value)


def returning(kind: str):
    """make_datasets returning ``kind`` of held-out set (or of result)."""

    def make(tokenizer):
        train, test = problem_datasets(PROBLEMS, PROBLEMS[:2], grader_returning((0.0, {})), CFG)(tokenizer)
        return {"none": (train, None), "dataset": (train, train), "triple": (train, test, None), "problems": (train, PROBLEMS)}[kind]

    return make


async def test_no_held_out_set_may_be_none_as_in_the_cookbook(tmp_path):
    result = await train_rl(CFG, returning("none"), tmp_path, progress=False)  # was a TypeError: 'NoneType' is not iterable
    assert result.steps == 2 and result.before == {}


@pytest.mark.parametrize(
    ("kind", "says"),
    [("dataset", "a ProblemDataset (a dataset of batches)"), ("triple", "not a pair"), ("problems", "gave a Problem")],
)
async def test_a_held_out_set_that_is_not_builders_names_make_datasets(tmp_path, kind, says):
    with pytest.raises(InvalidInputError) as err:  # were a TypeError, a ValueError (unpacking) and an AttributeError
        await train_rl(CFG, returning(kind), tmp_path, progress=False)
    assert err.value.field == "make_datasets" and says in str(err.value)


class Gym(Env):
    """An env written to another protocol (``mistake`` says how)."""

    def __init__(self, mistake: str) -> None:
        self.mistake = mistake

    async def initial_observation(self):
        if self.mistake == "tokens":
            return [1, 2, 3], []
        if self.mistake == "no stop":
            return ModelInput.from_ints([1, 2, 3])
        return ModelInput.from_ints([1, 2, 3]), []

    async def step(self, action):
        if self.mistake == "tuple":
            return 1.0, True
        if self.mistake == "next tokens":
            return StepResult(0.0, False, [1, 2, 3, 4], [])  # type: ignore[arg-type]
        return StepResult(0.0, self.mistake != "never done", ModelInput.from_ints([1, 2, 3]), [])


class GymBuilder(EnvGroupBuilder):
    def __init__(self, mistake: str) -> None:
        self.mistake = mistake

    async def make_envs(self):
        return None if self.mistake == "no envs" else [Gym(self.mistake) for _ in range(CFG.group_size)]


@pytest.mark.parametrize(
    ("mistake", "field"),
    [
        ("tokens", "observation"),  # was an AttributeError ('list' object has no attribute 'to_ints')
        ("no stop", "observation"),  # a TypeError
        ("tuple", "step"),  # gym's (reward, done): an AttributeError
        ("next tokens", "observation"),
        ("no envs", "make_envs"),  # a TypeError
        ("never done", "episode_done"),  # sampled forever: the run never ended
    ],
)
async def test_an_env_of_another_protocol_is_refused_naming_it(tmp_path, monkeypatch, mistake, field):
    monkeypatch.setattr("asyncsess.rl.rollouts.MAX_TURNS", 5)
    with pytest.raises(InvalidInputError) as err:
        await train_rl(CFG, lambda tok: (Batches(GymBuilder(mistake)), []), tmp_path, progress=False)
    assert err.value.field == field and ("Gym" in str(err.value)) and err.value.fix


class Completer:
    """A ``make_completer`` policy that answers ``reply``."""

    def __init__(self, reply) -> None:
        self.reply = reply

    async def __call__(self, model_input, stop):
        return self.reply


@pytest.mark.parametrize(
    "reply",
    [
        ([5], [-1.0]),  # a tuple: an AttributeError
        TokensWithLogprobs([5, 6], None, "stop"),  # type: ignore[arg-type]
        TokensWithLogprobs([5, 6], [-1.0], "stop"),  # a ValueError once its datum was built
        TokensWithLogprobs([5, 6], [-1.0, math.nan], "stop"),  # refused by forward_backward, naming the datum
        TokensWithLogprobs([5.0, 6.0], [-1.0, -1.0], "stop"),  # type: ignore[list-item]
    ],
)
async def test_a_completer_whose_action_is_not_tokens_with_logprobs_is_refused_naming_it(tmp_path, reply):
    def varied(problem, text):
        return float(len(text)), {}

    with pytest.raises(InvalidInputError) as err:
        await train_rl(
            CFG, problem_datasets(PROBLEMS, [], varied, CFG), tmp_path, progress=False, make_completer=lambda *a: Completer(reply)
        )
    assert err.value.field == "make_completer" and "Completer returned" in str(err.value)


class GroupCompleter(Completer):
    async def complete_group(self, model_input, stop, n):
        return self.reply


@pytest.mark.parametrize("reply", [[TokensWithLogprobs([5], [-1.0], "stop")], [([5], [-1.0])] * CFG.group_size])
async def test_a_completers_group_actions_are_checked_too(tmp_path, reply):
    with pytest.raises(InvalidInputError) as err:  # one action for two envs: the second env got none (an IndexError)
        await train_rl(
            CFG,
            problem_datasets(PROBLEMS, [], grader_returning((0.0, {})), CFG),
            tmp_path,
            progress=False,
            make_completer=lambda *a: GroupCompleter(reply),
        )
    assert err.value.field == "make_completer" and "GroupCompleter" in str(err.value)


@pytest.fixture
def release():
    """An Event set at teardown, so that a grader thread left waiting on it ends."""
    event = threading.Event()
    yield event
    event.set()


@pytest.mark.parametrize("how", ["sleeps", "spins"])
async def test_a_grader_past_its_time_limit_scores_0_and_the_run_goes_on(tmp_path, release, caplog, how):
    """A grader that blocked (time.sleep, a busy loop) ran on the event loop and froze every rollout and the trainer;
    now it runs in a thread, and past grader_timeout_s its episode scores 0 and is counted, once per episode."""
    calls = itertools.count()

    def hanging_twice(problem, reply):
        if next(calls) < 2:  # two of step 0's four episodes
            if how == "sleeps":
                release.wait(5)
            else:  # holds the GIL but for the interpreter's switches
                while not release.is_set():
                    pass
        return 1.0, {"correct": 1.0}

    hanging_twice.__qualname__ = f"hanging_twice_{how}"  # a name of its own: the warning comes once per grader

    data = problem_datasets(PROBLEMS, [], hanging_twice, CFG, grader_timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="asyncsess.rl"):
        result = await train_rl(CFG, data, tmp_path, progress=False)
    first, second = [r for r in read_metrics(tmp_path) if "env/all/reward/total" in r]
    assert result.steps == 2
    assert first["env/all/grader_timeouts"] == 2.0 and first["env/all/reward/total"] == 0.5  # counted, not averaged
    assert first["env/all/correct"] == 1.0  # the other episodes of the batch were graded
    assert second["env/all/reward/total"] == 1.0 and "env/all/grader_timeouts" not in second
    warnings = [r.getMessage() for r in caplog.records if hanging_twice.__qualname__ in r.getMessage()]
    assert len(warnings) == 1 and "grader_timeout_s" in warnings[0]


@pytest.mark.parametrize("limit", [0, -1.0, math.nan, math.inf, 1e10, "30", True, None])  # 1e10: an OverflowError mid-run
async def test_a_grader_time_limit_is_a_finite_number_of_seconds(limit):
    with pytest.raises(InvalidInputError) as err:
        problem_datasets(PROBLEMS, [], digit_share, CFG, grader_timeout_s=limit)
    assert err.value.field == "grader_timeout_s" and err.value.fix
    with pytest.raises(InvalidInputError) as err:
        ToolEnv(ChatRenderer(CharTokenizer()), [], [], async_grade, grader_timeout_s=limit if limit is not None else 0)
    assert err.value.field == "grader_timeout_s"


async def async_grade(text):
    await anyio.sleep(3600)
    return 1.0, {}


async def test_a_tool_env_grade_past_its_time_limit_scores_0():
    """ToolEnv awaited its grade with no bound: one that never returned hung the run."""
    tok = CharTokenizer()
    env = ToolEnv(ChatRenderer(tok), [{"role": "user", "content": "go"}], [], async_grade, grader_timeout_s=0.1)
    await env.initial_observation()
    with anyio.fail_after(30):  # hang guard
        result = await env.step(tok.encode("done", add_special_tokens=False))
    assert result.episode_done and result.reward == 0.0 and result.metrics == {"grader_timeouts": 1.0, "tool_calls": 0.0}


async def test_at_most_grader_threads_graders_run_at_once(monkeypatch):
    """Graders run in threads, a bounded number at a time (the rest wait for one, outside their time limit)."""
    monkeypatch.setattr(grading, "INLINE_WAIT_S", 0.0)  # every wait off the loop: all six start together
    running, most, lock = 0, 0, threading.Lock()

    def slow(problem, reply):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.3)
        with lock:
            running -= 1
        return 1.0, {}

    results = []

    async def one():
        results.append(await grading.grade_in_thread(slow, PROBLEMS[0], "", timeout_s=30))

    with anyio.fail_after(30):  # hang guard
        async with anyio.create_task_group() as tg:
            for _ in range(grading.GRADER_THREADS + 2):
                tg.start_soon(one)
    assert most == grading.GRADER_THREADS and results == [(1.0, {})] * (grading.GRADER_THREADS + 2)
