"""Train an unmodified OpenAI function-calling agent with GRPO through asyncsess's OpenAI front.

The agent (``examples/calculator_agent.py``) imports only ``openai``: it asks an arithmetic question,
calls a ``calc`` tool as often as it likes (up to 3 turns) and answers. Each rollout gets an
``openai.AsyncOpenAI`` that talks in-process to the front, which renders the chat with the model's template,
samples, parses tool calls and captures the exact tokens and log-probs; the loop trains on them.

Reward: 1 when the final reply contains the right number, plus ``digit_bonus`` × the share of digits in the
reply (a signal a model that cannot do arithmetic yet can climb; the mock's bigram model learns it).
Settings are ``key=value`` overrides of :class:`AgentRLConfig`:

    python examples/agent_rl.py                                   # mock:// (seconds)
    python examples/agent_rl.py url=local:// base_model=HuggingFaceTB/SmolLM2-135M-Instruct run_dir=runs/agent
"""

from __future__ import annotations

import random
import re
import sys
from typing import Any

import anyio
from pydantic import Field

from asyncsess.rl import AgentRLConfig, RLResult, train_agent_rl
from asyncsess.runs import parse_overrides, print_before_after

try:
    from examples.calculator_agent import solve
except ModuleNotFoundError:  # run as a script: its folder is on the path
    from calculator_agent import solve  # type: ignore[no-redef]


class AgentRecipeConfig(AgentRLConfig):
    n_tasks: int = Field(default=64, ge=1)
    n_test: int = Field(default=8, ge=1)
    digit_bonus: float = 1.0


DEFAULTS = AgentRecipeConfig(
    url="mock://?max_context=4096",
    base_model="mock/bigram-tiny",
    lora_rank=8,
    learning_rate=1.0,
    groups_per_batch=4,
    group_size=8,
    max_tokens=48,
    loss_fn="importance_sampling",
    max_steps=20,
    eval_every=10,
    save_every=10,
)


def tasks(n: int, seed: int) -> list[dict[str, Any]]:
    """Two-operand arithmetic questions with their answers."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        out.append({"question": f"What is {a} {op} {b}?", "answer": str(eval(f"{a}{op}{b}"))})
    return out


def reward(reply: str, answer: str, digit_bonus: float) -> float:
    right = answer in re.findall(r"-?\d+", reply)
    return float(right) + digit_bonus * sum(c.isdigit() for c in reply) / max(1, len(reply))


async def main(args: list[str]) -> RLResult:
    opts = parse_overrides(args)
    run_dir = opts.pop("run_dir", "runs/agent_rl")
    cfg = AgentRecipeConfig.model_validate({**DEFAULTS.model_dump(), **opts})
    every = tasks(cfg.n_tasks + cfg.n_test, cfg.seed)

    async def agent(client: Any, task: dict[str, Any]) -> float:
        reply = await solve(client, task["question"], model=cfg.model_name)
        return reward(reply, task["answer"], cfg.digit_bonus)

    result = await train_agent_rl(cfg, agent, every[: cfg.n_tasks], every[cfg.n_tasks :], run_dir)
    print_before_after(result.before, result.after, f"agent_rl: {result.steps} steps, {result.train_seconds:.0f} s of training")
    return result


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
