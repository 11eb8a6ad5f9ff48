"""Single-turn problems as one-step envs, and datasets of problems.

A :class:`Problem` is a question put to the model as one user message; a :class:`ProblemEnv` renders it as a
chat prompt (:class:`PromptRenderer`), takes one reply, grades it with a :data:`Grader` and ends the episode.
:class:`ProblemGroupBuilder` makes ``group_size`` of them for one problem (the loop samples such a group in
one request, since its envs share their first observation). :class:`ProblemDataset` serves batches of builders
from an endless, epoch-shuffled pass over any problems (deterministic, so resumable), and
:func:`problem_datasets` is what :func:`asyncsess.rl.train.train_rl` takes for a single-turn recipe.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..chat import chat_tokens, turn_stop_tokens
from ..errors import InvalidInputError
from ..types import ModelInput
from .grading import GRADER_TIMEOUT_S, check_timeout, grade_in_thread, grader_name, timed_out
from .types import Action, Env, EnvGroupBuilder, Observation, RLDataset, StepResult, StopCondition, check_reward

__all__ = [
    "Problem",
    "Grader",
    "PromptRenderer",
    "ProblemEnv",
    "ProblemGroupBuilder",
    "ProblemDataset",
    "problem_datasets",
    "problems_for_step",
]


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


class PromptRenderer:
    """Problems as chat prompts for one tokenizer, with the tokens that end the assistant's turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.stop: list[int] = turn_stop_tokens(tokenizer)
        self._cache: dict[Problem, ModelInput] = {}

    def observation(self, problem: Problem) -> ModelInput:
        """The problem's chat prompt (the same object for the same problem)."""
        if problem not in self._cache:
            self._cache[problem] = ModelInput.from_ints(chat_tokens(self.tokenizer, problem.messages(), add_generation_prompt=True))
        return self._cache[problem]

    def prompt(self, problem: Problem) -> list[int]:
        return self.observation(problem).to_ints()

    def reply(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)


class ProblemEnv(Env):
    """One reply to one problem, graded in a thread (:mod:`.grading`); the episode ends after it. A grader that has
    not returned within ``grader_timeout_s`` seconds scores the reply 0 with the metric ``grader_timeouts`` = 1."""

    def __init__(self, renderer: PromptRenderer, problem: Problem, grader: Grader, grader_timeout_s: float = GRADER_TIMEOUT_S) -> None:
        self.renderer, self.problem, self.grader = renderer, problem, grader
        self.grader_timeout_s = check_timeout(grader_timeout_s)

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.renderer.observation(self.problem), list(self.renderer.stop)

    async def step(self, action: Action) -> StepResult:
        graded = await grade_in_thread(self.grader, self.problem, self.renderer.reply(action), timeout_s=self.grader_timeout_s)
        if graded is None:
            reward, metrics = timed_out(self.grader, self.grader_timeout_s)
            return StepResult(reward, True, metrics=metrics)
        source = f"the grader {grader_name(self.grader)}"
        if not isinstance(graded, tuple) or len(graded) != 2:
            raise InvalidInputError(f"{source} returned {graded!r:.60}", field="grader", fix="return (reward, metrics), e.g. (1.0, {})")
        reward, metrics = check_reward(*graded, source)
        return StepResult(reward, True, metrics=metrics)


class ProblemGroupBuilder(EnvGroupBuilder):
    """``group_size`` envs of one problem."""

    def __init__(
        self, renderer: PromptRenderer, problem: Problem, grader: Grader, group_size: int, grader_timeout_s: float = GRADER_TIMEOUT_S
    ) -> None:
        self.renderer, self.problem, self.grader, self.group_size = renderer, problem, grader, group_size
        self.grader_timeout_s = check_timeout(grader_timeout_s)

    async def make_envs(self) -> list[Env]:
        return [ProblemEnv(self.renderer, self.problem, self.grader, self.grader_timeout_s) for _ in range(self.group_size)]


class ProblemDataset:
    """``groups_per_batch`` problems per batch from an endless, epoch-shuffled pass (deterministic, so resumable)."""

    def __init__(self, problems: Sequence[Any], groups_per_batch: int, make_builder: Callable[[Any], EnvGroupBuilder], seed: int = 0):
        if not problems:
            raise InvalidInputError("no problems", field="problems", fix="pass at least one training problem")
        self.problems, self.groups_per_batch, self.make_builder, self.seed = list(problems), groups_per_batch, make_builder, seed

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return [self.make_builder(p) for p in problems_for_step(self.problems, index, self.groups_per_batch, self.seed)]

    def __len__(self) -> int:
        """Batches per epoch."""
        return -(-len(self.problems) // self.groups_per_batch)


class BatchShape(Protocol):
    """The settings a problem dataset takes from a run's config."""

    groups_per_batch: int
    group_size: int
    seed: int


def problem_datasets(
    train: Sequence[Problem], test: Sequence[Problem], grader: Grader, config: BatchShape, *, grader_timeout_s: float = GRADER_TIMEOUT_S
) -> Callable[[Any], tuple[RLDataset, list[EnvGroupBuilder]]]:
    """``make_datasets(tokenizer)`` for :func:`asyncsess.rl.train.train_rl`: ``train`` in batches of
    ``groups_per_batch`` groups of ``group_size``, and one greedy episode per ``test`` problem, each graded within
    ``grader_timeout_s`` seconds (see :class:`ProblemEnv`). An empty ``train`` or a limit that is not a finite
    number > 0 is refused here, before a run starts."""
    if not train:
        raise InvalidInputError("no training problems", field="train", fix="pass at least one training problem")
    grader_timeout_s = check_timeout(grader_timeout_s)

    def make(tokenizer: Any) -> tuple[RLDataset, list[EnvGroupBuilder]]:
        renderer = PromptRenderer(tokenizer)
        data = ProblemDataset(
            train,
            config.groups_per_batch,
            lambda p: ProblemGroupBuilder(renderer, p, grader, config.group_size, grader_timeout_s),
            config.seed,
        )
        return data, [ProblemGroupBuilder(renderer, p, grader, 1, grader_timeout_s) for p in test]

    return make


def problems_for_step(problems: Sequence[Any], step: int, batch_size: int, seed: int) -> list[Any]:
    """Batch ``step`` of an endless epoch-shuffled pass over ``problems`` (deterministic, so resumable)."""
    n = len(problems)
    return [problems[_epoch_order(n, seed, k // n)[k % n]] for k in range(step * batch_size, (step + 1) * batch_size)]


@functools.lru_cache(maxsize=8)
def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
