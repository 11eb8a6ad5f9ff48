"""SampleStore: a sampler's recent answers by request_id (the exactly-once rule for samples)."""

from __future__ import annotations

import pytest

from asyncsess.backends import SampleRequest, SampleStore
from asyncsess.errors import ConflictError
from asyncsess.types import SampledSequence, SampleResponse, SamplingParams


def _request(request_id: str, prompt: tuple[int, ...] = (1, 2), **params) -> SampleRequest:
    return SampleRequest(prompt, 1, SamplingParams(max_tokens=3, **params), request_id=request_id)


def _answer(*tokens: int) -> SampleResponse:
    return SampleResponse(sequences=[SampledSequence(stop_reason="length", tokens=list(tokens), logprobs=[-0.5] * len(tokens))])


def test_a_kept_answer_is_returned_as_a_copy():
    store = SampleStore()
    assert store.lookup(_request("a")) is None
    answer = _answer(7, 8)
    store.add(_request("a"), answer)
    got = store.lookup(_request("a"))
    assert got == answer and got is not answer
    got.sequences[0].tokens.append(9)  # the caller's changes do not reach the store
    assert store.lookup(_request("a")) == _answer(7, 8)


@pytest.mark.parametrize(
    "other",
    [
        _request("a", (1, 3)),
        _request("a", temperature=0.0),
        SampleRequest((1, 2), 2, SamplingParams(max_tokens=3), request_id="a"),
        SampleRequest((1, 2), 1, SamplingParams(max_tokens=3), request_id="a", topk_sample_logprobs=2),
        _request("a", (1, 2) + (0,) * 10_000),
    ],
)
def test_a_kept_id_with_another_request_is_a_conflict(other):
    store = SampleStore()
    store.add(_request("a"), _answer(7))
    with pytest.raises(ConflictError) as err:
        store.lookup(other)
    assert err.value.field == "request_id" and "'a'" in str(err.value) and "retry" in err.value.fix
    assert store.lookup(_request("a")) == _answer(7), "the conflict changed nothing"


@pytest.mark.parametrize("rid", ["", "\x00", "\ud800", "x" * 100_000])
def test_odd_ids_are_kept_by_value_and_an_empty_one_never(rid):
    store = SampleStore()
    store.add(_request(rid), _answer(5))
    if rid:
        assert store.lookup(_request(rid)) == _answer(5) and len(store) == 1
    else:
        assert store.lookup(_request(rid)) is None and len(store) == 0


def test_the_store_keeps_the_newest_and_none_at_keep_0():
    store = SampleStore(keep=3)
    for i in range(5):
        store.add(_request(f"r{i}"), _answer(i))
    assert len(store) == 3
    assert [store.lookup(_request(f"r{i}")) for i in range(5)] == [None, None, _answer(2), _answer(3), _answer(4)]
    store.add(_request("r2"), _answer(2))  # kept again: now the newest
    store.add(_request("r5"), _answer(5))
    assert store.lookup(_request("r3")) is None and store.lookup(_request("r2")) == _answer(2)
    off = SampleStore(keep=0)
    off.add(_request("r0"), _answer(0))
    assert len(off) == 0 and off.lookup(_request("r0")) is None
