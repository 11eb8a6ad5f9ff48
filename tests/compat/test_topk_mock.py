"""Top-k prompt/sample log-probs, target log-probs and ``prompt_logprobs_last_n`` on mock:// (property tests)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsess import ServiceClient

from . import topk_checks

pytestmark = pytest.mark.anyio

VOCAB = 105  # the mock's char tokenizer
prompts = st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=5)
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


async def _trained_sampler(svc):
    tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
    await tc.forward_backward([[1, 40, 41, 42]], "cross_entropy", None, {"target_tokens": [40, 41, 42, 2], "weights": [1.0] * 4})
    await tc.optim_step({"learning_rate": 0.5})
    return await tc.save_weights_and_get_sampling_client()


async def test_vocab_constant_matches_the_mock():
    async with ServiceClient("mock://") as svc:
        assert (await svc.get_server_capabilities()).supported_models[0].vocab_size == VOCAB


@SETTINGS
@given(prompt=prompts, k=st.integers(1, VOCAB + 3))
async def test_topk_prompt_logprobs_are_the_k_largest_of_the_full_softmax(prompt, k):
    async with ServiceClient("mock://") as svc:
        await topk_checks.check_prompt_topk(await _trained_sampler(svc), prompt, k, VOCAB)


@SETTINGS
@given(prompt=prompts, k=st.integers(1, 8))
async def test_topk_sample_logprobs_are_the_k_largest_of_the_full_softmax(prompt, k):
    async with ServiceClient("mock://") as svc:
        await topk_checks.check_sample_topk(await _trained_sampler(svc), prompt, k, VOCAB)


@SETTINGS
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=3, max_size=8), data=st.data())
async def test_prompt_logprobs_last_n_is_the_tail_of_the_full_pass(prompt, data):
    n = data.draw(st.integers(1, len(prompt) - 1))
    async with ServiceClient("mock://") as svc:
        await topk_checks.check_last_n(await _trained_sampler(svc), prompt, n)


@SETTINGS
@given(prompt=prompts, data=st.data())
async def test_target_prompt_logprobs_score_the_named_ids(prompt, data):
    ids = data.draw(
        st.lists(st.lists(st.integers(-1, VOCAB - 1), min_size=2, max_size=2), min_size=len(prompt) - 1, max_size=len(prompt) - 1)
    )
    async with ServiceClient("mock://") as svc:
        await topk_checks.check_targets(await _trained_sampler(svc), prompt, ids, VOCAB)


async def test_target_id_outside_the_vocabulary_is_rejected():
    from asyncsess import InvalidInputError

    async with ServiceClient("mock://") as svc:
        sc = await _trained_sampler(svc)
        with pytest.raises(InvalidInputError, match="target_prompt_logprobs"):
            await sc.sample([1, 2, 3], 1, target_prompt_logprobs=[[VOCAB], [1]])
