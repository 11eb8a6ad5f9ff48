"""``http://`` against a worker we did not write (buggy, another version, hostile): every answer ends in a typed
error, or a correct retry and success, within the op's deadline; never a hang, a raw exception or a wrong result."""

from __future__ import annotations

import gzip
import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from asyncsess import RetryPolicy, SamplingParams
from asyncsess.backends import OptimStepOp, SampleRequest, SamplerSpec, SaveWeightsOp, TrainingSessionSpec
from asyncsess.backends import http_wire as wire
from asyncsess.backends.http import HttpBackend
from asyncsess.errors import (
    APIResponseValidationError,
    AsyncSessError,
    DeadlineExceededError,
    InvalidInputError,
    RateLimitError,
    TransientError,
    is_retryable,
)
from asyncsess.retry import MAX_RETRY_AFTER, call_with_retry, retry_after_seconds
from asyncsess.types import CheckpointResponse, OptimStepResponse

from .helpers import sft_datum
from .rogue_server import Act, Rogue, Seen, response, rogue_server

pytestmark = pytest.mark.anyio

KEY = "sk-secret-worker-key"
FAST = RetryPolicy(max_attempts=4, initial_backoff=0.001, max_backoff=0.002, jitter=0.0, deadline=0.5)

CALLS: dict[str, Callable[[HttpBackend], Awaitable[Any]]] = {
    "capabilities": lambda b: b.capabilities(),
    "create_training_session": lambda b: b.create_training_session(TrainingSessionSpec(base_model="m")),
    "execute_training": lambda b: b.execute_training("s1", OptimStepOp(seq=1, idempotency_key="k")),
    "create_sampler": lambda b: b.create_sampler(SamplerSpec(base_model="m")),
    "sample": lambda b: b.sample("x", SampleRequest(prompt=(1, 2), num_samples=1, sampling_params=SamplingParams(max_tokens=2))),
    "compute_logprobs": lambda b: b.compute_logprobs("x", [1, 2, 3]),
    "list_checkpoints": lambda b: b.list_checkpoints(),
}


async def against(
    handler: Callable[[Seen], bytes | Act], call: Callable[[HttpBackend], Awaitable[Any]], **options: Any
) -> tuple[Any, Rogue]:
    """``call`` on a driver of the rogue server: its result, or the exception it raised (returned, not raised)."""
    async with rogue_server(handler) as rogue:
        backend = HttpBackend(rogue.url, api_key=KEY, **options)
        try:
            return await call(backend), rogue
        except Exception as err:
            return err, rogue
        finally:
            await backend.aclose()


BAD_BODIES = {
    "not JSON": b"<html>502 from a proxy</html>",
    "not UTF-8": b"\xff\xfe\x00",
    "empty": b"",
    "a list": b"[1, 2, 3]",
    "a string": b'"ok"',
    "null": b"null",
    "a number": b"1e999",
    "wrong-typed fields": b'{"type": "optim_step", "result": {"metrics": "fast"}, "sampler_id": 5, "supported_models": 1,'
    b' "sequences": {}, "logprobs": "x", "model_id": []}',
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES)
async def test_a_2xx_body_of_the_wrong_shape_is_a_typed_error_on_every_call(call: str, body: bytes) -> None:
    got, _ = await against(lambda _: response(200, body), CALLS[call])
    assert isinstance(got, APIResponseValidationError), repr(got)
    assert not is_retryable(got)


async def test_a_field_this_version_does_not_know_is_ignored_so_a_newer_worker_stays_readable() -> None:
    """Output types ignore fields they do not know (as Tinker's and OpenAI's clients do); known ones are still checked."""
    body = {"type": "optim_step", "result": {"metrics": {"lr": 0.5}, "step": 3, "from_v9": {"any": [1]}}}
    got, rogue = await against(lambda _: response(200, body), CALLS["execute_training"])
    assert got == OptimStepResponse(metrics={"lr": 0.5}, step=3) and len(rogue.seen) == 1


