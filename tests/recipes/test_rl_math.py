"""RL math against hand-derived numbers (docs/losses.md), groups, problem batches and the task graders."""

import pytest

from asyncsess import ServiceClient
from asyncsess.rl import (
    Problem,
    ProblemEnv,
    PromptRenderer,
    TokensWithLogprobs,
    Trajectory,
    TrajectoryGroup,
    Transition,
    group_datums,
    rl_datum,
)
from asyncsess.rl.data import is_constant, kl_penalty, sample_train_kl
from asyncsess.rl.problem_env import problems_for_step
from asyncsess.tasks import arithmetic, gsm8k
from asyncsess.types import ModelInput


def test_kl_penalty_matches_the_worked_numbers():
    one = kl_penalty([[-0.7, -1.1, -2.6]], [[-0.9, -1.0, -2.0]], [[1, 1, 1]], 0.1)
    assert one[0] == pytest.approx([-0.036667, -0.006667, 0.043333], abs=1e-6)
    two = kl_penalty([[-0.7, -1.1, -2.6], [0, -0.4, -0.3]], [[-0.9, -1.0, -2.0], [0, -0.2, -0.6]], [[1, 1, 1], [0, 1, 1]], 0.1)
    assert two[0] == pytest.approx([-0.028, 0.002, 0.052], abs=1e-6)
    assert two[1] == pytest.approx([0, 0.012, -0.038], abs=1e-6)


def test_sample_train_kl_uses_only_masked_tokens():
    m = sample_train_kl([[0.0, -0.5, -0.8], [-9.0, -1.0]], [[5.0, -0.4, -0.9], [7.0, -1.2]], [[0, 1, 1], [0, 1]])
    diffs = [-0.1, 0.1, 0.2]
    assert m["optim/kl_sample_train_v1"] == pytest.approx(sum(diffs) / 3)
    assert m["optim/kl_sample_train_v2"] == pytest.approx(0.5 * sum(d * d for d in diffs) / 3)
    assert m["optim/entropy"] == pytest.approx((0.5 + 0.8 + 1.0) / 3)
    assert sample_train_kl([[0.0]], [[0.0]], [[0]]) == {}


def one_step(prompt: list[int], tokens: list[int], logprobs: list[float], reward: float) -> Trajectory:
    return Trajectory([Transition(ModelInput.from_ints(prompt), TokensWithLogprobs(tokens, logprobs, "stop"), reward, True)], "completed")


def test_constant_groups_give_no_datums_and_others_carry_advantages():
    assert is_constant([1, 1, 1]) and not is_constant([1, 0])
    a, b = one_step([1, 2, 3], [5, 6], [-0.1, -0.2], 1.0), one_step([1, 2, 3], [7], [-0.3], 0.0)
    pairs = group_datums(TrajectoryGroup([a, b], [0.0, 0.0], [{}, {}]))
    assert [d.loss_fn_inputs["advantages"].data for d, _ in pairs] == [[0, 0, 0.5, 0.5], [0, 0, -0.5]]
    assert [m for _, m in pairs] == [[0, 0, 1, 1], [0, 0, 1]]
    # a one-step trajectory's datum is the single-turn datum of its prompt and completion
    assert pairs[0][0] == rl_datum([1, 2, 3], [5, 6], [-0.1, -0.2], 0.5)
    assert group_datums(TrajectoryGroup([a, a], [0.0, 0.0], [{}, {}])) == []
    normed = group_datums(TrajectoryGroup([a, b], [0.0, 0.0], [{}, {}]), normalize_std=True)
    assert normed[0][0].loss_fn_inputs["advantages"].data[-1] == pytest.approx(1.0, rel=1e-5)


@pytest.mark.anyio
async def test_a_problem_env_is_one_graded_step():
    async with ServiceClient("mock://") as svc:
        tokenizer = (await svc.create_sampling_client(base_model="mock/bigram-tiny")).get_tokenizer()
    renderer = PromptRenderer(tokenizer)
    problem = Problem("2+2?", "4")
    env = ProblemEnv(renderer, problem, lambda p, reply: (float(reply == p.answer), {"correct": float(reply == p.answer)}))
    ob, stop = await env.initial_observation()
    assert ob.to_ints() == renderer.prompt(problem) and stop == renderer.stop and stop
    result = await env.step(tokenizer.encode("4", add_special_tokens=False))
    assert result.episode_done and result.reward == 1.0 and result.metrics == {"correct": 1.0}
    wrong = await ProblemEnv(renderer, problem, env.grader).step(tokenizer.encode("5", add_special_tokens=False))
    assert wrong.episode_done and wrong.reward == 0.0 and wrong.metrics == {"correct": 0.0}


