"""Opt-in (``nox -s cookbook_local``): tinker-cookbook 0.5.8's RL train entry point with its arithmetic env,
unmodified, against ``asyncsess serve`` on local:// with the packaged SmolLM2-135M-Instruct (CPU); the mean
reward rises.

The server runs in another environment (the project's, with the local backend and a newer transformers):
``$ASYNCSESS_SERVER_PYTHON`` names its interpreter. SmolLM2 ships as a GGUF file; the server's environment
writes it once as a Hugging Face directory, which is then both the base model and the cookbook's tokenizer path.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import API_KEY, _free_port

pytestmark = [pytest.mark.cookbook, pytest.mark.local]

SERVER_PYTHON = os.environ.get("ASYNCSESS_SERVER_PYTHON", ".nox/tinker/bin/python")
STEPS = int(os.environ.get("ASYNCSESS_COOKBOOK_STEPS", "24"))

_EXPORT = """
import sys, torch
from asyncsess_local.models import load_model, load_tokenizer, resolve_model
src = resolve_model("smollm2")
model = load_model(src, "cpu", torch.float32)  # transformers dequantizes GGUF on load; save the plain weights
model.hf_quantizer, model.is_quantized = None, False
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(sys.argv[1])
load_tokenizer(src).save_pretrained(sys.argv[1])
"""


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("smollm2-hf")
    subprocess.run([SERVER_PYTHON, "-c", _EXPORT, str(out)], check=True)
    return str(out)


@pytest.fixture(scope="module")
def server_url(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    ckpt = tmp_path_factory.mktemp("ckpt")
    backend = f"local://?model={smollm2_dir}&device=cpu&dir={ckpt}"
    cmd = [SERVER_PYTHON, "-m", "asyncsess", "serve", "--backend", backend, "--port", str(port), "--api-key", API_KEY]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/api/v1/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def test_cookbook_rl_arithmetic_reward_rises_on_smollm2(server_url: str, smollm2_dir: str, tmp_path: Path, monkeypatch) -> None:
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    config = train.Config(
        learning_rate=3e-4,
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=8, model_name_for_tokenizer=smollm2_dir, renderer_name="role_colon", n_batches=STEPS, group_size=8
        ),
        model_name=smollm2_dir,
        recipe_name="asyncsess_local_rl",
        renderer_name="role_colon",
        max_tokens=8,
        log_path=str(tmp_path / "rl"),
        base_url=server_url,
        lora_rank=16,
        eval_every=0,
        save_every=0,
    )
    asyncio.run(train.main(config))
    rows = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rewards = [r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r]
    print("mean reward per step:", [round(x, 3) for x in rewards])
    k = max(3, len(rewards) // 4)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    assert len(rewards) >= STEPS and last > first + 0.1, (first, last, rewards)
