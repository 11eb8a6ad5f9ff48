"""The math_rl GRPO loop on local:// with the tiny random Llama (CPU): held-out greedy accuracy rises.

A random 2-layer model cannot do arithmetic, and GRPO needs some reward to start from, so the task is
a single-token answer the base model already gives now and then: on the tiny corpus' own "what is
23 plus 45?" prompts, answer with one fixed readable token that the base model samples but does not
prefer (chosen by probing it first). Held-out prompts share no question with the training ones; the
test checks that greedy decoding on them moves to the rewarded answer. No wall-clock limit is asserted.
"""

import collections
import random

import pytest

from asyncsess import SamplingParams, ServiceClient
from asyncsess.rl import Problem, PromptRenderer, RLConfig, problem_datasets, train_rl
from asyncsess.runs.metrics import read_metrics

pytestmark = [pytest.mark.anyio, pytest.mark.local]
URL = "local://?device=cpu"
WORDS = "the a one two three cat dog bird red green blue small large model token hello world".split()


def questions(n: int, seed: int, exclude: set[str] = frozenset()) -> list[str]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        q = f"{' '.join(rng.choice(WORDS) for _ in range(4))}. what is {rng.randint(0, 99)} plus {rng.randint(0, 99)}?"
        if q not in exclude and q not in out:
            out.append(q)
    return out


async def sometimes_said(questions: list[str]) -> str:
    """A readable first token the base model samples on these prompts, but not its most frequent one."""
    async with ServiceClient(URL) as svc:
        sampler = await svc.create_sampling_client(base_model="tiny-llama")
        renderer = PromptRenderer(sampler.get_tokenizer())
        counts: collections.Counter[str] = collections.Counter()
        for q in questions:
            result = await sampler.sample(renderer.prompt(Problem(q, "")), 16, SamplingParams(max_tokens=1, seed=1))
            counts.update(renderer.reply(s.tokens) for s in result.sequences)
    readable = [t for t, _ in counts.most_common() if t.strip().isalnum()]
    return readable[1]


def exact(problem: Problem, reply: str) -> tuple[float, dict[str, float]]:
    return float(reply == problem.answer), {"correct": float(reply == problem.answer)}


async def test_math_rl_loop_raises_held_out_accuracy_on_the_tiny_model(tmp_path):
    test_q = questions(50, seed=1)
    train_q = questions(200, seed=0, exclude=set(test_q))
    target = await sometimes_said(train_q[:16])
    train, test = [Problem(q, target) for q in train_q], [Problem(q, target) for q in test_q]
    cfg = RLConfig(url=URL, base_model="tiny-llama", lora_rank=8, lora_alpha=16, learning_rate=3e-3, max_tokens=1, max_steps=15, seed=0)
    result = await train_rl(cfg, problem_datasets(train, test, exact, cfg), tmp_path, progress=False)
    before, after = result.before["test/env/all/correct"], result.after["test/env/all/correct"]
    assert before < 0.5 and after >= before + 0.5, (target, before, after)


@pytest.mark.torch
async def test_a_staleness_2_run_with_off_policy_correction_learns_on_the_tiny_model(tmp_path):
    """The same task with sampling two steps ahead and the default correction (TIS, cap 2)."""
    test_q = questions(50, seed=1)
    train_q = questions(200, seed=0, exclude=set(test_q))
    target = await sometimes_said(train_q[:16])
    train, test = [Problem(q, target) for q in train_q], [Problem(q, target) for q in test_q]
    cfg = RLConfig(
        url=URL,
        base_model="tiny-llama",
        lora_rank=8,
        lora_alpha=16,
        learning_rate=3e-3,
        max_tokens=1,
        max_steps=15,
        seed=0,
        max_staleness=2,
    )
    assert cfg.off_policy == "tis"
    result = await train_rl(cfg, problem_datasets(train, test, exact, cfg), tmp_path, progress=False)
    before, after = result.before["test/env/all/correct"], result.after["test/env/all/correct"]
    assert before < 0.5 and after >= before + 0.5, (target, before, after)
    records = [r for r in read_metrics(tmp_path) if "off_policy/is_weight_max" in r]
    assert records and max(r["async/staleness_max"] for r in records) == 2
    assert all(0 < r["off_policy/is_weight_max"] <= 2.0 and r["off_policy/kl"] >= 0 for r in records)
