"""The Tinker wire: bytes per trained token and codec time for a GRPO forward_backward, and a GRPO step through
the official SDK + `asyncsess serve` against asyncsess's own client on the same mock:// backend.

    python bench/bench_tinker_wire.py                # both parts
    python bench/bench_tinker_wire.py --part bytes   # payload sizes and codec time only
    python bench/bench_tinker_wire.py --part step --backend "local://?device=cpu" --base-model smollm2   # a real model

Payload: G groups x S samples of a prompt plus a sampled completion, with Zipf-distributed token ids over a
151k vocabulary (Qwen-sized), per-token sampler log-probs and group-centred advantages, i.e. the
``importance_sampling`` inputs a GRPO step sends. JSON is the same request as the SDK's JSON form of a Datum.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TINKER_TELEMETRY", "0")

from asyncsess.serve import tinker_proto  # noqa: E402
from asyncsess.types import Datum, ModelInput, TensorData  # noqa: E402


def grpo_batch(groups: int, samples: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(groups):
        prompt = np.minimum(rng.zipf(1.2, prompt_len), vocab - 1)
        rewards = rng.random(samples)
        adv = rewards - rewards.mean()
        for s in range(samples):
            n = int(rng.integers(completion_len // 2, completion_len + 1))
            completion = np.minimum(rng.zipf(1.2, n), vocab - 1)
            tokens = np.concatenate([prompt, completion]).astype(np.int64)
            lp = np.log(rng.beta(8, 1, n)).astype(np.float32)  # sampled tokens: mostly likely ones
            m = len(tokens) - 1
            logprobs = np.zeros(m, np.float32)
            logprobs[prompt_len - 1 :] = lp
            advantages = np.zeros(m, np.float32)
            advantages[prompt_len - 1 :] = adv[s]
            data.append(
                Datum.model_construct(
                    model_input=ModelInput.from_ints(tokens[:-1].tolist()),
                    loss_fn_inputs={
                        "target_tokens": TensorData.from_numpy(tokens[1:], "int64"),
                        "logprobs": TensorData.from_numpy(logprobs, "float32"),
                        "advantages": TensorData.from_numpy(advantages, "float32"),
                    },
                )
            )
    return data


def _best(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_bytes(args: argparse.Namespace) -> None:
    data = grpo_batch(args.groups, args.samples, args.prompt_len, args.completion_len, args.vocab)
    tokens = sum(d.model_input.length for d in data)
    proto = tinker_proto.encode_forward_backward("m:train:0", 1, data, "importance_sampling")
    zstd = tinker_proto.compress(proto)
    body = {"model_id": "m:train:0", "seq_id": 1, "forward_backward_input": {"loss_fn": "importance_sampling"}}
    body["forward_backward_input"]["data"] = [d.model_dump(mode="json") for d in data]  # type: ignore[index]
    as_json = json.dumps(body).encode()
    enc = _best(lambda: tinker_proto.compress(tinker_proto.encode_forward_backward("m:train:0", 1, data, "importance_sampling")))
    dec = _best(lambda: tinker_proto.decode_forward_backward(tinker_proto.decompress(zstd)))
    per_m = 1e6 / tokens
    print(f"GRPO forward_backward: {len(data)} datums, {tokens} tokens (vocab {args.vocab}, importance_sampling inputs)")
    print("| encoding | bytes | bytes/token |")
    print("|---|---|---|")
    for name, blob in (("JSON (the SDK's JSON Datum form)", as_json), ("protobuf", proto), ("protobuf + zstd (level 3)", zstd)):
        print(f"| {name} | {len(blob):,} | {len(blob) / tokens:.2f} |")
    print(f"codec: client encode+zstd {enc * per_m:.3f} s/Mtok, server unzstd+decode {dec * per_m:.3f} s/Mtok (best of 5)")


def bench_step(args: argparse.Namespace) -> None:
    """One GRPO step (sample G x S, forward_backward, optim_step, sampler refresh), median of N, both clients."""
    import anyio
    import tinker
    from tinker import types as tt

    from asyncsess import AdamParams, SamplingParams, ServiceClient
    from asyncsess.rl.data import center_advantages, rl_datum
    from tests.tinker.conftest import API_KEY, start_server

    prompts = [[5 + g, 6 + g, 7 + g] for g in range(args.step_groups)]
    model = args.base_model
    params = dict(max_tokens=16, temperature=1.0)

    async def native(url: str) -> list[float]:
        times = []
        async with ServiceClient(url) as svc:
            tc = await svc.create_lora_training_client(model, rank=8, seed=0)
            sampler = await tc.save_weights_and_get_sampling_client()
            for _ in range(args.steps):
                t = time.perf_counter()
                res = [sampler.sample(p, args.samples, SamplingParams(**params)) for p in prompts]
                data = []
                for p, fut in zip(prompts, res):
                    out = await fut
                    adv = center_advantages([len(s.tokens) % 3 for s in out.sequences])
                    data += [rl_datum(p, s.tokens, s.logprobs or [], a) for s, a in zip(out.sequences, adv)]
                fb = tc.forward_backward(data, "importance_sampling")
                opt = tc.optim_step(AdamParams(learning_rate=1e-2))
                await fb
                await opt
                sampler = await tc.save_weights_and_get_sampling_client()
                times.append(time.perf_counter() - t)
        return times

    def via_sdk(url: str) -> list[float]:
        times = []
        sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        tc = sc.create_lora_training_client(base_model=model, rank=8, seed=0).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        for _ in range(args.steps):
            t = time.perf_counter()
            futs = [sampler.sample(tt.ModelInput.from_ints(p), args.samples, tt.SamplingParams(**params)) for p in prompts]
            data = []
            for p, fut in zip(prompts, futs):
                out = fut.result()
                adv = center_advantages([len(s.tokens) % 3 for s in out.sequences])
                for s, a in zip(out.sequences, adv):
                    d = rl_datum(p, s.tokens, list(s.logprobs or []), a)
                    data.append(
                        tt.Datum(
                            model_input=tt.ModelInput.from_ints(d.model_input.to_ints()),
                            loss_fn_inputs={k: v.data for k, v in d.loss_fn_inputs.items()},
                        )
                    )
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(tt.AdamParams(learning_rate=1e-2))
            fb.result()
            opt.result()
            sampler = tc.save_weights_and_get_sampling_client().result()
            times.append(time.perf_counter() - t)
        sc.holder.close()
        return times

    gen = start_server(args.backend, poll_timeout=30.0)
    server = next(gen)
    runs: dict[str, list[float]] = {"sdk": [], "wire": [], "own": []}
    clients = {
        "sdk": lambda: via_sdk(server.url),
        "wire": lambda: anyio.run(native, server.url.replace("http://", "tinker://") + f"?api_key={API_KEY}"),
        "own": lambda: anyio.run(native, args.backend),
    }
    try:  # A B C C B A: drift in the machine's load hits every client alike
        for name in [*clients, *reversed(clients)]:
            runs[name] += clients[name]()[1:]  # the first step of each run warms up
    finally:
        next(gen, None)
    a, w, b = (statistics.median(runs[k]) for k in ("sdk", "wire", "own"))
    n = args.step_groups * args.samples
    where = args.backend.split("?")[0]
    print(
        f"GRPO step on {args.backend} ({model}; {args.step_groups} prompts x {args.samples} samples = {n} sequences, median of {len(runs['own'])})"
    )
    print("| client | s/step | vs in-process |\n|---|---|---|")
    print(f"| official tinker SDK -> asyncsess serve -> {where} | {a:.4f} | {a / b:.2f}x |")
    print(f"| asyncsess client, tinker:// -> asyncsess serve -> {where} | {w:.4f} | {w / b:.2f}x |")
    print(f"| asyncsess client -> {where} (in process) | {b:.4f} | 1.00x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["bytes", "step", "all"], default="all")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion-len", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--steps", type=int, default=6, help="steps per run; each client runs twice (A B C C B A)")
    ap.add_argument("--step-groups", type=int, default=8)
    ap.add_argument("--backend", default="mock://", help="the backend both clients train on (the server hosts one)")
    ap.add_argument("--base-model", default="mock/bigram-tiny")
    args = ap.parse_args()
    if args.part in ("bytes", "all"):
        bench_bytes(args)
    if args.part in ("step", "all"):
        bench_step(args)


if __name__ == "__main__":
    main()