def test_problem_batches_are_deterministic_and_cover_each_epoch():
    problems = [Problem(str(i), str(i)) for i in range(10)]
    epoch = [p for s in range(5) for p in problems_for_step(problems, s, 2, seed=3)]
    assert sorted(p.question for p in epoch) == sorted(p.question for p in problems)
    assert problems_for_step(problems, 7, 2, seed=3) == problems_for_step(problems, 7, 2, seed=3)
    assert problems_for_step(problems, 0, 2, seed=3) != problems_for_step(problems, 0, 2, seed=4)


def test_arithmetic_split_is_disjoint_and_graded_by_the_final_number():
    train, test = arithmetic.split(300, 100, seed=0)
    assert len(test) == 100 and not {p.question for p in train} & {p.question for p in test}
    p = test[0]
    assert p.question.endswith("? Reply with only the number.")
    a, op, b = p.question.split()[2:5]
    assert int(p.answer) == (int(a) + int(b.rstrip("?")) if op == "+" else int(a) - int(b.rstrip("?")))
    assert arithmetic.grade(Problem("q", "68"), " 68") == (1.0, {"correct": 1.0, "format": 1.0})
    assert arithmetic.grade(Problem("q", "68"), "It is 68.") == (1.0, {"correct": 1.0, "format": 0.0})
    assert arithmetic.grade(Problem("q", "-3"), "-3")[0] == 1.0
    assert arithmetic.grade(Problem("q", "68"), "23 + 45 = 68") == (1.0, {"correct": 1.0, "format": 0.0})
    assert arithmetic.grade(Problem("q", "68"), "68? No, 23 + 45 = 67")[0] == 0.0
    assert arithmetic.grade(Problem("q", "68"), "To add 23 and 45, we")[0] == 0.0


def test_gsm8k_answers_after_hashes(tmp_path):
    assert gsm8k.final_answer("so 3*4=12\n#### 1,200") == "1200"
    assert gsm8k.final_answer("#### 7.50") == "7.5" and gsm8k.final_answer("#### $18") == "18"
    assert gsm8k.final_answer("no marker 12") is None
    path = tmp_path / "g.jsonl"
    path.write_text('{"question": "Q?", "answer": "work\\n#### 42"}\n')
    [p] = gsm8k.load(path=path)
    assert p.answer == "42" and p.question.startswith("Q?")
    assert gsm8k.grade(p, "thinking... #### 42")[0] == 1.0
    assert gsm8k.grade(p, "42") == (0.0, {"correct": 0.0, "format": 0.0})


class CountingPolicy:
    """Replies ``[7]`` (log-prob -1) and counts single and group requests."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    async def __call__(self, model_input, stop):
        self.calls.append(1)
        return TokensWithLogprobs([7], [-1.0], "stop")

    async def complete_group(self, model_input, stop, n):
        self.calls.append(n)
        return [TokensWithLogprobs([7 + i], [-1.0], "stop") for i in range(n)]


@pytest.mark.anyio
async def test_a_group_sharing_its_first_observation_is_sampled_in_one_request():
    from asyncsess.rl import Env, EnvGroupBuilder, StepResult, do_group_rollout

    class OneStep(Env):
        def __init__(self, prompt: list[int]) -> None:
            self.prompt = prompt

        async def initial_observation(self):
            return ModelInput.from_ints(self.prompt), [0]

        async def step(self, action):
            return StepResult(float(action[0]), True)

    class Builder(EnvGroupBuilder):
        def __init__(self, prompts: list[list[int]]) -> None:
            self.prompts = prompts

        async def make_envs(self):
            return [OneStep(p) for p in self.prompts]

    policy = CountingPolicy()
    group = await do_group_rollout(Builder([[1, 2], [1, 2], [1, 2]]), policy, sampler_step=4)
    assert policy.calls == [3] and group.sampler_step == 4
    assert [t.reward for t in group.trajectories] == [7.0, 8.0, 9.0]  # each env got its own sample, in order
    policy = CountingPolicy()
    await do_group_rollout(Builder([[1, 2], [1, 3]]), policy)  # different prompts: one request each
    assert policy.calls == [1, 1]
