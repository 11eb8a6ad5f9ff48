"""``forward_backward`` bodies at their limits. A zstd body inflates to at most the server's body limit (``max_body_bytes``, what an
uncompressed body may be). zstandard's one-shot ``decompress`` allocates what a frame's header declares and ignores
its ``max_output_size`` then: a 17-byte frame declaring 1 TB was a MemoryError (the connection dropped, no answer),
one declaring 8 GB was allocated, and a real frame of a few KB inflated to any size. And a refusal names what
is wrong without echoing the request back: thousands of unknown keys were all listed, a long one quoted whole."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import httpx
import pytest
import zstandard

from asyncsess.serve import tinker_proto
from asyncsess.types import Datum, ModelInput

from .conftest import API_KEY, Server, start_server

pytestmark = pytest.mark.tinker

BASE = "mock/bigram-tiny"
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from start_server("mock://", max_body_bytes=LIMIT)


def _frame(declared: int) -> bytes:
    """A zstd frame whose header declares ``declared`` bytes, holding one RLE block of 100 bytes."""
    header = struct.pack("<IBQ", 0xFD2FB528, 0xE0, declared)  # magic; single segment, 8-byte content size
    return header + (1 | 1 << 1 | 100 << 3).to_bytes(3, "little") + b"A"  # last block, RLE, 100 bytes of "A"


@pytest.fixture
def model(server: Server) -> tuple[httpx.Client, str]:
    http = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=httpx.Timeout(60.0))
    session = http.post("/create_session", json={"tags": [], "sdk_version": "t"}).json()["session_id"]
    made = http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": BASE})
    while (done := http.post("/retrieve_future", json={"request_id": made.json()["request_id"]})).status_code == 408:
        pass
    assert done.status_code == 200 and "error" not in done.json(), done.text
    return http, made.json()["model_id"]


def _send(http: httpx.Client, body: bytes) -> httpx.Response:
    return http.post("/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})


def _request(model_id: str, seq: int, tokens: int) -> bytes:
    datum = Datum(
        model_input=ModelInput.from_ints([5] * tokens),
        loss_fn_inputs={"target_tokens": [6] * tokens, "weights": [1.0] * tokens},
    )
    return tinker_proto.encode_forward_backward(model_id, seq, [datum], "cross_entropy")


@pytest.mark.parametrize("declared", [2**40, 2**62, 2**33, LIMIT + 1])
def test_a_frame_declaring_more_than_the_limit_is_a_413_before_anything_is_allocated(
    model: tuple[httpx.Client, str], declared: int
) -> None:
    http, _ = model
    resp = _send(http, _frame(declared))
    assert resp.status_code == 413 and resp.json()["field"] == "body" and str(LIMIT) in resp.json()["fix"], resp.text


@pytest.mark.parametrize("declares_size", [True, False])
def test_a_frame_inflating_past_the_limit_is_a_413_and_the_model_goes_on(model: tuple[httpx.Client, str], declares_size: bool) -> None:
    http, model_id = model
    raw = _request(model_id, 1, 200_000)  # ~2.4 MB of protobuf, a few KB compressed
    assert len(raw) > LIMIT
    body = zstandard.ZstdCompressor(write_content_size=declares_size).compress(raw)
    assert len(body) < 64 * 1024
    resp = _send(http, body)
    assert resp.status_code == 413 and resp.json()["field"] == "body", resp.text
    ok = _send(http, tinker_proto.compress(_request(model_id, 1, 8)))  # seq 1 was not taken: the model's next op runs
    assert ok.status_code == 200, ok.text


def test_a_frame_cut_short_or_lying_about_its_size_is_a_400_naming_the_body(model: tuple[httpx.Client, str]) -> None:
    http, model_id = model
    whole = tinker_proto.compress(_request(model_id, 5, 8))
    for body in (whole[:-4], _frame(50), b"not zstd"):
        resp = _send(http, body)
        assert resp.status_code == 400 and resp.json()["field"] == "body", resp.text


def test_a_refusal_of_many_or_long_keys_stays_short(model: tuple[httpx.Client, str]) -> None:
    from tinker.proto import tinker_public_pb2 as pb

    http, model_id = model
    seq = 1
    for edit, field in (
        (
            lambda msg: [
                msg.data[0].loss_fn_inputs[f"k{i:04d}" + "x" * 300].CopyFrom(msg.data[0].loss_fn_inputs["weights"]) for i in range(1000)
            ],
            "data[0].loss_fn_inputs",
        ),
        (lambda msg: msg.loss_fn_config.__setitem__("k" * 100_000, 1.0), "loss_fn_config["),
        (lambda msg: setattr(msg.data[0].loss_fn_inputs["k" * 100_000], "dtype", 9), "data[0].loss_fn_inputs['kkk"),  # decoded first
    ):
        msg = pb.ForwardBackwardRequest()
        msg.ParseFromString(_request(model_id, seq, 2))
        edit(msg)
        resp = http.post("/forward_backward", content=msg.SerializeToString(), headers={"Content-Type": "application/x-protobuf"})
        assert resp.status_code == 400 and resp.json()["field"].startswith(field), resp.text[:300]
        assert len(resp.content) < 4096, len(resp.content)
        seq += 1
    ok = http.post("/forward_backward", content=_request(model_id, seq, 2), headers={"Content-Type": "application/x-protobuf"})
    assert ok.status_code == 200, ok.text  # both turns were used up: the model's next op runs
    while (done := http.post("/retrieve_future", json={"request_id": ok.json()["request_id"]})).status_code == 408:
        pass
    assert done.headers["content-type"] == "application/x-protobuf", done.text
