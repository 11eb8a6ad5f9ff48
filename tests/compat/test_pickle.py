"""A pickled SamplingClient samples the same weights in a ``multiprocessing`` child (spawned: nothing inherited)."""

from __future__ import annotations

import multiprocessing
import pickle

import anyio
import pytest

import asyncsess.sync
from asyncsess import ServiceClient, SessionGoneError

from .pickle_child import PARAMS, PROMPT, sample_async_client, sample_sync_client

pytestmark = pytest.mark.anyio


def _in_child(fn, blob: bytes) -> list[list[int]]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, (blob,))


async def _trained(svc):
    tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
    for _ in range(3):
        tc.forward_backward([[1, 40, 41, 42, 43]], "cross_entropy", None, {"target_tokens": [40, 41, 42, 43, 44], "weights": [1.0] * 5})
        await tc.optim_step({"learning_rate": 1.0})
    return tc


async def test_pickled_async_sampler_samples_the_same_weights_in_a_child_process():
    async with ServiceClient("mock://") as svc:
        tc = await _trained(svc)
        sc = await tc.save_weights_and_get_sampling_client()  # an ephemeral snapshot: no named checkpoint to find
        here = [s.tokens for s in (await sc.sample(PROMPT, 3, PARAMS)).sequences]
        base = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        untrained = [s.tokens for s in (await base.sample(PROMPT, 3, PARAMS)).sequences]
        assert here != untrained  # so equal samples below mean the child has the trained weights
        there = await anyio.to_thread.run_sync(_in_child, sample_async_client, pickle.dumps(sc))
        assert there == here


async def test_an_unpickled_client_says_how_to_open_it():
    async with ServiceClient("mock://") as svc:
        sc = await svc.create_sampling_client(base_model="mock/bigram-tiny")
        copy = pickle.loads(pickle.dumps(sc))
        with pytest.raises(SessionGoneError, match="async with"):
            copy.sample(PROMPT, 1)
        await copy.attach(svc)  # or reopen it on a ServiceClient that is already open
        assert len((await copy.sample(PROMPT, 2, PARAMS)).sequences) == 2
        await copy.stop()


def test_pickled_sync_sampler_samples_in_a_child_process():
    with asyncsess.sync.ServiceClient("mock://") as svc:
        tc = svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        tc.forward_backward([[1, 40, 41]], "cross_entropy", None, {"target_tokens": [40, 41, 42], "weights": [1.0] * 3})
        tc.optim_step({"learning_rate": 1.0}).result()
        sc = tc.save_weights_and_get_sampling_client("named-snapshot")
        here = [s.tokens for s in sc.sample(PROMPT, 3, PARAMS).result().sequences]
        assert _in_child(sample_sync_client, pickle.dumps(sc)) == here
