"""Every URL knob has its effect, and faults are reproducible from the seed."""

from __future__ import annotations

import anyio
import pytest

from asyncsess.backends import SampleRequest, SamplerSpec, load_backend
from asyncsess.errors import InvalidInputError, SessionGoneError, TransientError
from asyncsess.types import SamplingParams
from asyncsess_mock import MockBackend, MockConfig
from asyncsess_mock import faults as faults_module


def _fb(session, tok, datum):
    return session.op("forward_backward", data=(datum(tok.encode("fault test")),), loss_fn="cross_entropy")


def test_url_parameters_are_parsed_and_checked():
    b = load_backend("mock://?seed=3&latency_ms=5&fail_rate=0.25&stop_after_ops=7", fail_rate=0.5, api_key="not-ours")
    assert isinstance(b, MockBackend)
    assert (b.config.seed, b.config.latency_ms, b.config.fail_rate, b.config.stop_after_ops) == (3, 5.0, 0.5, 7)
    with pytest.raises(InvalidInputError) as err:
        load_backend("mock://?fail_rat=0.1")
    assert err.value.field == "url" and "fail_rat" in str(err.value)
    with pytest.raises(InvalidInputError) as err:
        load_backend("mock://?fail_rate=1.5")
    assert err.value.field == "url ?fail_rate="
    with pytest.raises(InvalidInputError) as err:
        load_backend("mock://?latency_ms=-1")
    assert err.value.field == "url ?latency_ms="
    with pytest.raises(InvalidInputError):
        load_backend("mock://?stop_after_ops=two")


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    """The seconds the fault injector asked to sleep (it does not wait them)."""
    seconds: list[float] = []
    real_sleep = anyio.sleep

    async def spy(s):
        seconds.append(s)
        await real_sleep(0)

    monkeypatch.setattr(faults_module.anyio, "sleep", spy)
    return seconds


@pytest.mark.anyio
async def test_latency_jitter_and_slow_calls_sleep(open_session, datum, slept):

    b = MockBackend(MockConfig(latency_ms=20))
    s = await open_session(b)
    await b.execute_training(s.id, _fb(s, b.tokenizer, datum))
    sid = await b.create_sampler(SamplerSpec(base_model="m"))
    await b.sample(sid, SampleRequest((1,), 1, SamplingParams(max_tokens=2)))
    await b.compute_logprobs(sid, [1, 2])
    assert slept == [0.02, 0.02, 0.02]  # create/stop calls are not delayed
    slept.clear()
    j = MockBackend(MockConfig(latency_ms=20, jitter_ms=10, slow_rate=1.0, slow_ms=100))
    t = await open_session(j)
    for _ in range(5):
        await j.execute_training(t.id, _fb(t, j.tokenizer, datum))
    assert all(0.12 <= d <= 0.13 for d in slept) and len(set(slept)) == 5
    for backend, x in [(b, s.id), (b, sid), (j, t.id)]:
        await backend.stop_session(x)


@pytest.mark.anyio
async def test_fail_rate_fails_before_applying(open_session, datum):
    b = MockBackend(MockConfig(fail_rate=1.0))
    s = await open_session(b)
    with pytest.raises(TransientError):
        await b.execute_training(s.id, _fb(s, b.tokenizer, datum))
    assert b.applied_log == []
    sid = await b.create_sampler(SamplerSpec(base_model="m"))
    with pytest.raises(TransientError):
        await b.sample(sid, SampleRequest((1,), 1, SamplingParams()))
    with pytest.raises(TransientError):
        await b.compute_logprobs(sid, [1, 2])
    await b.stop_session(sid)

    half = MockBackend(MockConfig(fail_rate=0.5, seed=1))
    t = await open_session(half)
    failures = 0
    for _ in range(6):
        op = _fb(t, half.tokenizer, datum)
        while True:  # the client's retry loop
            try:
                await half.execute_training(t.id, op)
                break
            except TransientError:
                failures += 1
    assert failures >= 1 and [seq for _, seq, _ in half.applied_log] == [1, 2, 3, 4, 5, 6]
    await b.stop_session(s.id)
    await half.stop_session(t.id)


@pytest.mark.anyio
async def test_fault_pattern_is_reproducible_from_the_seed(open_session, datum):
    async def pattern(seed):
        b = MockBackend(MockConfig(fail_rate=0.5, seed=seed))
        s = await open_session(b)
        out = []
        for _ in range(24):
            try:
                await b.execute_training(s.id, _fb(s, b.tokenizer, datum))
                out.append(True)
            except TransientError:
                out.append(False)
                s.seq -= 1  # retry the same seq next time
        await b.stop_session(s.id)
        return out

    assert await pattern(5) == await pattern(5)
    assert await pattern(5) != await pattern(6)


