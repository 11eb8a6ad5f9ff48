"""The retry schedule: the first retry at once while faults are rare, backoff after, and never a hammered backend."""

from __future__ import annotations

import anyio
import pytest

from asyncsess import RateLimitError, RetriesExhaustedError, RetryPolicy, SamplingParams, ServiceClient, TransientError
from asyncsess.retry import RetryBudget, _delay
from asyncsess.rl.data import sft_datum

pytestmark = pytest.mark.anyio

STEPPED = RetryPolicy(max_attempts=5, initial_backoff=0.001, max_backoff=0.004, jitter=0.0)


async def test_the_first_retry_goes_at_once_and_later_ones_back_off_exponentially():
    seen = []
    async with ServiceClient("mock://?fail_rate=1.0", retry=STEPPED, on_retry=seen.append, heartbeat_interval=0) as svc:
        tc = await svc.create_lora_training_client("m", rank=4)
        with pytest.raises(RetriesExhaustedError):
            await tc.forward_backward([sft_datum([1, 40], [41])])
        assert [e.attempt for e in seen] == [1, 2, 3, 4]
        assert [e.sleep for e in seen] == [0.0, 0.002, 0.004, 0.004]  # capped at max_backoff
        assert svc.backend.calls["execute_training"] == 5 and svc.backend.applied_log == []


async def test_the_old_schedule_backs_off_every_retry_but_still_fetches_a_lost_answer_at_once():
    old = RetryPolicy(initial_backoff=0.001, max_backoff=0.004, jitter=0.0, immediate_first_retry=False)
    assert _delay(old, 1, TransientError("503")) == 0.001
    assert _delay(old, 1, TransientError("dropped", lost_response=True)) == 0.0
    assert _delay(old, 2, TransientError("503")) == 0.002


async def test_a_failing_backend_is_not_hammered_by_immediate_retries():
    """40 concurrent requests against a backend that fails every call: the client's budget lets only the first
    few failures retry at once; every other retry sleeps its full exponential backoff."""
    seen = []
    policy = RetryPolicy(max_attempts=4, initial_backoff=0.001, max_backoff=0.01, jitter=0.0)
    async with ServiceClient("mock://?fail_rate=1.0", retry=policy, on_retry=seen.append, heartbeat_interval=0) as svc:
        sc = await svc.create_sampling_client(base_model="m")
        errors = []

        async def one(i: int) -> None:
            try:
                await sc.sample([1, 40], 1, SamplingParams(max_tokens=1, seed=i))
            except RetriesExhaustedError as err:
                errors.append(err)

        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(one, i)
        assert len(errors) == 40
        assert svc.backend.calls["sample"] == 40 * 4, "max_attempts bounds the tries per request"
        immediate = [e for e in seen if e.sleep == 0.0]
        assert 1 <= len(immediate) <= 9, "the budget (20 tokens, half kept) allows at most 9 retries without a sleep"
        assert all(e.attempt == 1 for e in immediate)
        assert all(e.sleep == 0.001 * 2 ** (e.attempt - 1) for e in seen if e.sleep != 0.0)
        assert len(seen) == 40 * 3 and sum(e.sleep for e in seen) >= 40 * 0.007 - 9 * 0.001, "the rest backed off 1 + 2 + 4 ms"
        assert svc.retry_budget.tokens == 0.0


def test_the_budget_holds_at_rare_faults_drains_when_they_are_common_and_refills_on_success():
    rare = RetryBudget()
    for _ in range(200):  # one failed try in four (20 % of tries): the bucket stays full enough
        assert rare.failed()
        for _ in range(4):
            rare.succeeded()
    common = RetryBudget()
    allowed = []
    for _ in range(50):  # one failed try in two
        allowed.append(common.failed())
        common.succeeded()
    assert allowed[:10] == [True] * 10 and not any(allowed[-20:])
    drained = RetryBudget()
    assert [drained.failed() for _ in range(11)] == [True] * 9 + [False] * 2
    lost = TransientError("connection dropped while reading", lost_response=True)
    assert not any(drained.failed(lost) for _ in range(5)) and drained.tokens == 9.0, "a lost answer spends nothing"
    for _ in range(10):
        drained.succeeded()
    assert drained.failed(), "ten successes earn immediate retries back"
    lossy = RetryBudget()
    assert all(lossy.failed(lost) for _ in range(100)), "lost answers alone never drain it"


async def test_retry_after_is_honoured_exactly_on_a_first_retry_and_never_cut_short(monkeypatch):
    seen = []
    policy = RetryPolicy(initial_backoff=0.001, max_backoff=0.002, jitter=0.001)
    async with ServiceClient("mock://", retry=policy, on_retry=seen.append, heartbeat_interval=0) as svc:
        sc = await svc.create_sampling_client(base_model="m")
        real = svc.backend.sample
        left = {"n": 2}

        async def throttled(sampler_id, request):
            if left["n"]:
                left["n"] -= 1
                raise RateLimitError("slow down", retry_after=0.03)
            return await real(sampler_id, request)

        monkeypatch.setattr(svc.backend, "sample", throttled)
        await sc.sample([1, 40], 1)
        assert [e.sleep for e in seen] == [0.03, 0.03], "the hint beats a shorter backoff, with no jitter added"
    assert _delay(RetryPolicy(jitter=0.0), 3, RateLimitError("slow", retry_after=0.5)) == 0.8, "a longer backoff wins"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("initial_backoff", float("nan")),
        ("initial_backoff", -0.1),
        ("initial_backoff", float("inf")),
        ("max_backoff", float("nan")),
        ("max_backoff", float("inf")),
        ("max_backoff", -1),
        ("jitter", float("nan")),
        ("jitter", -1e-9),
        ("attempt_timeout", float("nan")),
        ("attempt_timeout", float("inf")),
        ("attempt_timeout", 0),
        ("attempt_timeout", -5),
        ("deadline", float("nan")),
        ("deadline", float("inf")),
        ("deadline", -1.0),
        ("deadline", 0.0),
        ("deadline", "60"),
        ("max_attempts", 0),
        ("max_attempts", -3),
        ("max_attempts", 2.5),
        ("max_attempts", float("nan")),
        ("max_attempts", True),
    ],
)
def test_a_policy_with_a_value_that_is_not_a_finite_number_in_range_is_refused_naming_it(field, value):
    """NaN made every sleep NaN (anyio refuses it mid-op), a negative backoff a ValueError from the sleep, and an
    infinite one or deadline a hang: each is refused when the policy is built."""
    from asyncsess import InvalidInputError

    with pytest.raises(InvalidInputError) as err:
        RetryPolicy(**{field: value})
    assert err.value.field == field and err.value.fix


def test_the_limits_of_a_policy_are_still_accepted():
    assert RetryPolicy(initial_backoff=0, max_backoff=0, jitter=0, attempt_timeout=None, deadline=None).deadline is None
    assert RetryPolicy.none().max_attempts == 1 and RetryPolicy(attempt_timeout=1e-3, deadline=1e9).deadline == 1e9


async def test_a_hint_that_is_nan_negative_or_garbage_never_becomes_the_sleep():
    policy = RetryPolicy(initial_backoff=0.001, max_backoff=0.001, jitter=0.0)
    for hint in (float("nan"), -1.0, float("inf"), "soon", [3]):
        err = RateLimitError("slow", retry_after=hint)  # type: ignore[arg-type]
        assert _delay(policy, 1, err) == 0.0 and _delay(policy, 2, err) == 0.001