@pytest.mark.parametrize(
    ("body", "what"),
    [
        ({"type": "forward_backward", "result": {"loss_fn_outputs": [], "metrics": {}}}, "another op's result"),
        ({"type": "optim_step"}, "no result"),
        ({"type": "optim_step", "result": {"metrics": {"loss": "nan?"}}}, "a metric that is not a number"),
        ({"type": "no_such_kind", "result": {}}, "an unknown result type"),
        ({"type": ["optim_step"], "result": {}}, "a type that is not a string"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
async def test_an_op_result_that_does_not_answer_the_op_is_refused_not_accepted(body: Any, what: str) -> None:
    got, rogue = await against(lambda _: response(200, body), CALLS["execute_training"])
    assert isinstance(got, APIResponseValidationError), what
    assert len(rogue.seen) == 1


@pytest.mark.parametrize("kind", ["state", "merged"])
async def test_a_save_answered_with_another_kind_of_checkpoint_is_refused(kind: str) -> None:
    answer = wire.encode_result(CheckpointResponse(path="x", kind=kind))  # type: ignore[arg-type]
    got, _ = await against(lambda _: response(200, answer), lambda b: b.execute_training("s1", SaveWeightsOp(seq=1, idempotency_key="k")))
    assert isinstance(got, APIResponseValidationError) and "checkpoint" in str(got)
    ok, _ = await against(
        lambda _: response(200, wire.encode_result(CheckpointResponse(path="x", kind="sampler"))),
        lambda b: b.execute_training("s1", SaveWeightsOp(seq=1, idempotency_key="k")),
    )
    assert ok == CheckpointResponse(path="x", kind="sampler")


async def test_the_right_result_still_decodes() -> None:
    good = wire.encode_result(OptimStepResponse(metrics={"lr": 0.1}))
    got, rogue = await against(lambda _: response(200, good), CALLS["execute_training"])
    assert got == OptimStepResponse(metrics={"lr": 0.1})
    assert rogue.seen[0].headers["authorization"] == f"Bearer {KEY}"


@pytest.mark.parametrize(
    "body",
    [
        {"error": {"type": "InvalidInputError"}},  # no message
        {"error": {"type": "InvalidInputError", "message": {"nested": 1}, "field": 3, "seq": "x", "retry_after": "soon"}},
        {"error": {"type": 7}},
        {"error": {"type": "__class__", "message": "m"}},
        {"error": {"type": "FacadeMisuseError", "message": "not ours"}},
        {"error": {"type": "InputValidationError", "message": "m", "field": "f"}},
        {"error": {"type": "PoisonedError", "message": "m", "cause": {"x": 1}}},
        {"error": "just text"},
        {"detail": "FastAPI's shape"},
        ["a", "list"],
        "plain text",
    ],
)
@pytest.mark.parametrize("status", [400, 401, 404, 409, 413, 429, 500, 503, 599])
async def test_an_error_body_of_any_shape_under_any_status_is_a_typed_error(body: Any, status: int) -> None:
    raw = body.encode() if isinstance(body, str) else body
    got, _ = await against(lambda _: response(status, raw), CALLS["execute_training"])
    assert isinstance(got, AsyncSessError), repr(got)
    assert isinstance(str(got), str) and isinstance(got.message, str)
    assert got.seq is None or isinstance(got.seq, int)
    hint = getattr(got, "retry_after", None)
    assert hint is None or (isinstance(hint, float) and 0 <= hint <= MAX_RETRY_AFTER)
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get("type") == "InvalidInputError":
        assert isinstance(got, InvalidInputError) and not is_retryable(got)
    elif 400 <= status < 500 and status not in (408, 409, 429):
        assert not is_retryable(got), "a 4xx is the caller's input: never retried"


@pytest.mark.parametrize("status", [*range(400, 418), *range(421, 432), 451, *range(500, 512)])
async def test_every_status_without_a_body_is_typed_and_only_overload_is_retried(status: int) -> None:
    got, _ = await against(lambda _: response(status), CALLS["execute_training"])
    assert isinstance(got, AsyncSessError)
    assert is_retryable(got) == (status in (408, 409, 429) or status >= 500)


async def test_a_200_that_carries_an_error_body_raises_that_error() -> None:
    body = wire.encode_error(InvalidInputError("bad seq", field="seq", fix="number from 1"))
    got, _ = await against(lambda _: response(200, body), CALLS["sample"])
    assert isinstance(got, InvalidInputError) and got.field == "seq"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("nan", None),
        ("NaN", None),
        ("-1", None),
        ("inf", None),
        ("1e308", MAX_RETRY_AFTER),
        ("9" * 400, MAX_RETRY_AFTER),
        ("garbage", None),
        ("", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date in the past: now
        ("Wed, 21 Oct 2015 07:28:00", None),  # no zone: not an HTTP date
        ("2", 2.0),
        (" 0.25 ", 0.25),
        (float("nan"), None),
        (-3, None),
        (True, None),
        ([1], None),
    ],
)
def test_retry_after_is_read_as_a_finite_bounded_number_of_seconds_or_ignored(value: Any, seconds: float | None) -> None:
    assert retry_after_seconds(value) == seconds


def test_retry_after_as_an_http_date_counts_from_now() -> None:
    assert retry_after_seconds("Thu, 01 Jan 1970 00:01:40 GMT", now=90.0) == 10.0


@pytest.mark.parametrize("value", ["nan", "-1", "garbage", "Wed, 21 Oct 2015 07:28:00 GMT", "0"])
@pytest.mark.parametrize("status", [429, 503])
async def test_a_throttle_with_a_useless_retry_after_is_retried_and_succeeds(status: int, value: str) -> None:
    good = response(200, wire.encode_result(OptimStepResponse(metrics={})))
    answers = iter([response(status, b"busy", headers={"retry-after": value}), good])
    sleeps: list[float] = []
    async with rogue_server(lambda _: next(answers)) as rogue:
        backend = HttpBackend(rogue.url)
        try:
            out = await call_with_retry(
                FAST, lambda: CALLS["execute_training"](backend), operation="optim_step", on_retry=lambda e: sleeps.append(e.sleep)
            )
        finally:
            await backend.aclose()
    assert out == OptimStepResponse(metrics={}) and len(rogue.seen) == 2
    assert len(sleeps) == 1 and math.isfinite(sleeps[0]) and 0 <= sleeps[0] < 1


@pytest.mark.parametrize("value", ["1e308", "99999999999999999999", "Fri, 31 Dec 9999 23:59:59 GMT"])
async def test_a_retry_after_past_the_deadline_fails_at_once_instead_of_sleeping(value: str) -> None:
    async with rogue_server(lambda _: response(429, b"", headers={"retry-after": value})) as rogue:
        backend = HttpBackend(rogue.url)
        try:
            with pytest.raises(DeadlineExceededError):
                await call_with_retry(FAST, lambda: CALLS["execute_training"](backend), operation="optim_step")
        finally:
            await backend.aclose()
    assert len(rogue.seen) == 1


async def test_a_late_retry_after_is_not_slept_past_the_deadline_either() -> None:
    """The second and later retries (tenacity's) slept a hint past the deadline: an op with deadline=0.5 hung an hour."""
    answers = iter([response(503, b""), response(503, b"", headers={"retry-after": "3000"})])
    async with rogue_server(lambda _: next(answers)) as rogue:
        backend = HttpBackend(rogue.url)
        try:
            with pytest.raises(DeadlineExceededError):
                await call_with_retry(FAST, lambda: CALLS["execute_training"](backend), operation="optim_step")
        finally:
            await backend.aclose()
    assert len(rogue.seen) == 2


async def test_the_error_bodys_retry_after_is_sanitised_and_the_header_fills_in() -> None:
    nan = b'{"error": {"type": "RateLimitError", "message": "slow", "retry_after": NaN}}'
    got, _ = await against(lambda _: response(429, nan), CALLS["sample"])
    assert isinstance(got, RateLimitError) and got.retry_after is None
    bare = b'{"error": {"type": "RateLimitError", "message": "slow"}}'
    got, _ = await against(lambda _: response(429, bare, headers={"retry-after": "7"}), CALLS["sample"])
    assert isinstance(got, RateLimitError) and got.retry_after == 7.0
    got, _ = await against(lambda _: response(503, b"proxy page", headers={"retry-after": "3"}), CALLS["sample"])
    assert isinstance(got, TransientError) and got.retry_after == 3.0


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_a_redirect_to_another_host_is_not_followed_and_the_key_stays_home(status: int) -> None:
    async with rogue_server(lambda _: response(200, wire.encode_result(OptimStepResponse(metrics={})))) as elsewhere:
        got, rogue = await against(
            lambda _: response(status, b"", headers={"location": f"{elsewhere.url}/steal"}), CALLS["execute_training"]
        )
    assert isinstance(got, APIResponseValidationError) and "redirect" in str(got)
    assert elsewhere.seen == [], "nothing (and no key) reached the other host"
    assert len(rogue.seen) == 1


async def test_a_connection_reset_mid_body_is_a_lost_response_to_fetch_again() -> None:
    got, _ = await against(lambda _: Act(response(200, b'{"type": "optim', length=1000), reset=True), CALLS["execute_training"])
    assert isinstance(got, TransientError) and got.lost_response


async def test_a_body_that_never_ends_meets_the_ops_deadline() -> None:
    async with rogue_server(lambda _: Act(response(200, b"", length=10**6), drip=b" ")) as rogue:
        backend = HttpBackend(rogue.url)
        try:
            with pytest.raises(DeadlineExceededError):
                await call_with_retry(FAST, lambda: CALLS["execute_training"](backend), operation="optim_step")
        finally:
            await backend.aclose()
    assert rogue.hung.is_set()


async def test_a_server_that_accepts_and_never_answers_meets_the_ops_deadline() -> None:
    async with rogue_server(lambda _: Act(hang=True)) as rogue:
        backend = HttpBackend(rogue.url)
        try:
            with pytest.raises(DeadlineExceededError):
                await call_with_retry(FAST, lambda: CALLS["sample"](backend), operation="sample")
        finally:
            await backend.aclose()
    assert rogue.hung.is_set()


async def test_a_2gb_content_length_is_refused_before_reading() -> None:
    got, _ = await against(lambda _: Act(response(200, b"{", length=2 * 2**30), hang=True), CALLS["sample"])
    assert isinstance(got, APIResponseValidationError) and "max_response_bytes" in str(got)


async def test_a_chunked_body_past_the_cap_is_refused_while_it_streams() -> None:
    chunk = b"x" * 4096
    raw = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    raw += (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 64
    got, _ = await against(lambda _: Act(raw, hang=True), CALLS["sample"], max_response_bytes=100_000)
    assert isinstance(got, APIResponseValidationError) and "max_response_bytes" in str(got)


async def test_a_gzip_bomb_is_cut_off_at_the_cap_not_inflated() -> None:
    bomb = gzip.compress(b"[" + b"0," * (20 * 2**20) + b"0]", compresslevel=9)  # 40 MB of JSON in ~40 KB
    got, _ = await against(
        lambda _: response(200, bomb, headers={"content-encoding": "gzip"}), CALLS["compute_logprobs"], max_response_bytes=2**20
    )
    assert isinstance(got, APIResponseValidationError) and "max_response_bytes" in str(got)


async def test_a_body_that_does_not_decode_as_its_content_encoding_is_typed() -> None:
    got, _ = await against(lambda _: response(200, b"not gzip at all", headers={"content-encoding": "gzip"}), CALLS["sample"])
    assert isinstance(got, APIResponseValidationError)


async def test_a_closed_port_is_a_transient_error() -> None:
    async with rogue_server(lambda _: b"") as rogue:
        url = rogue.url
    backend = HttpBackend(url)
    try:
        with pytest.raises(TransientError) as err:
            await backend.capabilities()
    finally:
        await backend.aclose()
    assert not err.value.lost_response


async def test_a_forward_backward_answer_through_the_client_is_checked_against_the_op() -> None:
    """An optim_step's result answering a forward_backward (another request's answer) fails that op, typed."""
    from asyncsess import ServiceClient

    def handler(seen: Seen) -> bytes:
        if seen.path == "/v1/sessions":
            return response(200, {"model_id": "s1", "base_model": "m", "lora_rank": 4, "lora_alpha": 8.0})
        if seen.path == "/v1/capabilities":
            return response(200, {"supported_models": []})
        return response(200, wire.encode_result(OptimStepResponse(metrics={})))

    async with rogue_server(handler) as rogue:
        async with ServiceClient(rogue.url, retry=FAST, heartbeat_interval=0) as svc:
            tc = await svc.create_lora_training_client("m", rank=4)
            with pytest.raises(APIResponseValidationError):
                await tc.forward_backward([sft_datum([1, 2, 3])], "cross_entropy")
    assert any(s.path == "/v1/sessions/s1/ops" and s.json()["kind"] == "forward_backward" for s in rogue.seen)


def test_every_op_kind_has_the_result_that_answers_it() -> None:
    from asyncsess.backends import OP_TYPES

    assert set(wire.RESULT_OF_OP) == set(OP_TYPES)


SAMPLES = {
    "two sequences for one": [{"stop_reason": "stop", "tokens": [1]}, {"stop_reason": "stop", "tokens": [2]}],
    "none for one": [],
    "fewer log-probs than tokens": [{"stop_reason": "stop", "tokens": [1, 2, 3], "logprobs": [-0.1]}],
    "a token past the vocabulary": [{"stop_reason": "length", "tokens": [5, 64]}],
    "a huge token id": [{"stop_reason": "length", "tokens": [10**30]}],
    "a negative token id": [{"stop_reason": "length", "tokens": [-1]}],
    "a NaN log-prob": [{"stop_reason": "length", "tokens": [5], "logprobs": [float("nan")]}],
}


@pytest.mark.parametrize("sequences", SAMPLES.values(), ids=SAMPLES)
async def test_sampled_sequences_that_do_not_answer_the_request_are_refused_by_the_client(sequences: list[Any]) -> None:
    """The client accepted any sequences: a token id no vocabulary has, or fewer log-probs than tokens, reached the loop."""
    from asyncsess import ResultMismatchError, ServiceClient

    def handler(seen: Seen) -> bytes:
        answers = {
            "/v1/capabilities": {"supported_models": [{"model_name": "m", "max_context_length": 128, "vocab_size": 64}]},
            "/v1/sessions": {"model_id": "s1", "base_model": "m", "lora_rank": 4, "lora_alpha": 8.0},
            "/v1/samplers": {"sampler_id": "x1"},
            "/v1/samplers/x1/sample": {"sequences": sequences},
        }
        return response(200, answers.get(seen.path, {}))

    async with rogue_server(handler) as rogue:
        async with ServiceClient(rogue.url, retry=FAST, heartbeat_interval=0) as svc:
            await svc.create_lora_training_client("m", rank=4)  # caches the capabilities (vocab_size=64)
            sc = await svc.create_sampling_client(base_model="m")
            with pytest.raises((APIResponseValidationError, ResultMismatchError)):
                await sc.sample([1, 2], 1, SamplingParams(max_tokens=4))


async def test_a_huge_token_id_is_refused_even_when_the_vocabulary_size_is_unknown() -> None:
    from asyncsess import ServiceClient

    def handler(seen: Seen) -> bytes:
        if seen.path == "/v1/samplers":
            return response(200, {"sampler_id": "x1"})
        return response(200, {"sequences": [{"stop_reason": "length", "tokens": [2**31]}]})

    async with rogue_server(handler) as rogue:
        async with ServiceClient(rogue.url, retry=FAST, heartbeat_interval=0) as svc:
            sc = await svc.create_sampling_client(base_model="m")
            with pytest.raises(APIResponseValidationError, match="vocabulary"):
                await sc.sample([1, 2], 1, SamplingParams(max_tokens=4))


@pytest.mark.parametrize("limit", [0, -1, 1.5, float("nan"), "big", True])
def test_a_response_limit_that_is_not_a_positive_whole_number_is_refused(limit: Any) -> None:
    with pytest.raises(InvalidInputError) as err:
        HttpBackend("http://127.0.0.1:9", max_response_bytes=limit)
    assert err.value.field == "max_response_bytes"
