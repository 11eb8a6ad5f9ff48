"""Single-turn problem rollouts: render a problem as a chat prompt, sample a group of answers, grade them,
turn the group into RL datums, and evaluate held-out accuracy greedily."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

from ..chat import chat_tokens, turn_stop_tokens
from ..client import SamplingClient
from ..types import Datum, SamplingParams
from .data import center_advantages, rl_datum

__all__ = ["Problem", "Grader", "Rollout", "Group", "PromptRenderer", "sample_group", "evaluate", "problems_for_step"]


@dataclass(frozen=True)
class Problem:
    """A question put to the model as one user message, and its reference answer."""

    question: str
    answer: str
    system: str | None = None

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, {"role": "user", "content": self.question}]


# (problem, decoded reply) -> (reward, metrics such as {"correct": 1.0})
Grader = Callable[[Problem, str], tuple[float, dict[str, float]]]


@dataclass
class Rollout:
    tokens: list[int]
    logprobs: list[float]
    text: str
    stop_reason: str
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Group:
    """``len(rollouts)`` answers to one problem, sampled from the weights after ``sampler_step`` optimizer steps."""

    problem: Problem
    prompt: list[int]
    rollouts: list[Rollout]
    sampler_step: int
    seconds: float = 0.0

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    def datums(self, normalize_std: bool = False) -> list[tuple[Datum, list[float]]]:
        """RL datums of the rollouts with a non-zero advantage, each with its action mask."""
        out = []
        for r, adv in zip(self.rollouts, center_advantages(self.rewards, normalize_std=normalize_std)):
            if adv != 0.0 and r.tokens:
                mask = [0.0] * (len(self.prompt) - 1) + [1.0] * len(r.tokens)
                out.append((rl_datum(self.prompt, r.tokens, r.logprobs, adv), mask))
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        return cls(
            problem=Problem(**d["problem"]),
            prompt=list(d["prompt"]),
            rollouts=[Rollout(**r) for r in d["rollouts"]],
            sampler_step=int(d["sampler_step"]),
            seconds=float(d.get("seconds", 0.0)),
        )


class PromptRenderer:
    """Problems as chat prompts for one tokenizer, with the tokens that end the assistant's turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.stop: list[int] = turn_stop_tokens(tokenizer)
        self._cache: dict[Problem, list[int]] = {}

    def prompt(self, problem: Problem) -> list[int]:
        if problem not in self._cache:
            self._cache[problem] = chat_tokens(self.tokenizer, problem.messages(), add_generation_prompt=True)
        return self._cache[problem]

    def reply(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def params(self, max_tokens: int, temperature: float, seed: int | None = None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=list(self.stop), seed=seed)


async def sample_group(
    sampler: SamplingClient,
    renderer: PromptRenderer,
    problem: Problem,
    grader: Grader,
    group_size: int,
    params: SamplingParams,
    sampler_step: int,
) -> Group:
    """Sample ``group_size`` answers to ``problem`` in one request and grade them."""
    start = time.perf_counter()
    prompt = renderer.prompt(problem)
    result = await sampler.sample(prompt, group_size, params)
    rollouts = []
    for seq in result.sequences:
        text = renderer.reply(seq.tokens)
        reward, metrics = grader(problem, text)
        rollouts.append(Rollout(list(seq.tokens), list(seq.logprobs or []), text, seq.stop_reason, float(reward), dict(metrics)))
    return Group(problem, prompt, rollouts, sampler_step, time.perf_counter() - start)


async def evaluate(
    sampler: SamplingClient, renderer: PromptRenderer, problems: Sequence[Problem], grader: Grader, max_tokens: int
) -> tuple[dict[str, float], list[str]]:
    """Greedy (temperature 0) accuracy on ``problems``: mean ``reward`` and grader metrics, and the replies."""
    params = renderer.params(max_tokens, temperature=0.0)
    replies: list[str] = [""] * len(problems)
    scores: list[tuple[float, dict[str, float]]] = [(0.0, {})] * len(problems)

    async def one(i: int) -> None:
        result = await sampler.sample(renderer.prompt(problems[i]), 1, params)
        replies[i] = renderer.reply(result.sequences[0].tokens)
        scores[i] = grader(problems[i], replies[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(problems)):
            tg.start_soon(one, i)
    n = max(1, len(problems))
    metrics = {"reward/total": sum(r for r, _ in scores) / n}
    for key in sorted({k for _, m in scores for k in m}):
        metrics[key] = sum(m.get(key, 0.0) for _, m in scores) / n
    return metrics, replies


def problems_for_step(problems: Sequence[Problem], step: int, batch_size: int, seed: int) -> list[Problem]:
    """Batch ``step`` of an endless epoch-shuffled pass over ``problems`` (deterministic, so resumable)."""
    n = len(problems)
    return [problems[_epoch_order(n, seed, k // n)[k % n]] for k in range(step * batch_size, (step + 1) * batch_size)]


@functools.lru_cache(maxsize=8)
def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
