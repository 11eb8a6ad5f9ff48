"""Fault recovery: retried ops are applied exactly once; nothing hangs; only transient faults are retried."""

from __future__ import annotations

from collections import Counter

import anyio
import numpy as np
import pytest

from asyncsess import (
    DeadlineExceededError,
    InvalidInputError,
    RetriesExhaustedError,
    RetryPolicy,
    ServiceClient,
    SessionGoneError,
    TransientError,
)
from asyncsess.rl.data import sft_datum

pytestmark = pytest.mark.anyio

FAST = RetryPolicy(max_attempts=12, initial_backoff=0.001, max_backoff=0.005, jitter=0.001)


async def _grpo(url: str, steps: int) -> tuple[np.ndarray, list]:
    from examples.grpo_toy import train

    history, path = await train(url, steps=steps, seed=5)
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_training_client_from_state(path)
        return svc.backend.weights(tc.model_id), history


async def test_50_step_grpo_under_faults_is_bit_identical_and_applies_each_op_once(monkeypatch):
    import examples.grpo_toy as grpo

    logs = []
    retries = []
    real_cls = grpo.ServiceClient

    def recording(url, **kw):
        svc = real_cls(url, retry=FAST, on_retry=retries.append, **kw)
        logs.append(svc)
        return svc

    monkeypatch.setattr(grpo, "ServiceClient", recording)
    clean, hist_clean = await _grpo("mock://", 50)
    faulty, hist_faulty = await _grpo("mock://?fail_rate=0.2&drop_response_rate=0.1&seed=11", 50)
    assert np.array_equal(clean, faulty), "faults must not change a single bit of the weights"
    assert hist_clean == hist_faulty
    assert len(retries) > 50, "the faults were real and were retried"
    applied = logs[1].backend.applied_log
    counts = Counter((sid, seq) for sid, seq, _ in applied)
    assert counts and max(counts.values()) == 1, "each (client, seq) applied exactly once"
    assert {e.error.__class__ for e in retries} == {TransientError}


async def test_a_backend_that_never_answers_times_out_at_the_deadline():
    policy = RetryPolicy(max_attempts=100, initial_backoff=0.001, max_backoff=0.002, jitter=0.0, attempt_timeout=0.05, deadline=0.3)
    async with ServiceClient("mock://?timeout_rate=1.0", retry=policy) as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        with pytest.raises(DeadlineExceededError) as err:
            await tc.forward_backward([sft_datum([1, 40], [41])])
        assert err.value.seq == 1 and err.value.operation == "forward_backward"
        sc = await svc.create_sampling_client(base_model="m")
        with pytest.raises(DeadlineExceededError):
            await sc.sample([1, 40], 1)


async def test_retryable_faults_are_retried_up_to_the_limit():
    seen = []
    policy = RetryPolicy(max_attempts=4, initial_backoff=0.001, max_backoff=0.002, jitter=0.0)
    async with ServiceClient("mock://?fail_rate=1.0", retry=policy, on_retry=seen.append) as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        with pytest.raises(RetriesExhaustedError) as err:
            await tc.forward_backward([sft_datum([1, 40], [41])])
        assert err.value.attempts == 4 and isinstance(err.value.__cause__, TransientError)
        assert [e.attempt for e in seen] == [1, 2, 3] and svc.retries == 3
        assert svc.backend.applied_log == []


async def test_non_retryable_errors_are_not_retried(monkeypatch):
    seen = []
    async with ServiceClient("mock://", retry=FAST, on_retry=seen.append) as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        calls = []

        async def refusing(session_id, op):  # what only the backend can judge (a remote one's 400)
            calls.append(op.seq)
            raise InvalidInputError("the backend refuses this op", field="name", fix="pass another one")

        monkeypatch.setattr(svc.backend, "execute_training", refusing)
        with pytest.raises(InvalidInputError) as err:
            await tc.save_state("x")
        assert calls == [1] and seen == []
        assert err.value.seq == 1 and err.value.request_id


async def test_retry_after_hint_is_honoured(monkeypatch):
    seen = []
    async with ServiceClient("mock://", retry=FAST, on_retry=seen.append) as svc:
        sc = await svc.create_sampling_client(base_model="m")
        real = svc.backend.sample
        state = {"n": 0}

        async def throttled(sampler_id, request):
            state["n"] += 1
            if state["n"] == 1:
                raise TransientError("slow down", retry_after=0.05)
            return await real(sampler_id, request)

        monkeypatch.setattr(svc.backend, "sample", throttled)
        await sc.sample([1, 40], 1)
        assert len(seen) == 1 and seen[0].sleep >= 0.05


async def test_a_lost_response_is_fetched_at_once_and_applied_once():
    """Only the answer was lost: the first retry goes out without a backoff and gets the stored result."""
    seen = []
    slow = RetryPolicy(initial_backoff=30.0, max_backoff=30.0, jitter=0.0)  # a backoff here would stall the test
    async with ServiceClient("mock://", retry=slow, on_retry=seen.append) as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        faults = svc.backend._sessions[tc.model_id].faults
        lost = iter([True])

        def drop_first(what: str) -> None:  # the op is applied, then its answer is lost once
            if next(lost, False):
                raise TransientError("connection dropped while reading", lost_response=True, operation=what)

        faults.drop_response = drop_first
        with anyio.fail_after(20):  # guards against a hang only: a 30 s backoff would trip it
            out = await tc.forward_backward([sft_datum([1, 40], [41])])
        assert out.metrics
        assert [e.sleep for e in seen] == [0.0]
        assert [kind for _, _, kind in svc.backend.applied_log].count("forward_backward") == 1


