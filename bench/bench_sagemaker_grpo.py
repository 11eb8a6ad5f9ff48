"""One GRPO loop against the SageMaker emulator with injected latency: asyncsess's driver vs the official SDK.

Both clients talk to the same emulator (over mock://) through boto3, with ``--latency-ms`` added to every
request. Each step: sample ``--group`` completions for each of ``--prompts`` prompts (concurrently), score them,
``forward_backward(ppo)`` + ``optim_step``, refresh the sampler. Reported: mean seconds per step and the ratio.

    python bench/bench_sagemaker_grpo.py --steps 4 --latency-ms 50

Needs ``pip install -e backends/mock -e 'backends/sagemaker[sdk]'``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio

PROMPTS = [[1, 40, 41], [1, 50, 51], [1, 60, 61], [1, 70, 71]]
ROLE = "arn:aws:iam::111122223333:role/BenchRole"
BASE = "mock/bigram-tiny"
BASE_ARN = "arn:aws:sagemaker:us-west-2:aws:hub-content/SageMakerPublicHub/Model/mock-bigram-tiny/1.0.0"
GEN = 8  # tokens scored per completion (the wire generates at least 512)


def _reward(tokens: list[int]) -> float:
    return float(sum(t % 2 == 0 for t in tokens[:GEN]))


def _rl_inputs(prompt: list[int], tokens: list[int], logprobs: list[float], adv: float) -> tuple[list[int], dict[str, list[Any]]]:
    full = prompt + tokens[:GEN]
    n = len(full) - 1
    p = len(prompt) - 1
    return full[:-1], {
        "target_tokens": full[1:],
        "weights": [1.0] * n,
        "advantages": [0.0] * p + [adv] * (n - p),
        "logprobs": [0.0] * p + list(logprobs[:GEN]),
    }


async def asyncsess_loop(url: str, steps: int, group: int) -> list[float]:
    import asyncsess

    times = []
    async with asyncsess.ServiceClient(url) as svc:
        tc = await svc.create_lora_training_client(BASE, rank=8)
        sc = await tc.save_weights_and_get_sampling_client()
        for step in range(steps):
            t0 = time.perf_counter()
            params = asyncsess.SamplingParams(max_tokens=GEN, seed=step)
            results: list[Any] = []

            async def one(p: list[int], sampler: Any, params: Any, out: list[Any]) -> None:
                out.append((p, await sampler.sample(p, group, params)))

            async with anyio.create_task_group() as tg:
                for p in PROMPTS:
                    tg.start_soon(one, p, sc, params, results)
            datums = []
            for prompt, res in results:
                rewards = [_reward(s.tokens) for s in res.sequences]
                mean = statistics.fmean(rewards)
                for s, r in zip(res.sequences, rewards):
                    model_input, inputs = _rl_inputs(prompt, s.tokens, s.logprobs or [], r - mean)
                    datums.append(asyncsess.Datum(model_input=model_input, loss_fn_inputs=inputs))
            fb = tc.forward_backward(datums, "ppo")
            opt = tc.optim_step(asyncsess.AdamParams(learning_rate=0.005))
            sc = await tc.save_weights_and_get_sampling_client()
            await fb
            await opt
            times.append(time.perf_counter() - t0)
    return times


def sdk_loop(url: str, steps: int, group: int) -> list[float]:
    os.environ["SAGEMAKER_TRAINING_SESSION_ENDPOINT"] = url
    os.environ["SAGEMAKER_TRAINING_SESSION_RUNTIME_ENDPOINT"] = url
    from sagemaker.train.training_session import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient

    group_arn = "arn:aws:sagemaker:us-west-2:111122223333:model-package-group/bench"
    svc = ServiceClient(region="us-west-2", role_arn=ROLE, model_package_group_arn=group_arn, s3_output_path="s3://bench/out")
    tc = svc.create_lora_training_client(base_model=BASE_ARN, rank=8, alpha=16)
    sc = tc.save_weights_and_get_sampling_client()
    times = []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            params = SamplingParams(max_tokens=512, seed=step)
            futures = [(p, sc.sample(ModelInput.from_ints(p), num_samples=group, sampling_params=params)) for p in PROMPTS]
            datums = []
            for prompt, fut in futures:
                res = fut.result()
                rewards = [_reward(s.tokens) for s in res.sequences]
                mean = statistics.fmean(rewards)
                for s, r in zip(res.sequences, rewards):
                    model_input, inputs = _rl_inputs(prompt, s.tokens, s.logprobs or [], r - mean)
                    datums.append(Datum(model_input=ModelInput.from_ints(model_input), loss_fn_inputs=inputs))
            fb = tc.forward_backward(datums, "ppo")
            opt = tc.optim_step(AdamParams(learning_rate=0.005))
            sc = tc.save_weights_and_get_sampling_client()
            fb.result()
            opt.result()
            times.append(time.perf_counter() - t0)
    finally:
        tc.stop()
    return times


def _report(name: str, times: list[float]) -> float:
    mean = statistics.fmean(times[1:] or times)  # the first step warms caches and connections
    print(f"{name:10s} per step: {mean:7.3f} s   (steps: {', '.join(f'{t:.2f}' for t in times)})")
    return mean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    args = ap.parse_args()

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    import boto3

    from asyncsess_sagemaker.emulator import EmulatorConfig, FaultConfig, running_emulator

    config = EmulatorConfig(startup_s=0.0, faults=FaultConfig(latency_s=args.latency_ms / 1000))
    with running_emulator("mock://", config) as emu:
        boto3.client("sagemaker", region_name="us-west-2", endpoint_url=emu.url).create_model_package_group(ModelPackageGroupName="bench")
        url = f"sagemaker://us-west-2?endpoint_url={emu.url}&role_arn={ROLE}&s3_output_path=s3://bench/out&tokenizer_backend=mock://"
        runs: dict[str, Callable[[], list[float]]] = {
            "asyncsess": lambda: anyio.run(asyncsess_loop, url, args.steps, args.group),
            "sdk": lambda: sdk_loop(emu.url, args.steps, args.group),
        }
        means = {name: _report(name, run()) for name, run in runs.items()}
    print(
        f"latency {args.latency_ms:g} ms per request: asyncsess is {means['sdk'] / means['asyncsess']:.2f}x faster per step than the official SDK"
    )


if __name__ == "__main__":
    main()
