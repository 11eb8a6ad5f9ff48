"""The bad-input suite on local:// (the tiny offline Llama on CPU): every case rejected before numbering."""

from __future__ import annotations

import os
from urllib.parse import quote

import pytest

from asyncsess import ServiceClient

from .cases import CASES, check_still_works, expect_rejected
from .loop_cases import one_per_kind, run_all

pytestmark = [pytest.mark.local, pytest.mark.anyio]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def test_every_bad_input_case_on_local(tmp_path):
    from asyncsess_local.testing import build_tiny_llama

    tiny = str(build_tiny_llama(tmp_path / "tiny"))
    url = f"local://?model={quote(tiny)}&device=cpu&dir={quote(str(tmp_path / 'ckpt'))}"
    assert await run_all(url, tiny) == len(CASES)
    await check_load_paths(url, tiny)

    # http:// (the worker over the same engine code): one case of each op kind, to keep the suite short
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread

    worker = serve_in_thread(LocalBackend(model=tiny, device="cpu", checkpoint_dir=str(tmp_path / "http")), ["secret"])
    try:
        skip = one_per_kind()
        assert await run_all(worker.url, tiny, {"api_key": "secret"}, skip=skip) == len(CASES) - len(skip)
    finally:
        worker.stop()


async def check_load_paths(url: str, base_model: str) -> None:
    """The in-process local:// backend judges a load path before numbering (as the worker does over http)."""
    async with ServiceClient(url) as svc:
        tc = await svc.create_lora_training_client(base_model, rank=4)
        state = (await tc.save_state("s1")).path
        weights = (await tc.save_weights_for_sampler("w1")).path
        sc = await tc.save_weights_and_get_sampling_client()
        for bad in (state + "-missing", weights + "/../../../../etc"):
            before = tc.current_sequence_number
            await expect_rejected(lambda bad=bad: tc.load_state(bad), "path")
            await check_still_works(tc, sc, before)
        assert (await tc.load_state(state)).path == state
