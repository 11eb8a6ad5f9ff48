"""Every URL knob has its effect, and faults are reproducible from the seed."""

from __future__ import annotations

import anyio
import pytest

from asyncsess.backends import SampleRequest, SamplerSpec, load_backend
from asyncsess.errors import ConflictError, InvalidInputError, SessionGoneError, TransientError
from asyncsess.types import SampleResponse, SamplingParams
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


@pytest.mark.anyio
async def test_a_lost_training_answer_is_fetched_from_the_store_without_the_latency(open_session, datum, slept):
    b = MockBackend(MockConfig(latency_ms=20, jitter_ms=5, slow_rate=0.5, slow_ms=100, fetch_ms=1, drop_response_rate=1.0))
    s = await open_session(b)
    op = _fb(s, b.tokenizer, datum)
    for _ in range(3):  # every answer is lost, the fetches' too: the client's retry loop resends the same seq + key
        with pytest.raises(TransientError, match="lost response"):
            await b.execute_training(s.id, op)
    assert slept[0] >= 0.02 and slept[1:] == [0.001, 0.001], "one op latency, then one fetch round trip per retry"
    assert b.applied_log == [(s.id, 1, "forward_backward")]
    free = MockBackend(MockConfig(latency_ms=20, drop_response_rate=1.0))  # fetch_ms defaults to 0: a fetch does not sleep
    t = await open_session(free)
    slept.clear()
    op = _fb(t, free.tokenizer, datum)
    for _ in range(2):
        with pytest.raises(TransientError):
            await free.execute_training(t.id, op)
    assert slept == [0.02]
    for backend, sid in [(b, s.id), (free, t.id)]:
        await backend.stop_session(sid)


@pytest.mark.anyio
async def test_an_op_that_was_never_applied_pays_the_full_latency_again(open_session, datum, slept):
    b = MockBackend(MockConfig(latency_ms=20, fetch_ms=1, fail_rate=1.0))
    s = await open_session(b)
    op = _fb(s, b.tokenizer, datum)
    for _ in range(2):
        with pytest.raises(TransientError, match="injected failure"):
            await b.execute_training(s.id, op)
    assert slept == [0.02, 0.02] and b.applied_log == []
    await b.stop_session(s.id)


@pytest.mark.anyio
async def test_a_fetch_draws_the_same_faults_as_a_full_call(open_session, datum, slept, monkeypatch):
    """Whether a retry is answered from the store changes its sleep, never which later calls fail."""
    from asyncsess.backends.sequencer import Sequencer

    async def outcomes() -> tuple[list[str], list[float]]:
        b = MockBackend(MockConfig(latency_ms=10, jitter_ms=4, slow_rate=0.3, slow_ms=50, fail_rate=0.3, drop_response_rate=0.4, seed=8))
        s = await open_session(b)
        slept.clear()
        out = []
        for _ in range(12):
            op = _fb(s, b.tokenizer, datum)
            while True:  # the client's retry loop
                try:
                    await b.execute_training(s.id, op)
                    out.append("ok")
                    break
                except TransientError as err:
                    out.append("lost" if err.lost_response else "failed")
        assert [seq for _, seq, _ in b.applied_log] == list(range(1, 13))
        await b.stop_session(s.id)
        return out, list(slept)

    fetched, fetch_sleeps = await outcomes()
    monkeypatch.setattr(Sequencer, "stored", lambda self, op: False)  # every retry pays the full latency
    full, full_sleeps = await outcomes()
    assert fetched == full, "the same calls fail, lose their answer or succeed"
    assert "lost" in fetched and "failed" in fetched
    n_fetches, applied = 0, False
    for outcome in fetched:  # once an op's answer was lost, every later call for it is a fetch
        n_fetches += applied
        applied = outcome == "lost" or (applied and outcome != "ok")
    assert n_fetches >= 2 and fetch_sleeps.count(0.0) == 0
    assert len(full_sleeps) - len(fetch_sleeps) == n_fetches, "a fetch (fetch_ms=0) does not sleep"
    assert [d for d in full_sleeps if d not in fetch_sleeps] and set(fetch_sleeps) <= set(full_sleeps)


def _sample_request(prompt: tuple[int, ...], request_id: str, **params) -> SampleRequest:
    return SampleRequest(prompt, 2, SamplingParams(max_tokens=4, **params), request_id=request_id)


