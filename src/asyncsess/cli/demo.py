"""The main job, ``asyncsess demo``: GRPO on offline arithmetic with SmolLM2-135M-Instruct on ``local://``.

The settings follow the issue's reference loop: 8 problems × 8 samples per step at temperature 1,
at most 16 new tokens, LoRA rank 16 / alpha 32 on every linear layer of the decoder, AdamW,
advantages centred and std-normalised, constant-reward groups skipped, ``ppo`` loss; at most 5 minutes
of training. The learning rate starts at 3e-4 rather than the reference's 1e-4 and decays linearly to 0 over
the 5 minutes (or the steps, whichever ends first): at a constant rate the held-out accuracy rises fast and
then wanders by several points, so where a run ends decided whether it gained +18 or +28; the decay settles
it (docs/benchmarks.md). Greedy accuracy on 100 held-out problems is measured before and after, in the same
session and precision. The default URL asks for bfloat16: on CPUs with native bf16 matrix units
(AVX512-BF16, AMX) it is several times faster than float32; elsewhere pass ``local://?dtype=float32``.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from rich.console import Console

from ..rl import RLConfig, RLResult, problem_datasets, train_rl
from ..runs.metrics import read_metrics
from ..runs.progress import print_before_after
from ..tasks import arithmetic

__all__ = ["DEMO", "run_demo", "local_checkpoint_dir"]

DEMO = RLConfig(
    url="local://?dtype=bfloat16",
    base_model="smollm2",
    lora_rank=16,
    lora_alpha=32,
    train_unembed=False,
    learning_rate=3e-4,
    lr_schedule="linear",
    groups_per_batch=8,
    group_size=8,
    max_tokens=16,
    temperature=1.0,
    loss_fn="ppo",
    normalize_std=True,
    remove_constant_reward_groups=True,
    max_staleness=0,
    num_minibatches=1,
    max_steps=1_000,
    max_minutes=5.0,
    save_every=25,
)


def local_checkpoint_dir(url: str, run_dir: str | Path) -> str:
    """A ``local://`` URL whose checkpoints go to ``run_dir/checkpoints`` unless it names a ``dir``, so that
    ``--resume`` finds them from a new process (the backend refuses paths outside its checkpoint root)."""
    parts = urlsplit(url)
    if parts.scheme != "local":
        return url
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    query.setdefault("dir", str(Path(run_dir).resolve() / "checkpoints"))
    return f"{parts.scheme}://{parts.netloc}{parts.path}?{urlencode(query, safe='/')}"


async def run_demo(
    model: str = DEMO.base_model,
    url: str = DEMO.url,
    minutes: float | None = DEMO.max_minutes,
    steps: int = DEMO.max_steps,
    seed: int = 0,
    run_dir: str | Path = "runs/demo",
    resume: bool = False,
    n_test: int = 100,
    progress: bool = True,
    console: Console | None = None,
) -> RLResult:
    """Run the demo and print the before/after table and the run's speed."""
    console = console or Console()
    url = local_checkpoint_dir(url, run_dir)  # so that --resume finds them from a new process
    cfg = RLConfig.model_validate(
        {**DEMO.model_dump(), "base_model": model, "url": url, "max_minutes": minutes, "max_steps": steps, "seed": seed}
    )
    train, test = arithmetic.split(n_train=5_000, n_test=n_test, seed=seed)
    console.print(f"GRPO on arithmetic: {cfg.base_model} at {cfg.url}, up to {steps} steps / {minutes} min of training; run dir {run_dir}")
    data = problem_datasets(train, test, arithmetic.grade, cfg)
    result = await train_rl(cfg, data, run_dir, if_exists="resume" if resume else "overwrite", progress=progress)
    steps_done = [r for r in read_metrics(result.run_dir) if "tokens/sampled" in r]
    sampled = sum(r["tokens/sampled"] for r in steps_done)
    sample_s = sum(r["time/sample_batch"] for r in steps_done)
    title = f"held-out greedy accuracy ({len(test)} problems) after {result.steps} steps, {result.train_seconds:.0f} s of training"
    print_before_after(result.before, result.after, title, console)
    if sample_s > 0:
        console.print(f"sampled {sampled} tokens at {sampled / sample_s:.0f} tokens/s; run directory: {result.run_dir}")
    return result
