"""Bad input for every op kind on mock://: a typed error naming the field, no sequence number consumed,
and the next ops succeed (the backend would hang on a gap or refuse a poisoned session otherwise)."""

from __future__ import annotations

import pytest

from asyncsess import ServiceClient

from .cases import CASES, check_still_works, expect_rejected

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(("target", "call", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_bad_input_is_rejected_before_numbering(target, call, field):
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        await tc.forward_backward([[1, 40, 41]], "cross_entropy", None, {"target_tokens": [40, 41, 2], "weights": [1.0] * 3})
        sc = await tc.save_weights_and_get_sampling_client()
        before = tc.current_sequence_number
        obj = {"tc": tc, "sc": sc, "svc": svc}[target]
        await expect_rejected(lambda: call(obj), field)
        if target == "svc" and field == "status":
            return  # close() with a bad status rejected: the client is still open, checked below
        await check_still_works(tc, sc, before)
