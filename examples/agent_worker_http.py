"""The calculator agent trained through a worker's own OpenAI endpoint, over HTTP.

The loop holds a LoRA training session on an asyncsess worker (``http://``); after each ``save_weights`` the
session id, used as the OpenAI ``model``, serves the new weights. Each rollout is the unmodified agent of
``examples/calculator_agent.py`` with a plain ``openai.AsyncOpenAI`` on the worker's ``/v1``, its calls tagged
with ``X-Rollout-Id``; the loop takes the captured tokens and log-probs from
``DELETE /v1/asyncsess/rollouts/{id}``, centres the rewards per group and trains on them
(``importance_sampling``). Settings are ``key=value``:

    python examples/agent_worker_http.py                  # starts a worker on 127.0.0.1 with the packaged SmolLM2
    python examples/agent_worker_http.py url=http://127.0.0.1:8765 api_key=K base_model=smollm2 steps=3
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any

import anyio
import httpx
import openai

from asyncsess import ServiceClient
from asyncsess.rl.capture import AgentTrajectory, build_trajectory
from asyncsess.rl.data import center_advantages
from asyncsess.runs import parse_overrides
from asyncsess.serve.capture import CapturedCall
from asyncsess.types import AdamParams

try:
    from examples.agent_rl import reward, tasks
    from examples.calculator_agent import solve
except ModuleNotFoundError:  # run as a script: its folder is on the path
    from agent_rl import reward, tasks  # type: ignore[no-redef]
    from calculator_agent import solve  # type: ignore[no-redef]

DEFAULTS: dict[str, Any] = dict(
    url="", api_key="", base_model="smollm2", dtype="bfloat16", steps=2, groups=1, group_size=2, lr=3e-4, rank=16, seed=0
)


async def rollout(url: str, key: str, model: str, task: dict[str, Any]) -> AgentTrajectory:
    """One episode of the agent against the worker's endpoint, as the worker captured it."""
    rid = f"rollout-{uuid.uuid4().hex}"
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, default_headers={"X-Rollout-Id": rid}, max_retries=2) as client:
        reply = await solve(client, task["question"], model=model)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        r = await http.delete(f"/v1/asyncsess/rollouts/{rid}")
        r.raise_for_status()
    calls = [CapturedCall.model_validate(c) for c in r.json()["calls"]]
    return build_trajectory(rid, calls, reward(reply, task["answer"], 0.2))


async def train(url: str, key: str, cfg: dict[str, Any]) -> list[dict[str, float]]:
    every = tasks(64, int(cfg["seed"]))
    log = []
    async with ServiceClient(url, api_key=key) as svc:
        tc = await svc.create_lora_training_client(base_model=cfg["base_model"], rank=int(cfg["rank"]), seed=int(cfg["seed"]))
        for step in range(int(cfg["steps"])):
            started = time.monotonic()
            await tc.save_weights_for_sampler(f"step{step}")  # the session id now serves these weights
            batch = every[step * int(cfg["groups"]) : (step + 1) * int(cfg["groups"])]
            groups: list[list[AgentTrajectory]] = [[] for _ in batch]

            async def play(group: list[AgentTrajectory], task: dict[str, Any]) -> None:
                group.append(await rollout(url, key, tc.model_id, task))

            async with anyio.create_task_group() as tg:
                for group, task in zip(groups, batch):
                    for _ in range(int(cfg["group_size"])):
                        tg.start_soon(play, group, task)
            datums = []
            for group in groups:
                for traj, adv in zip(group, center_advantages([t.reward for t in group])):
                    datums += [d for d, _ in traj.datums(adv)]
            fb = tc.forward_backward(datums, "importance_sampling")
            opt = tc.optim_step(AdamParams(learning_rate=float(cfg["lr"])))
            await fb
            await opt
            trajs = [t for g in groups for t in g]
            row = {
                "step": step,
                "reward": sum(t.reward for t in trajs) / len(trajs),
                "calls": sum(len(t.calls) for t in trajs) / len(trajs),
                "drift": sum(len(t.drift) for t in trajs) / len(trajs),
                "weight_version": min(v for t in trajs for v in t.weight_versions),
                "sampled_tokens": sum(len(c.choices[0].tokens) for t in trajs for c in t.calls),
                "seconds": time.monotonic() - started,
            }
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            log.append(row)
    return log


async def main(args: list[str]) -> list[dict[str, float]]:
    cfg = {**DEFAULTS, **parse_overrides(args)}
    if cfg["url"]:
        return await train(str(cfg["url"]), str(cfg["api_key"] or os.environ.get("ASYNCSESS_API_KEY", "")), cfg)
    import tempfile

    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread

    key = uuid.uuid4().hex
    with tempfile.TemporaryDirectory() as ckpt:
        backend = LocalBackend(model=str(cfg["base_model"]), dtype=str(cfg["dtype"]) or None, checkpoint_dir=ckpt)
        worker = serve_in_thread(backend, [key])
        try:
            return await train(worker.url, key, cfg)
        finally:
            worker.stop()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
