"""``asyncsess.backends.http.HttpBackend`` on an ``httpx.MockTransport`` (no worker): what an op puts on the wire."""

from __future__ import annotations

import json
import types

import httpx
import pytest

from asyncsess.backends import ForwardBackwardOp, LoadStateOp, OptimStepOp, SaveWeightsOp, TrainingOp
from asyncsess.backends import http_wire as wire
from asyncsess.backends.http import HttpBackend
from asyncsess.errors import InvalidInputError
from asyncsess.types import AdamParams, CheckpointResponse, ForwardBackwardOutput, LoadWeightsResponse, OptimStepResponse

from .helpers import sft_datum


def _backend(seen: list[TrainingOp]) -> HttpBackend:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/sessions/s1/ops"
        op = wire.decode_op(json.loads(request.content))  # as a worker would decode it
        seen.append(op)
        results = {  # each op answered with its own kind of result (another kind is refused as another request's answer)
            "forward_backward": ForwardBackwardOutput(metrics={"seq": float(op.seq)}),
            "optim_step": OptimStepResponse(metrics={"seq": float(op.seq)}),
            "save_weights": CheckpointResponse(path="p", kind=getattr(op, "checkpoint_kind", "sampler")),
            "load_state": LoadWeightsResponse(path="p"),
        }
        return httpx.Response(200, json=wire.encode_result(results[op.kind]))

    return HttpBackend("http://worker.invalid", transport=httpx.MockTransport(handler))


@pytest.mark.anyio
async def test_each_record_reaches_the_worker_as_the_same_record() -> None:
    seen: list[TrainingOp] = []
    b = _backend(seen)
    ops: list[TrainingOp] = [
        ForwardBackwardOp(seq=1, idempotency_key="k\x001", data=(sft_datum([1, 2, 3]),), loss_fn="ppo", loss_fn_config={"clip": 5e-324}),
        OptimStepOp(seq=2, idempotency_key="k2", adam_params=AdamParams(learning_rate=1e-3)),
        SaveWeightsOp(seq=3, idempotency_key="k3", name="n" * 1000, merge_weights=True, user_metadata={"é": "\U0001f600"}),
        LoadStateOp(seq=2**62, idempotency_key="k4", path="mock://x/weights/y", with_optimizer=False),
    ]
    try:
        for op in ops:
            await b.execute_training("s1", op)
    finally:
        await b.aclose()
    assert seen == ops and [type(o) for o in seen] == [type(o) for o in ops]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "bad", [None, {"kind": "optim_step", "seq": 1, "idempotency_key": "k"}, types.SimpleNamespace(kind="optim_step", seq=1)]
)
async def test_an_object_that_is_not_an_op_record_is_refused_before_anything_is_sent(bad: object) -> None:
    seen: list[TrainingOp] = []
    b = _backend(seen)
    try:
        with pytest.raises(InvalidInputError) as err:
            await b.execute_training("s1", bad)  # type: ignore[arg-type]
        assert err.value.field == "op"
    finally:
        await b.aclose()
    assert seen == []


@pytest.mark.anyio
async def test_each_create_sends_one_idempotency_key_on_all_its_tries() -> None:
    """A create whose reply is lost is retried; its tries carry the same ``Idempotency-Key`` (a header, not a body
    field), so the worker can answer the retry with the session it made; the next create sends another key."""
    from asyncsess import ServiceClient
    from asyncsess.types import GetInfoResponse, ServerCapabilities

    sent: list[tuple[str, str | None, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET":
            return httpx.Response(200, json=ServerCapabilities().model_dump(mode="json"))
        if request.method == "DELETE":
            return httpx.Response(204)
        sent.append((path, request.headers.get("idempotency-key"), json.loads(request.content)))
        if sum(p == path for p, _, _ in sent) % 2:  # each create's first reply is lost
            raise httpx.ReadError("the connection dropped after the worker answered", request=request)
        if path == "/v1/sessions":
            return httpx.Response(
                200, json=GetInfoResponse(model_id=f"lora-{len(sent)}", base_model="m", lora_rank=2, lora_alpha=4.0).model_dump(mode="json")
            )
        return httpx.Response(200, json={"sampler_id": f"sampler-{len(sent)}"})

    async with ServiceClient("http://worker.invalid", transport=httpx.MockTransport(handler), heartbeat_interval=0) as svc:
        for _ in range(2):
            await svc.create_lora_training_client("m", rank=2)
            await svc.create_sampling_client(base_model="m")
    for path in ("/v1/sessions", "/v1/samplers"):
        tries = [(key, body) for p, key, body in sent if p == path]
        keys = [key for key, _ in tries]
        assert len(keys) == 4 and keys[0] == keys[1] != keys[2] == keys[3] and all(keys), keys
        assert all("idempotency_key" not in body for _, body in tries)