@pytest.fixture
def sampled(monkeypatch) -> list[tuple[int, ...]]:
    """The prompts the mock's sampler actually sampled (a stored answer is not sampled again)."""
    from asyncsess_mock.sampler import MockSampler

    prompts: list[tuple[int, ...]] = []
    real = MockSampler.sample

    def spy(self, request, request_no, sampler_id):
        prompts.append(request.prompt)
        return real(self, request, request_no, sampler_id)

    monkeypatch.setattr(MockSampler, "sample", spy)
    return prompts


@pytest.mark.anyio
async def test_a_lost_sample_is_answered_from_the_store(slept, sampled):
    b = MockBackend(MockConfig(latency_ms=20, fetch_ms=1, drop_response_rate=0.5, seed=1))
    sid = await b.create_sampler(SamplerSpec(base_model="m"))

    async def until_answered(request: SampleRequest) -> tuple[SampleResponse, int]:
        lost = 0
        while True:  # the client's retry loop: the same request, the same request_id
            try:
                return await b.sample(sid, request), lost
            except TransientError as err:
                assert err.lost_response
                lost += 1

    request = _sample_request((1, 40), "r-1")  # unseeded: sampling it again would draw other tokens
    answer, lost = await until_answered(request)
    assert lost >= 1, "seed 1 loses the first answer"
    assert sampled == [(1, 40)], "sampled once, however many times its answer was lost"
    assert slept == [0.02] + [0.001] * lost
    again, _ = await until_answered(request)
    assert again == answer and again is not answer, "the same answer, not an object the caller could have changed"
    fresh, _ = await until_answered(_sample_request((1, 40), "r-2"))
    assert len(sampled) == 2 and fresh.sequences != answer.sequences, "a new request_id is a new request"
    await b.stop_session(sid)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "other",
    [
        _sample_request((1, 41), "r-1"),  # another prompt
        _sample_request((1, 40), "r-1", temperature=0.5),  # another sampling parameter
        SampleRequest((1, 40), 3, SamplingParams(max_tokens=4), request_id="r-1"),  # another count
        SampleRequest((1, 40), 2, SamplingParams(max_tokens=4), include_prompt_logprobs=True, request_id="r-1"),
    ],
)
async def test_a_request_id_reused_for_another_request_is_a_conflict_not_the_old_answer(other, sampled):
    b = MockBackend()
    sid = await b.create_sampler(SamplerSpec(base_model="m"))
    await b.sample(sid, _sample_request((1, 40), "r-1"))
    with pytest.raises(ConflictError) as err:
        await b.sample(sid, other)
    assert err.value.field == "request_id" and "r-1" in str(err.value) and err.value.fix
    assert len(sampled) == 1
    other_sampler = await b.create_sampler(SamplerSpec(base_model="m"))
    await b.sample(other_sampler, other)  # request ids are per sampler
    no_id = _sample_request((1, 40), "")
    first, second = await b.sample(sid, no_id), await b.sample(sid, no_id)  # no request_id: never stored
    assert len(sampled) == 4 and first.sequences != second.sequences
    for x in (sid, other_sampler):
        await b.stop_session(x)


@pytest.mark.anyio
async def test_the_sample_store_keeps_the_newest_answers(sampled):
    b = MockBackend(MockConfig(keep_samples=2))
    sid = await b.create_sampler(SamplerSpec(base_model="m"))
    for i in range(3):
        await b.sample(sid, _sample_request((1, 40 + i), f"r-{i}"))
    await b.sample(sid, _sample_request((1, 42), "r-2"))  # kept
    await b.sample(sid, _sample_request((1, 41), "r-1"))  # kept
    assert len(sampled) == 3
    await b.sample(sid, _sample_request((1, 40), "r-0"))  # the oldest was evicted: sampled again
    assert sampled == [(1, 40), (1, 41), (1, 42), (1, 40)]
    off = MockBackend(MockConfig(keep_samples=0))
    oid = await off.create_sampler(SamplerSpec(base_model="m"))
    for _ in range(2):
        await off.sample(oid, _sample_request((1, 40), "r-0"))
    assert len(sampled) == 6, "keep_samples=0 keeps nothing"
    for backend, x in [(b, sid), (off, oid)]:
        await backend.stop_session(x)
