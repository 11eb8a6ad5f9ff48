"""Code RL: the model writes Python for stdin/stdout problems, a sandbox runs it against the tests.

Reward 1 when the last reply's ```python block passes every test, 0 when not, -0.1 without a code block.
Two turns: the model may first call ``check_solution(code)`` (a tool call in its own chat format), read the
verdict, and answer. Sampling and training overlap with at most ``max_staleness`` steps of staleness,
``forward_backward`` streams in ``num_minibatches`` sub-batches per step, the loss is ``cispo`` with explicit
thresholds. Problems: the bundled ``examples/data/code_problems.jsonl`` (20 easy ones, the last ``n_test``
held out) or DeepCoder-style JSONL files. Settings are ``key=value`` overrides of :class:`CodeRLConfig`:

    python examples/code_rl.py                                    # mock:// (a bigram model: it writes no code)
    python examples/code_rl.py url=local:// base_model=Qwen/Qwen3-0.6B max_tokens=1024 context_window=32768 run_dir=runs/code
    python examples/code_rl.py train_path=deepcoder_train.jsonl test_path=lcb_test.jsonl sandbox=fusion sandbox_url=http://localhost:8080
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import anyio
from pydantic import Field

from asyncsess.backends import Tokenizer
from asyncsess.rl import ChatRenderer, EnvGroupBuilder, MakeCompleter, ProblemDataset, RLConfig, RLResult, train_rl
from asyncsess.runs import parse_overrides, print_before_after
from asyncsess.sandbox import LocalSandbox, Sandbox, SandboxFusionClient
from asyncsess.tasks import code

BUNDLED = Path(__file__).parent / "data" / "code_problems.jsonl"


class CodeRLConfig(RLConfig):
    train_path: str | None = None  # default: the bundled problems
    test_path: str | None = None  # default: the last n_test problems of train_path
    n_test: int = Field(default=5, ge=1)
    max_turns: int = Field(default=2, ge=1)
    sandbox: Literal["local", "fusion"] = "local"
    sandbox_url: str | None = None  # fusion: default $SANDBOX_URL or http://localhost:8080/run_code
    sandbox_timeout_s: float = Field(default=6.0, gt=0.0, le=3600.0)
    sandbox_concurrency: int | None = Field(default=None, ge=1)  # local: default the CPU count


DEFAULTS = CodeRLConfig(
    url="mock://?max_context=8192",
    base_model="mock/bigram-tiny",
    lora_rank=32,
    lora_alpha=64,
    learning_rate=4e-5,
    groups_per_batch=8,
    group_size=8,
    max_tokens=512,
    temperature=1.0,
    context_window=8192,  # an episode ends (context_overflow, reward -0.1) before its conversation reaches this
    loss_fn="cispo",
    loss_fn_config={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    max_staleness=3,
    num_minibatches=4,
    max_steps=50,
    eval_every=10,
    save_every=10,
)


def problems(cfg: CodeRLConfig) -> tuple[list[code.CodeProblem], list[code.CodeProblem]]:
    train = code.load(cfg.train_path or BUNDLED)
    if cfg.test_path is not None:
        return train, code.load(cfg.test_path, limit=cfg.n_test)
    cut = max(1, len(train) - cfg.n_test)
    return train[:cut], train[cut:]


@contextlib.asynccontextmanager
async def open_sandbox(cfg: CodeRLConfig) -> AsyncIterator[Sandbox]:
    if cfg.sandbox == "fusion":
        async with SandboxFusionClient(
            cfg.sandbox_url, max_concurrency=cfg.sandbox_concurrency or 32, timeout_s=cfg.sandbox_timeout_s
        ) as client:
            yield client
    else:
        # the problems files hold every test's expected output: a program that could read them could look it up
        data = [str(p) for p in (cfg.train_path or BUNDLED, cfg.test_path) if p is not None]
        yield LocalSandbox(max_concurrency=cfg.sandbox_concurrency, timeout_s=cfg.sandbox_timeout_s, hidden_files=data)


async def main(args: list[str], *, make_completer: MakeCompleter | None = None) -> RLResult:
    opts = parse_overrides(args)
    run_dir = opts.pop("run_dir", "runs/code_rl")
    cfg = CodeRLConfig.model_validate({**DEFAULTS.model_dump(), **opts})
    train, test = problems(cfg)
    async with open_sandbox(cfg) as sandbox:

        def datasets(tokenizer: Tokenizer) -> tuple[ProblemDataset, list[EnvGroupBuilder]]:
            renderer = ChatRenderer(tokenizer)

            def builder(problem: code.CodeProblem, group_size: int = cfg.group_size) -> EnvGroupBuilder:
                return code.CodeGroupBuilder(
                    problem,
                    renderer,
                    sandbox,
                    group_size,
                    max_turns=cfg.max_turns,
                    timeout_s=cfg.sandbox_timeout_s,
                    max_trajectory_tokens=cfg.context_window,
                )

            return ProblemDataset(train, cfg.groups_per_batch, builder, cfg.seed), [builder(p, 1) for p in test]

        result = await train_rl(cfg, datasets, run_dir, make_completer=make_completer)
    print_before_after(result.before, result.after, f"code_rl: {result.steps} steps, {result.train_seconds:.0f} s of training")
    return result


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