async def test_a_lost_sample_is_retried_under_its_request_id_and_answered_from_the_store(monkeypatch):
    """Each logical sample has one request_id, sent again by its retries; the backend answers a retry from
    its store, so even unseeded samples come out as in a fault-free run."""
    from asyncsess_mock.sampler import MockSampler

    sampled = []
    real_sample = MockSampler.sample

    def spy(self, request, request_no, sampler_id):
        sampled.append(request.request_id)
        return real_sample(self, request, request_no, sampler_id)

    monkeypatch.setattr(MockSampler, "sample", spy)

    async def run(url: str) -> tuple[list, list[str]]:
        sent: list[str] = []
        async with ServiceClient(url, retry=FAST) as svc:
            sc = await svc.create_sampling_client(base_model="m")
            real = svc.backend.sample

            async def recording(sampler_id, request):
                sent.append(request.request_id)
                return await real(sampler_id, request)

            monkeypatch.setattr(svc.backend, "sample", recording)
            out = [await sc.sample([1, 40], 2, {"max_tokens": 6}) for _ in range(12)]  # no seed: a resample would differ
            assert svc.retries == len(sent) - 12
        return [[s.tokens for s in r.sequences] for r in out], sent

    clean, _ = await run("mock://?seed=2")
    sampled.clear()
    faulty, sent = await run("mock://?seed=2&drop_response_rate=0.4")
    assert faulty == clean
    assert len(sent) > 15, "answers were lost and retried"
    assert len(set(sent)) == 12 and all(sent), "one request_id per logical request, reused by its retries"
    assert sent == sorted(sent, key=sent.index), "a request's retries follow it, under its id"
    assert sampled == list(dict.fromkeys(sent)), "each request sampled once: every retry was answered from the store"


async def test_throttling_is_backed_off_even_when_the_response_was_lost():
    from asyncsess.retry import _delay

    err = TransientError("lost, and slow down", lost_response=True, retry_after=2.0)
    assert _delay(RetryPolicy(), 1, err) == 2.0
    assert _delay(RetryPolicy(jitter=0.0), 2, TransientError("lost", lost_response=True)) == pytest.approx(0.4)


async def test_remote_stop_surfaces_as_session_gone_not_a_hang():
    async with ServiceClient("mock://?stop_after_ops=2", retry=FAST) as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        await tc.forward_backward([sft_datum([1, 40], [41])])
        await tc.optim_step()
        with pytest.raises(SessionGoneError):
            await tc.forward_backward([sft_datum([1, 40], [41])])
        with pytest.raises(SessionGoneError):
            tc.optim_step()  # known gone: fails at call time


async def test_duplicated_and_slow_deliveries_are_harmless():
    async with ServiceClient("mock://?duplicate_rate=0.5&slow_rate=0.3&slow_ms=5&jitter_ms=3&seed=2", retry=FAST) as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        futs = [tc.forward_backward([sft_datum([1, 40 + i], [41])]) for i in range(10)]
        for f in futs:
            await f
        seqs = [seq for sid, seq, _ in svc.backend.applied_log if sid == tc.model_id]
        assert seqs == list(range(1, 11))
        await anyio.sleep(0)


async def test_heartbeat_notices_a_remote_stop_before_the_next_op():
    async with ServiceClient("mock://?stop_after_ops=1", retry=FAST, heartbeat_interval=0.02) as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        await tc.forward_backward([sft_datum([1, 40], [41])])
        for _ in range(100):
            if svc.backend.calls["heartbeat"] >= 2:
                break
            await anyio.sleep(0.02)
        with pytest.raises(SessionGoneError):
            tc.optim_step()  # refused at call time: the heartbeat already saw the session go
        assert tc.current_sequence_number == 1


@pytest.mark.parametrize("phase", ["after", "before"])
async def test_grpo_at_20_percent_faults_retries_at_once_and_stays_bit_identical(monkeypatch, phase):
    """Issue 19's fault-ratio run, without a clock: at 20 % failed calls (+10 % lost answers) the client's
    retry budget never drains, so every first retry goes out at once and only the rare second retries
    sleep; the weights are bit-identical to a fault-free run whichever phase the failures come in."""
    import examples.grpo_toy as grpo
    from asyncsess.retry import _delay

    policy = RetryPolicy(max_attempts=12, initial_backoff=0.001, max_backoff=0.01, jitter=0.0)
    retries = []
    real_cls = grpo.ServiceClient
    monkeypatch.setattr(grpo, "ServiceClient", lambda url, **kw: real_cls(url, retry=policy, on_retry=retries.append, **kw))
    clean, _ = await _grpo("mock://", 30)
    faulty, _ = await _grpo(f"mock://?fail_rate=0.2&fail_phase={phase}&drop_response_rate=0.1&seed=3", 30)
    assert np.array_equal(clean, faulty)
    first = [e for e in retries if e.attempt == 1]
    later = [e for e in retries if e.attempt > 1]
    assert len(first) > 30 and all(e.sleep == 0.0 for e in first), "every first retry went out at once"
    assert all(e.sleep >= 0.002 for e in later), "a second failure in a row backs off"
    assert len(later) < len(first) / 2
    old = RetryPolicy(max_attempts=12, initial_backoff=0.001, max_backoff=0.01, jitter=0.0, immediate_first_retry=False)
    old_sleep = sum(_delay(old, e.attempt, e.error) for e in retries)
    saved = sum(_delay(old, 1, e.error) for e in first)  # what the old schedule slept before each first retry
    assert saved > 0 and sum(e.sleep for e in retries) == pytest.approx(old_sleep - saved), "only first retries skip the sleep"
