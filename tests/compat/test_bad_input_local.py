"""The bad-input suite on local:// (the tiny offline Llama on CPU): every case rejected before numbering."""

from __future__ import annotations

import os
from urllib.parse import quote

import pytest

from .cases import CASES
from .loop_cases import one_per_kind, run_all

pytestmark = [pytest.mark.local, pytest.mark.anyio]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def test_every_bad_input_case_on_local(tmp_path):
    from asyncsess_local.testing import build_tiny_llama

    tiny = str(build_tiny_llama(tmp_path / "tiny"))
    url = f"local://?model={quote(tiny)}&device=cpu&dir={quote(str(tmp_path / 'ckpt'))}"
    assert await run_all(url, tiny) == len(CASES)

    # http:// (the worker over the same engine code): one case of each op kind, to keep the suite short
    from asyncsess_local.embedded import LocalBackend
    from asyncsess_local.server import serve_in_thread

    worker = serve_in_thread(LocalBackend(model=tiny, device="cpu", checkpoint_dir=str(tmp_path / "http")), ["secret"])
    try:
        skip = one_per_kind()
        assert await run_all(worker.url, tiny, {"api_key": "secret"}, skip=skip) == len(CASES) - len(skip)
    finally:
        worker.stop()
