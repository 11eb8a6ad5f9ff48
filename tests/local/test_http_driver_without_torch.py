"""The ``http://`` driver lives in the core: a process that cannot import torch (or transformers, peft, vllm)
trains and samples on a real worker through ``ServiceClient("http://...")``. The worker runs in this test
process (it needs torch); the client runs in a child interpreter where importing torch raises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from .server_helpers import KEY, start_worker

pytestmark = pytest.mark.local

CLIENT = """
import importlib.abc, json, sys

class _NoHeavy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "peft", "vllm", "safetensors"):
            raise ImportError(f"{name} is blocked in this interpreter")
        return None

sys.meta_path.insert(0, _NoHeavy())
import anyio
import asyncsess
from asyncsess import AdamParams, ModelInput, SamplingParams
from asyncsess.rl.data import sft_datum

URL, KEY, MODEL = sys.argv[1:4]

async def main():
    async with asyncsess.ServiceClient(URL, api_key=KEY) as svc:
        tc = await svc.create_lora_training_client(MODEL, rank=2, seed=0)
        datum = sft_datum(list(range(3, 10)), list(range(10, 30)))
        losses = []
        for _ in range(3):
            out = await tc.forward_backward([datum], "cross_entropy")
            losses.append(out.metrics["loss:sum"])
            await tc.optim_step(AdamParams(learning_rate=5e-2))
        sc = await tc.save_weights_and_get_sampling_client()
        res = await sc.sample(ModelInput.from_ints([3, 4, 5]), num_samples=2, sampling_params=SamplingParams(max_tokens=4, seed=1))
        backend = type(svc.backend)
        heavy = [m for m in ("torch", "transformers", "peft", "vllm") if m in sys.modules]
        print(json.dumps({"losses": losses, "samples": [list(s.tokens) for s in res.sequences],
                          "driver": f"{backend.__module__}.{backend.__name__}", "heavy": heavy}))

anyio.run(main)
"""


def test_a_torch_free_process_trains_and_samples_over_http(tiny: str, tmp_path: Path) -> None:
    worker = start_worker(tiny, str(tmp_path / "ckpt"))
    try:
        out = subprocess.run([sys.executable, "-c", CLIENT, worker.url, KEY, tiny], capture_output=True, text=True, timeout=600)
    finally:
        worker.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["driver"] == "asyncsess.backends.http.HttpBackend"
    assert got["heavy"] == []
    assert got["losses"][-1] < got["losses"][0]  # the worker trained on what the torch-free client sent
    assert len(got["samples"]) == 2 and all(1 <= len(s) <= 4 for s in got["samples"])
