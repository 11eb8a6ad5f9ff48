"""Bad input for every op kind on mock://: a typed error naming the field, no sequence number consumed,
and the next ops succeed (the backend would hang on a gap or refuse a poisoned session otherwise)."""

from __future__ import annotations

import pytest

from asyncsess import InvalidInputError, ServiceClient

from .cases import CASES, TAKEN, check_still_works, expect_rejected, good_datum

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(("target", "call", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_bad_input_is_rejected_before_numbering(target, call, field):
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        await tc.forward_backward([[1, 40, 41]], "cross_entropy", None, {"target_tokens": [40, 41, 2], "weights": [1.0] * 3})
        sc = await tc.save_weights_and_get_sampling_client()
        await tc.save_state(TAKEN)
        await tc.save_weights_for_sampler(TAKEN)
        before = tc.current_sequence_number
        obj = {"tc": tc, "sc": sc, "svc": svc}[target]
        await expect_rejected(lambda: call(obj), field)
        if target == "svc" and field == "status":
            return  # close() with a bad status rejected: the client is still open, checked below
        await check_still_works(tc, sc, before)


async def test_a_load_path_that_holds_no_training_state_is_refused_before_numbering():
    """What only the backend knows (is there a checkpoint at this path, of which kind) is still judged before the
    op takes its seq on an in-process backend: a typo in a resume path must not poison a trained session."""
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        state = (await tc.save_state("s1")).path
        weights = (await tc.save_weights_for_sampler("w1")).path
        other = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        sc = await tc.save_weights_and_get_sampling_client()
        for bad in (state + "-missing", weights, state.replace(tc.model_id, other.model_id)):
            before = tc.current_sequence_number
            err = await expect_rejected(lambda bad=bad: tc.load_state(bad), "path")
            assert repr(bad) in str(err) or bad in str(err)
            await check_still_works(tc, sc, before)
        # a refused load queued between ordered ops leaves their order and numbers intact
        fb = tc.forward_backward([good_datum()], "cross_entropy")
        with pytest.raises(InvalidInputError):
            tc.load_state_with_optimizer(state + "-missing")
        load = tc.load_state_with_optimizer(state)
        assert (fb.seq, load.seq) == (before + 3, before + 4)
        await fb
        assert (await load).path == state
