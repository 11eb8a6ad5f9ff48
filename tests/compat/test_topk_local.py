"""Top-k and ``prompt_logprobs_last_n`` on local:// (the tiny offline Llama, CPU): the same checks as on mock://."""

from __future__ import annotations

import os
from urllib.parse import quote

import pytest

from asyncsess import ServiceClient

from . import topk_checks

pytestmark = [pytest.mark.local, pytest.mark.anyio]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def test_topk_and_last_n_on_local(tmp_path):
    from asyncsess_local.testing import build_tiny_llama

    tiny = str(build_tiny_llama(tmp_path / "tiny"))
    url = f"local://?model={quote(tiny)}&device=cpu&dir={quote(str(tmp_path / 'ckpt'))}"
    async with ServiceClient(url) as svc:
        vocab = next(m.vocab_size for m in (await svc.get_server_capabilities()).supported_models if m.vocab_size)
        tc = await svc.create_lora_training_client(tiny, rank=4, seed=0)
        sc = await tc.save_weights_and_get_sampling_client()
        for prompt, k in (([1, 40, 41], 5), ([3, 5], vocab + 2)):  # each position costs `vocab` independent scoring calls
            await topk_checks.check_prompt_topk(sc, prompt, k, vocab)
        await topk_checks.check_sample_topk(sc, [1, 40, 41], 3, vocab, num_samples=1, max_tokens=2)
        await topk_checks.check_last_n(sc, [1, 40, 41, 42, 43], 2)
        await topk_checks.check_targets(sc, [1, 40, 41], [[5, -1], [-1, 9]], vocab)

        # descriptions, metadata and deletion of checkpoints on disk
        first = await tc.save_state("final checkpoint")
        named = await tc.save_weights_for_sampler("eval-1", user_metadata={"k": "v"})
        rows = {c.path: c for c in await svc.list_checkpoints(tc.model_id)}
        assert rows[first.path].description == "final checkpoint" and rows[named.path].user_metadata == {"k": "v"}
        await svc.delete_model_package(named.path)
        assert named.path not in [c.path for c in await svc.list_checkpoints()]
        assert tc.get_info().session_options == {} and (
            await svc.create_lora_training_client(tiny, rank=4, s3_output_path="s3://b/p")
        ).get_info().session_options == {"s3_output_path": "s3://b/p"}
