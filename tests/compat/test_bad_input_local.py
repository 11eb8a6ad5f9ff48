"""The bad-input suite on local:// (the tiny offline Llama on CPU): every case rejected before numbering."""

from __future__ import annotations

import os
from urllib.parse import quote

import pytest

from .cases import CASES
from .loop_cases import run_all

pytestmark = [pytest.mark.local, pytest.mark.anyio]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def test_every_bad_input_case_on_local(tmp_path):
    from asyncsess_local.testing import build_tiny_llama

    tiny = str(build_tiny_llama(tmp_path / "tiny"))
    url = f"local://?model={quote(tiny)}&device=cpu&dir={quote(str(tmp_path / 'ckpt'))}"
    assert await run_all(url, tiny) == len(CASES)