@pytest.mark.anyio
async def test_timeout_rate_hangs_until_the_caller_gives_up(open_session, datum):
    b = MockBackend(MockConfig(timeout_rate=1.0))
    s = await open_session(b)
    with anyio.move_on_after(0.05) as scope:
        await b.execute_training(s.id, _fb(s, b.tokenizer, datum))
    assert scope.cancelled_caught and b.applied_log == []
    short = MockBackend(MockConfig(timeout_rate=1.0, hang_s=0.01))
    t = await open_session(short)
    with pytest.raises(TransientError, match="timeout"):
        await short.execute_training(t.id, _fb(t, short.tokenizer, datum))
    await b.stop_session(s.id)
    await short.stop_session(t.id)


@pytest.mark.anyio
async def test_duplicate_rate_delivers_twice_and_applies_once(open_session, datum):
    b = MockBackend(MockConfig(duplicate_rate=1.0))
    s = await open_session(b)
    sequencer = b._sessions[s.id].sequencer
    deliveries = []
    real = sequencer.execute

    async def counting(op):
        deliveries.append(op.seq)
        return await real(op)

    sequencer.execute = counting
    for _ in range(3):
        await b.execute_training(s.id, _fb(s, b.tokenizer, datum))
    assert sorted(deliveries) == [1, 1, 2, 2, 3, 3]
    assert [seq for _, seq, _ in b.applied_log] == [1, 2, 3]
    await b.stop_session(s.id)


@pytest.mark.anyio
async def test_drop_response_rate_applies_then_raises(open_session, datum):
    b = MockBackend(MockConfig(drop_response_rate=1.0))
    s = await open_session(b)
    with pytest.raises(TransientError, match="lost response"):
        await b.execute_training(s.id, _fb(s, b.tokenizer, datum))
    assert len(b.applied_log) == 1 and b.trainer(s.id).grad.any()
    sid = await b.create_sampler(SamplerSpec(base_model="m"))
    with pytest.raises(TransientError):
        await b.sample(sid, SampleRequest((1,), 1, SamplingParams()))
    assert b.calls["sample"] == 1
    await b.stop_session(sid)
    await b.stop_session(s.id)


@pytest.mark.anyio
async def test_stop_after_ops_stops_the_session_server_side(open_session, datum):
    b = MockBackend(MockConfig(stop_after_ops=2))
    s = await open_session(b)
    await b.execute_training(s.id, _fb(s, b.tokenizer, datum))
    await b.heartbeat(s.id)
    await b.execute_training(s.id, _fb(s, b.tokenizer, datum))
    assert s.id not in MockBackend.open_sessions()  # gone server-side, not leaked
    with pytest.raises(SessionGoneError):
        await b.execute_training(s.id, _fb(s, b.tokenizer, datum))
    with pytest.raises(SessionGoneError):
        await b.heartbeat(s.id)
    await b.stop_session(s.id)  # the client's stop is still fine
    assert len(b.applied_log) == 2


def test_fail_phase_is_checked():
    assert load_backend("mock://?fail_phase=before").config.fail_phase == "before"
    assert load_backend("mock://").config.fail_phase == "after", "the default is the failure after the latency"
    for bad in ("during", "", "BEFORE", "before\x00"):
        with pytest.raises(InvalidInputError) as err:
            MockBackend(MockConfig(fail_phase=bad))
        assert err.value.field == "url ?fail_phase=" and "fail_phase=before" in str(err.value.fix)


@pytest.mark.anyio
async def test_a_refused_call_costs_no_latency_and_the_same_calls_fail_in_both_phases(open_session, datum, slept):
    outcomes = {}
    for phase in ("after", "before"):
        b = MockBackend(MockConfig(latency_ms=20, fail_rate=0.3, fail_phase=phase, seed=4))
        s = await open_session(b)
        failed = []
        slept.clear()
        for i in range(40):  # one at a time, each a fresh seq (a failed op is never applied)
            try:
                await b.execute_training(s.id, s.op("forward", data=(datum(b.tokenizer.encode("x")),), loss_fn="cross_entropy"))
            except TransientError as err:
                assert f"fail_phase={phase}" in str(err)
                failed.append(i)
                s.seq -= 1  # the op was not applied: send the next one under the same number
        outcomes[phase] = failed
        n_ok = 40 - len(failed)
        assert slept == [0.02] * (40 if phase == "after" else n_ok), "a refusal returns at once, a late failure after the latency"
        await b.stop_session(s.id)
    assert outcomes["after"] == outcomes["before"] and 5 < len(outcomes["after"]) < 25
