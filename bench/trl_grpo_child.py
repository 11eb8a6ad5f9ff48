"""TRL's ``GRPOTrainer`` on the demo's task, run by ``bench/bench_trl.py`` in TRL's own venv.

Reads a JSON job from argv[1] (problems already drawn by the parent with ``asyncsess.tasks.arithmetic``, in
the demo's per-step order), trains under a wall-clock budget, measures greedy held-out replies before and
after (outside the budget), and writes a JSON result to argv[2]. The parent grades the held-out replies with
the same grader as the demo; this process grades training rollouts with it too (``asyncsess`` is installed
in TRL's venv without its backends, so ``import asyncsess`` stays light).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def main(job_path: str, out_path: str) -> None:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncsess.chat import chat_tokens
    from asyncsess.rl.problem_env import Problem
    from asyncsess.tasks.arithmetic import grade
    from asyncsess_local.models import ModelSource, load_tokenizer

    job = json.loads(Path(job_path).read_text())
    torch.manual_seed(job["seed"])
    torch.set_num_threads(job["threads"]) if job.get("threads") else None
    dtype = getattr(torch, job["dtype"])
    tok = load_tokenizer(ModelSource("smollm2", job["model_dir"], {"gguf_file": job["gguf_file"]}))  # as the demo's
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], gguf_file=job["gguf_file"], dtype=dtype)
    # transformers marks a GGUF load as quantized even when every weight came out as a plain dense tensor (as
    # here, and as in the demo's engine); the Trainer then refuses it, so drop the marker once that is checked
    dense = all(p.dtype == dtype for p in model.parameters())
    if getattr(model, "hf_quantizer", None) is not None and dense:
        setattr(model, "hf_quantizer", None)  # noqa: B010 (mypy types Module attributes as Tensor | Module)
        setattr(model, "is_quantized", False)  # noqa: B010
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    stops = job["stop_ids"]

    def messages(q: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": q}]

    def greedy(problems: list[dict[str, str]]) -> list[str]:
        """Greedy replies (at most ``max_tokens``, stopping at the turn's end tokens), in batches of 32."""
        was_training = model.training
        model.eval()
        replies: list[str] = []
        with torch.no_grad():
            for i in range(0, len(problems), 32):
                chunk = problems[i : i + 32]
                ids = [chat_tokens(tok, messages(p["question"]), add_generation_prompt=True) for p in chunk]  # the demo's renderer
                width = max(len(x) for x in ids)
                input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])
                mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
                out = trainer.model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    max_new_tokens=job["max_tokens"],
                    do_sample=False,
                    eos_token_id=stops,
                    pad_token_id=tok.pad_token_id,
                )
                replies += tok.batch_decode(out[:, width:], skip_special_tokens=True)
        model.train(was_training)
        return replies

    def reward(prompts: list[Any], completions: list[Any], answer: list[str], question: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [grade(Problem(q, a), t)[0] for q, a, t in zip(question, answer, texts)]

    train = job["train"]  # the demo's problems in its step order: step s uses rows [8 s, 8 s + 8)
    data = Dataset.from_list([{"prompt": messages(p["question"]), "question": p["question"], "answer": p["answer"]} for p in train])
    budget = 60.0 * job["minutes"]
    clock: dict[str, float] = {}

    class Budget(TrainerCallback):  # type: ignore[misc]
        """The demo's rule: stop when the time spent plus the last step's length reaches the budget."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock["start"] = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.perf_counter()
            last = now - clock.get("end", clock["start"])
            clock["end"] = now
            if now - clock["start"] + last >= budget:
                control.should_training_stop = True

    cfg = GRPOConfig(
        output_dir=job["out_dir"],
        learning_rate=job["learning_rate"],
        lr_scheduler_type=job.get("lr_schedule", "constant"),  # constant, linear or cosine: the same names in both
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=job["adam"]["beta1"],
        adam_beta2=job["adam"]["beta2"],
        adam_epsilon=job["adam"]["eps"],
        max_grad_norm=0.0,  # the demo does not clip
        per_device_train_batch_size=job["groups"] * job["group_size"],
        gradient_accumulation_steps=1,
        num_generations=job["group_size"],
        max_completion_length=job["max_tokens"],
        temperature=job["temperature"],
        top_p=1.0,
        top_k=0,
        generation_kwargs={"eos_token_id": stops},
        loss_type=job["loss_type"],
        scale_rewards="group",
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        shuffle_dataset=False,
        max_steps=len(train) // job["groups"],
        bf16=job["dtype"] == "bfloat16",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=job["seed"],
        disable_tqdm=True,
        gradient_checkpointing=False,  # the demo does not recompute activations
    )
    lora = LoraConfig(
        r=job["lora_rank"],
        lora_alpha=job["lora_alpha"],
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=data, processing_class=tok, peft_config=lora)
    trainer.add_callback(Budget())
    model = trainer.model
    t = time.perf_counter()
    before = greedy(job["test"])
    eval_before_s = time.perf_counter() - t
    trainer.train()
    steps = trainer.state.global_step
    train_s = clock.get("end", clock.get("start", 0.0)) - clock.get("start", 0.0)
    t = time.perf_counter()
    after = greedy(job["test"])
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    Path(out_path).write_text(
        json.dumps(
            {
                "steps": steps,
                "train_seconds": train_s,
                "replies_before": before,
                "replies_after": after,
                "eval_seconds": [eval_before_s, time.perf_counter() - t],
                "train_reward": rewards,
                "versions": {m: __import__(m).__version__ for m in ("trl", "transformers", "peft", "torch", "accelerate")},
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
