"""The sampler refresh probe (asyncsess.rl.refresh) on mock://, with injected refresh faults."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asyncsess import ServiceClient
from asyncsess.errors import InvalidInputError, SamplerRefreshError
from asyncsess.rl import Problem, RLConfig, problem_datasets, train_rl
from asyncsess.rl.data import sft_datum
from asyncsess.rl.refresh import RefreshProbe, default_tolerance, probe_tokens
from asyncsess.runs.metrics import read_metrics

pytestmark = pytest.mark.anyio

PROBLEMS = [Problem(f"The answer {i}:", "0") for i in range(8)]


def digit_share(problem: Problem, reply: str) -> tuple[float, dict[str, float]]:
    return sum(c.isdigit() for c in reply) / max(1, len(reply)), {}


def rl_config(url: str, **kw) -> RLConfig:
    base = dict(url=url, groups_per_batch=2, group_size=4, max_tokens=6, learning_rate=0.3, lora_rank=4, max_steps=8)
    return RLConfig(**{**base, **kw})


async def run_rl(cfg: RLConfig, tmp_path) -> None:
    await train_rl(cfg, problem_datasets(PROBLEMS, PROBLEMS[:2], digit_share, cfg), tmp_path, progress=False)


@pytest.mark.parametrize(("option", "observed"), [("drop_refresh_at", "previous"), ("repeat_refresh_at", "neither")])
async def test_a_bad_refresh_fails_the_rl_run_at_that_step(tmp_path, option, observed):
    with pytest.raises(SamplerRefreshError) as info:
        await run_rl(rl_config(f"mock://?{option}=3"), tmp_path)
    err = info.value
    assert err.expected_version == 3 and err.previous_version == 2 and err.observed == observed
    assert "version 3" in str(err) and "version 2" in str(err) and "fix:" in str(err)
    assert err.max_abs_diff > err.tolerance == default_tolerance("mock://")
    # failed within one step: steps 0 and 1 were logged, the step whose refresh went bad (2) was not
    assert [r["step"] for r in read_metrics(tmp_path) if "env/all/reward/total" in r] == [0, 1]


async def test_a_clean_rl_run_logs_the_probe_and_the_refresh_latency(tmp_path):
    await run_rl(rl_config("mock://", max_steps=4), tmp_path)
    steps = [r for r in read_metrics(tmp_path) if "env/all/reward/total" in r]
    assert len(steps) == 4
    for r in steps:
        if r["train/datums"]:  # a step with signal refreshed the sampler
            assert r["refresh/probe_ok"] == 1 and r["refresh/version"] == r["step"] + 1
            assert 0 <= r["refresh/probe_max_abs_diff"] <= 1e-5
            assert r["time/refresh_latency"] >= 0 and r["refresh/probe_inconclusive"] in (0, 1)
    assert any(r["train/datums"] and r["refresh/probe_step_change"] > 1e-3 for r in steps)  # the probe sees learning


async def test_the_probe_can_be_turned_off(tmp_path):
    await run_rl(rl_config("mock://?drop_refresh_at=2", max_steps=3, verify_refresh=False), tmp_path)
    assert not any(k.startswith("refresh/") for r in read_metrics(tmp_path) for k in r)


async def test_refresh_tolerance_is_validated():
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="refresh_tolerance"):
            RLConfig(refresh_tolerance=bad)


async def test_refresh_fault_options_are_validated():
    for url in ("mock://?drop_refresh_at=-1", "mock://?drop_refresh_at=2&repeat_refresh_at=2", "mock://?repeat_refresh_at=x"):
        with pytest.raises(InvalidInputError, match="refresh_at"):
            async with ServiceClient(url):
                pass


async def loop(url: str, steps: int, lr: float = 0.05):
    """(training client, probe, step) -> refresh results of a tight optim_step + refresh + probe loop on a tiny batch."""
    async with ServiceClient(url) as svc:
        tc = await svc.create_lora_training_client(base_model="mock/bigram-tiny", rank=4)
        tokens = probe_tokens(tc.get_tokenizer())
        probe = RefreshProbe(tokens, default_tolerance(url))
        fut = probe.submit(tc)
        await probe.check(0, fut, await tc.save_weights_and_get_sampling_client())
        datum = sft_datum(tokens[:3], tokens[3:9])
        results = []
        old = None
        for version in range(1, steps + 1):
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step({"learning_rate": lr})
            fut = probe.submit(tc)
            sampler = await tc.save_weights_and_get_sampling_client()
            try:
                results.append(await probe.check(version, fut, sampler))
            finally:
                if old is not None:
                    await old.stop()
                old = sampler
        return results, probe


@pytest.mark.once  # long and Python-independent: one Python of the mock matrix runs it
async def test_a_thousand_clean_refreshes_raise_no_false_alarm():
    results, probe = await loop("mock://", 1000, lr=0.05)
    assert len(results) == 1000 and probe.checks == 1001
    assert all(r.max_abs_diff <= 1e-5 for r in results)
    # early steps move the probe clearly; late ones (converged, tiny Adam steps) may be inconclusive, never alarms
    assert results[0].status == "ok" and results[0].step_change > 1e-3
    assert probe.inconclusive == sum(r.status == "inconclusive" for r in results)


async def test_a_step_too_small_to_see_is_inconclusive_not_an_alarm():
    # lr 1e-7 moves the log-probs far less than the tolerance: a dropped refresh cannot be told apart
    results, probe = await loop("mock://?drop_refresh_at=2", 3, lr=1e-7)
    assert [r.status for r in results] == ["inconclusive"] * 3 and probe.inconclusive == 3


@pytest.mark.parametrize(("option", "observed"), [("drop_refresh_at", "previous"), ("repeat_refresh_at", "neither")])
async def test_the_tight_loop_catches_the_bad_refresh_at_its_version(option, observed):
    with pytest.raises(SamplerRefreshError) as info:
        await loop(f"mock://?{option}=5", 10)
    assert (info.value.expected_version, info.value.previous_version, info.value.observed) == (5, 4, observed)


async def test_nan_or_short_log_probs_are_a_mismatch():
    class Fake:
        def __init__(self, values):
            self.values = values

        async def compute_logprobs(self, tokens):
            return self.values

    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client(base_model="mock/bigram-tiny", rank=4)
        probe = RefreshProbe(probe_tokens(tc.get_tokenizer()), 1e-5)
        good = await (await tc.save_weights_and_get_sampling_client()).compute_logprobs(probe.tokens)
        for values in ([None, *[float("nan")] * (len(good) - 1)], good[:-1], [None, *[x + 1e-3 for x in good[1:]]]):
            with pytest.raises(SamplerRefreshError) as info:
                await probe.check(0, probe.submit(tc), Fake(values))
            assert info.value.observed == "neither" and info.value.expected_version == 0
        assert (await probe.check(0, probe.submit(tc), Fake(good))).status == "ok"


async def test_probe_rejects_bad_settings():
    with pytest.raises(ValueError, match="2 tokens"):
        RefreshProbe([1], 1e-3)
    for tol in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="tolerance"):
            RefreshProbe([1, 2], tol)


def test_default_tolerances_by_scheme():
    assert default_tolerance("mock://?seed=1") == 1e-5
    assert default_tolerance("local://") == default_tolerance("http://127.0.0.1:1") == 2e-3
    assert default_tolerance("sagemaker://us-west-2") == 5e-2
    assert np.isclose(default_tolerance("MOCK://"), 1e-5)


async def test_a_resumed_run_whose_adapter_is_applied_twice_fails_before_its_first_step(tmp_path, monkeypatch):
    import asyncsess_mock.backend as mock_backend
    from asyncsess_mock.model import base_table, log_softmax_table

    cfg = rl_config("mock://", max_steps=3)
    await run_rl(cfg, tmp_path)
    doubled = []

    def adapter_twice(logits):  # the first sampler of the resumed run serves base + 2·D
        if not doubled:
            doubled.append(True)
            base = base_table(cfg.base_model, logits.shape[0])
            return log_softmax_table(base + 2 * (logits - base))
        return log_softmax_table(logits)

    monkeypatch.setattr(mock_backend, "log_softmax_table", adapter_twice)
    with pytest.raises(SamplerRefreshError) as info:
        await run_rl(cfg.model_copy(update={"max_steps": 5}), tmp_path)
    assert (info.value.expected_version, info.value.observed) == (3, "neither") and doubled
    assert max(r["step"] for r in read_metrics(tmp_path)) == 2  # no step from 3 on: nothing trained on the bad sampler
