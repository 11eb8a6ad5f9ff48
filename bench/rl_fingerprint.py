"""Run the RL recipes on mock:// at a fixed seed and print their metrics.jsonl without timing keys.

Used to check that a change to the RL loop keeps its behaviour: run it before and after, then diff.

    python bench/rl_fingerprint.py OUT_DIR            # writes OUT_DIR/<recipe>.jsonl
    python bench/rl_fingerprint.py OUT_DIR --compare OLD_DIR
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "math_rl": ["examples/math_rl.py", "max_steps=6", "n_test=20", "save_every=0"],
    "math_rl_kl": ["examples/math_rl.py", "max_steps=4", "n_test=10", "kl_penalty_coef=0.5", "save_every=0"],
    "gsm8k_grpo": ["examples/gsm8k_grpo.py", "train_path=examples/data/gsm8k_sample.jsonl", "max_steps=3", "n_test=4"],
    # a task the mock's bigram model learns (the recipe tests' digit share), so losses and updates show
    "digits_k0": ["bench/rl_fingerprint.py", "--digits", "0"],
    "digits_k2": ["bench/rl_fingerprint.py", "--digits", "2"],
}
# progress, time and throughput differ from run to run; everything else must not
VOLATILE = ("time/", "tokens/sampled_per_s", "tokens/train_per_s")


def rows(path: Path) -> list[dict[str, object]]:
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        out.append({k: v for k, v in sorted(r.items()) if not k.startswith(VOLATILE)})
    return out


def digits(k: int, run_dir: str) -> None:
    """GRPO on "Code i:" prompts rewarded by the share of digits in the reply."""
    import anyio

    from asyncsess.rl import Problem, RLConfig, problem_datasets, train_rl

    def grade(problem: Problem, reply: str) -> tuple[float, dict[str, float]]:
        return sum(c.isdigit() for c in reply) / max(1, len(reply)), {"correct": float(reply.strip() == problem.answer)}

    problems = [Problem(f"Code {i}:", "0") for i in range(12)]
    cfg = RLConfig(
        url="mock://",
        groups_per_batch=4,
        group_size=8,
        max_tokens=8,
        learning_rate=0.5,
        lora_rank=4,
        normalize_std=False,
        max_staleness=k,
        max_steps=10,
        seed=1,
        save_every=0,
    )
    data = problem_datasets(problems, problems[:4], grade, cfg)
    anyio.run(lambda: train_rl(cfg, data, run_dir, if_exists="overwrite", progress=False))


def main(argv: list[str]) -> int:
    if argv[0] == "--digits":
        digits(int(argv[1]), argv[2].removeprefix("run_dir="))
        return 0
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, cmd in RECIPES.items():
        run = out / f"run-{name}"
        shutil.rmtree(run, ignore_errors=True)
        done = subprocess.run([sys.executable, *cmd, f"run_dir={run}"], cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(run / "metrics.jsonl")))
    if len(argv) == 3 and argv[1] == "--compare":
        old, bad = Path(argv[2]), 0
        for name in RECIPES:
            a = [json.loads(x) for x in (old / f"{name}.jsonl").read_text().splitlines()]
            b = [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines()]
            for i, (ra, rb) in enumerate(zip(a, b)):
                diff = {k: (ra.get(k), rb.get(k)) for k in ra if ra.get(k) != rb.get(k)}
                if diff:
                    bad += 1
                    print(f"{name} row {i}: {diff}")
            if len(a) != len(b):
                bad += 1
                print(f"{name}: {len(a)} rows before, {len(b)} after")
            print(f"{name}: {len(a)} rows compared")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
