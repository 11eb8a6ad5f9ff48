"""``tinker://`` against a Tinker-wire server we did not write (buggy, another version, hostile): every answer ends in
a typed error, or a correct retry and success, within the op's deadline; never a raw exception or a wrong result."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from typing import Any

import pytest

from asyncsess import RetryPolicy, SamplingParams
from asyncsess.backends import ForwardBackwardOp, OptimStepOp, SampleRequest
from asyncsess.errors import APIResponseValidationError, AsyncSessError, DeadlineExceededError, TransientError, is_retryable
from asyncsess.retry import MAX_RETRY_AFTER, call_with_retry
from asyncsess.serve import tinker_proto
from asyncsess.types import ForwardBackwardOutput, SampledSequence, SampleResponse, TensorData
from asyncsess_tinker import TinkerBackend
from tests.client.helpers import sft_datum
from tests.client.rogue_server import Act, Seen, response, rogue_server

pytestmark = pytest.mark.anyio

KEY = "tml-hostile-test"
PROTO = {"content-type": "application/x-protobuf"}
FAST = RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.002, jitter=0.0, deadline=0.5)

SAMPLE = tinker_proto.encode_sample_response(
    SampleResponse(sequences=[SampledSequence(stop_reason="length", tokens=[5, 6], logprobs=[-0.5, -0.25])])
)
FB = tinker_proto.encode_forward_backward_output(
    ForwardBackwardOutput(
        loss_fn_outputs=[{"logprobs": TensorData(data=[-1.0, -2.0], dtype="float32", shape=[2])}], metrics={"loss:sum": 3.0}
    )
)


class Wire:
    """A Tinker-wire server that answers well, except where a test puts another answer in ``bad[path]``."""

    def __init__(self, **bad: bytes | Act) -> None:
        self.bad = bad  # route (the path after /api/v1/, no query) or "future:<route>" (its retrieve_future) -> answer
        self.futures: dict[str, str] = {}

    def future(self, kind: str) -> bytes:
        rid = f"req-{len(self.futures)}"
        self.futures[rid] = kind
        return response(200, {"request_id": rid})

    def __call__(self, seen: Seen) -> bytes | Act:
        name = seen.path.removeprefix("/api/v1/").partition("?")[0]
        if name in self.bad:
            return self.bad[name]
        if name == "retrieve_future":
            kind = self.futures[seen.json()["request_id"]]
            answers = {
                "create_model": response(200, {"model_id": "run-1"}),
                "optim_step": response(200, {"metrics": {"lr": 0.1}}),
                "asample": response(200, SAMPLE, headers=PROTO),
                "forward_backward": response(200, FB, headers=PROTO),
            }
            return self.bad.get(f"future:{kind}", answers[kind])
        if name in ("create_model", "optim_step", "asample", "forward_backward"):
            return self.future(name)
        return response(
            200,
            {
                "client/config": {},
                "create_session": {"session_id": "sess-1"},
                "get_info": {"model_data": {"model_name": "m"}},
                "create_sampling_session": {"sampling_session_id": "samp-1"},
                "get_server_capabilities": {"supported_models": [{"model_name": "m"}]},
            }.get(name, {}),
        )


async def drive(wire: Wire, call: Callable[[TinkerBackend], Any], **options: Any) -> Any:
    """Open a driver on ``wire``, make a model and a sampler, then ``call``: its result, or the exception raised."""
    async with rogue_server(wire) as rogue:
        b = TinkerBackend(rogue.url, KEY, **options)
        try:
            await b.open()
            return await call(b)
        except Exception as err:
            return err
        finally:
            await b.aclose()


async def sample(b: TinkerBackend) -> Any:
    from asyncsess.backends import SamplerSpec

    sid = await b.create_sampler(SamplerSpec(base_model="m"))
    return await b.sample(sid, SampleRequest(prompt=(1, 2), num_samples=1, sampling_params=SamplingParams(max_tokens=2)))


async def train(b: TinkerBackend) -> Any:
    from asyncsess.backends import TrainingSessionSpec

    info = await b.create_training_session(TrainingSessionSpec(base_model="m", rank=4))
    return await b.execute_training(info.model_id, ForwardBackwardOp(seq=1, idempotency_key="k", data=(sft_datum([1, 2, 3]),)))


async def optim(b: TinkerBackend) -> Any:
    return await b.execute_training("run-1", OptimStepOp(seq=1, idempotency_key="k"))


async def test_the_well_behaved_wire_gives_the_right_answers() -> None:
    out = await drive(Wire(), sample)
    assert isinstance(out, SampleResponse) and out.sequences[0].tokens == [5, 6]
    fb = await drive(Wire(), train)
    assert isinstance(fb, ForwardBackwardOutput) and fb.loss_fn_outputs[0]["logprobs"].data == [-1.0, -2.0]


NOT_JSON = response(200, b"<html>gateway</html>")
A_LIST = response(200, b"[1]")
NO_KEY = response(200, {"unexpected": True})
WRONG_TYPE = response(200, {"session_id": 5, "request_id": [], "sampling_session_id": None, "model_id": {}, "path": 1})
CASES = [
    ("client/config", A_LIST, sample),
    ("create_session", NOT_JSON, sample),
    ("create_session", NO_KEY, sample),
    ("create_session", WRONG_TYPE, sample),
    ("create_sampling_session", A_LIST, sample),
    ("create_sampling_session", WRONG_TYPE, sample),
    ("asample", NO_KEY, sample),
    ("asample", WRONG_TYPE, sample),
    ("future:asample", response(200, b"\xff\x00not protobuf", headers=PROTO), sample),
    ("future:asample", response(200, {"sequences": []}), sample),  # JSON where protobuf was asked
    ("create_model", NOT_JSON, train),
    ("future:create_model", NO_KEY, train),
    ("future:create_model", WRONG_TYPE, train),
    ("get_info", A_LIST, train),
    ("get_info", response(200, {"model_data": "x"}), train),
    ("get_info", response(200, {"lora_rank": "eight"}), train),
    ("forward_backward", A_LIST, train),
    ("future:forward_backward", response(200, b"\x08\x01garbage" * 3, headers=PROTO), train),
    ("future:optim_step", A_LIST, optim),
    ("future:optim_step", response(200, {"metrics": "fast"}), optim),
    ("retrieve_future", NOT_JSON, optim),
    ("get_server_capabilities", response(200, {"supported_models": [{"model_name": 3, "vocab_size": "big"}]}), lambda b: b.capabilities()),
    ("get_server_capabilities", response(200, {"supported_models": "all"}), lambda b: b.capabilities()),
    ("checkpoints", response(200, {"checkpoints": [{"no_id": 1}], "cursor": {"total_count": 1}}), lambda b: b.list_checkpoints()),
    ("checkpoints", response(200, {"checkpoints": "many"}), lambda b: b.list_checkpoints()),
]


@pytest.mark.parametrize(("path", "bad", "call"), CASES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(CASES)])
async def test_a_malformed_answer_on_any_route_is_a_typed_error(path: str, bad: bytes, call: Callable[[TinkerBackend], Any]) -> None:
    got = await drive(Wire(**{path: bad}), call)
    assert isinstance(got, APIResponseValidationError), repr(got)


def _sample_answer(*sequences: SampledSequence) -> bytes:
    return response(200, tinker_proto.encode_sample_response(SampleResponse(sequences=list(sequences))), headers=PROTO)


@pytest.mark.parametrize(
    "bad",
    [
        _sample_answer(),  # no sequence for num_samples=1
        _sample_answer(*[SampledSequence(stop_reason="stop", tokens=[1])] * 2),  # two
        _sample_answer(SampledSequence(stop_reason="stop", tokens=[1, 2, 3], logprobs=[-1.0])),  # fewer log-probs than tokens
        _sample_answer(SampledSequence(stop_reason="stop", tokens=[-7])),  # a token id no vocabulary has
    ],
    ids=["none", "two", "short logprobs", "negative id"],
)
async def test_a_sample_answer_that_does_not_fit_the_request_is_refused(bad: bytes) -> None:
    got = await drive(Wire(**{"future:asample": bad}), sample)
    assert isinstance(got, APIResponseValidationError), repr(got)


@pytest.mark.parametrize("rows", [[], [[-1.0, -2.0]] * 2, [[-1.0]]], ids=["no output", "two outputs", "one row short"])
async def test_a_forward_backward_answer_that_does_not_fit_the_datums_is_refused(rows: list[list[float]]) -> None:
    outputs = [{"logprobs": TensorData(data=r, dtype="float32", shape=[len(r)])} for r in rows]
    raw = tinker_proto.encode_forward_backward_output(ForwardBackwardOutput(loss_fn_outputs=outputs))
    got = await drive(Wire(**{"future:forward_backward": response(200, raw, headers=PROTO)}), train)
    assert isinstance(got, APIResponseValidationError), repr(got)


@pytest.mark.parametrize("value", ["nan", "-1", "1e308", "garbage", "Wed, 21 Oct 2015 07:28:00 GMT", "9" * 500])
@pytest.mark.parametrize("status", [429, 503])
async def test_a_throttles_retry_after_of_any_spelling_is_a_transient_error_with_a_sane_hint(status: int, value: str) -> None:
    """``float(retry-after)`` raised ValueError on garbage or a date and kept NaN."""
    got = await drive(Wire(asample=response(status, b"busy", headers={"retry-after": value})), sample)
    assert isinstance(got, TransientError) and is_retryable(got)
    assert got.retry_after is None or 0 <= got.retry_after <= MAX_RETRY_AFTER


@pytest.mark.parametrize(
    "body",
    [b"[1, 2]", b'"text"', b"null", b'{"error": {"nested": 1}, "field": 3, "fix": []}', b"\xff"],
    ids=["list", "str", "null", "odd", "bytes"],
)
@pytest.mark.parametrize("status", [400, 401, 404, 409, 410, 413, 422, 500, 502])
async def test_an_error_body_of_any_shape_is_a_typed_error(body: bytes, status: int) -> None:
    got = await drive(Wire(asample=response(status, body)), sample)
    assert isinstance(got, AsyncSessError) and isinstance(str(got), str)
    assert is_retryable(got) == (status >= 500)


@pytest.mark.parametrize("status", [301, 302, 307, 308])
async def test_a_redirect_is_not_followed_and_the_key_stays_home(status: int) -> None:
    async with rogue_server(lambda _: response(200, {})) as elsewhere:
        got = await drive(Wire(asample=response(status, b"", headers={"location": f"{elsewhere.url}/api/v1/asample"})), sample)
    assert isinstance(got, APIResponseValidationError) and "redirect" in str(got)
    assert elsewhere.seen == []


async def test_a_gzip_bomb_is_cut_off_at_the_cap() -> None:
    bomb = gzip.compress(json.dumps({"sampling_session_id": "s" * (8 * 2**20)}).encode(), compresslevel=9)
    wire = Wire(create_sampling_session=response(200, bomb, headers={"content-encoding": "gzip"}))
    got = await drive(wire, sample, max_response_bytes=2**20)
    assert isinstance(got, APIResponseValidationError) and "max_response_bytes" in str(got)


async def test_a_2gb_content_length_is_refused_before_reading() -> None:
    got = await drive(Wire(asample=Act(response(200, b"{", length=2 * 2**30), hang=True)), sample)
    assert isinstance(got, APIResponseValidationError) and "max_response_bytes" in str(got)


async def test_a_reset_mid_answer_is_a_lost_response() -> None:
    got = await drive(Wire(asample=Act(response(200, b'{"request_id": "r', length=500), reset=True)), sample)
    assert isinstance(got, TransientError) and got.lost_response


@pytest.mark.parametrize("act", [Act(hang=True), Act(response(200, b"", length=10**6), drip=b" ")], ids=["silent", "drip"])
async def test_a_server_that_never_finishes_answering_meets_the_ops_deadline(act: Act) -> None:
    async def under_deadline(b: TinkerBackend) -> Any:
        return await call_with_retry(FAST, lambda: optim(b), operation="optim_step")

    got = await drive(Wire(**{"future:optim_step": act}), under_deadline)
    assert isinstance(got, DeadlineExceededError)


@pytest.mark.parametrize("limit", [0, "lots", float("inf")])
def test_a_response_limit_that_is_not_a_positive_whole_number_is_refused(limit: Any) -> None:
    from asyncsess.backends import load_backend
    from asyncsess.errors import InvalidInputError

    with pytest.raises(InvalidInputError) as err:
        load_backend("tinker://127.0.0.1:9", max_response_bytes=limit)
    assert err.value.field == "max_response_bytes"
