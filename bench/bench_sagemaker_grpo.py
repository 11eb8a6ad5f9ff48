"""One GRPO loop against the SageMaker emulator with injected latency: asyncsess's driver vs the official SDK.

Both clients talk through boto3 to the same emulator (over mock://), which runs in its own process as a
remote service would, with ``--latency-ms`` added to every request. Each step: sample ``--group``
completions for each of ``--prompts`` prompts (concurrently), score them, ``forward_backward(ppo)`` +
``optim_step``, refresh the sampler. Reported: mean seconds per step (first step excluded) and the ratios.

Three runs of the same loop:
- ``asyncsess``: the driver's defaults (ops pipelined; a refreshed sampler names its checkpoint in every
  request and does not wait for a ``loadWeightsForSampling``).
- ``asyncsess+load``: the same with ``load_weights_for_sampling=true``, i.e. the official SDK's wire protocol
  for ``save_weights_and_get_sampling_client`` (two more round trips per step).
- ``sdk``: sagemaker-train's ``training_session`` (one training submission in flight, results read when
  ``.result()`` is called, fixed 2 s poll interval).

    python bench/bench_sagemaker_grpo.py --steps 6 --latency-ms 50
    python bench/bench_sagemaker_grpo.py --steps 4 --latency-ms 50 --engine-ms 100   # ops that take time on the engine

Needs ``pip install -e backends/mock -e 'backends/sagemaker[sdk]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import httpx

PROMPTS = [[1, 40, 41], [1, 50, 51], [1, 60, 61], [1, 70, 71], [1, 80, 81], [1, 90, 91], [1, 45, 46], [1, 55, 56]]
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


async def asyncsess_loop(url: str, steps: int, prompts: list[list[int]], group: int) -> list[float]:
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
                for p in prompts:
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


def sdk_loop(url: str, steps: int, prompts: list[list[int]], group: int) -> list[float]:
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
            futures = [(p, sc.sample(ModelInput.from_ints(p), num_samples=group, sampling_params=params)) for p in prompts]
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


@contextlib.contextmanager
def emulator_process(backend: str, latency_s: float) -> Iterator[str]:
    """The emulator in a child process (its CPU does not share the clients' interpreter lock); yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "from asyncsess_sagemaker.emulator import EmulatorConfig, FaultConfig, serve; "
        f"serve({backend!r}, port={port}, config=EmulatorConfig(startup_s=0.0, faults=FaultConfig(latency_s={latency_s!r})))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/_emulator/faults").raise_for_status()
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the emulator did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _report(name: str, times: list[float]) -> float:
    mean = statistics.fmean(times[1:] or times)  # the first step warms caches and connections
    print(f"{name:15s} per step: {mean:7.3f} s   (steps: {', '.join(f'{t:.2f}' for t in times)})")
    return mean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4, help=f"prompts per step (at most {len(PROMPTS)})")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--latency-ms", type=float, default=50.0, help="added to every request by the emulator")
    ap.add_argument("--engine-ms", type=float, default=0.0, help="added to every op by the engine (mock://?latency_ms=)")
    args = ap.parse_args()

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    import boto3

    prompts = PROMPTS[: args.prompts]
    with emulator_process(f"mock://?latency_ms={args.engine_ms:g}", args.latency_ms / 1000) as emu:
        boto3.client("sagemaker", region_name="us-west-2", endpoint_url=emu).create_model_package_group(ModelPackageGroupName="bench")
        url = f"sagemaker://us-west-2?endpoint_url={emu}&role_arn={ROLE}&s3_output_path=s3://bench/out&tokenizer_backend=mock://"
        runs: dict[str, Callable[[], list[float]]] = {
            "asyncsess": lambda: anyio.run(asyncsess_loop, url, args.steps, prompts, args.group),
            "asyncsess+load": lambda: anyio.run(asyncsess_loop, url + "&load_weights_for_sampling=true", args.steps, prompts, args.group),
            "sdk": lambda: sdk_loop(emu, args.steps, prompts, args.group),
        }
        means = {name: _report(name, run()) for name, run in runs.items()}
    print(
        f"latency {args.latency_ms:g} ms per request, engine {args.engine_ms:g} ms per op, {len(prompts)} prompts x {args.group}: "
        f"asyncsess is {means['sdk'] / means['asyncsess']:.2f}x faster per step than the official SDK "
        f"({means['sdk'] / means['asyncsess+load']:.2f}x with the SDK's loadWeightsForSampling round trips)"
    )


if __name__ == "__main__":
    main()
