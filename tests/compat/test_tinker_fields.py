"""Tinker's sparse CSR tensors, provenance spans, ``get_telemetry`` and the queue-state hook, from the outside."""

from __future__ import annotations

import logging
import math
import pickle

import anyio
import pytest

from asyncsess import (
    BadRequestError,
    Datum,
    InvalidInputError,
    ModelInput,
    PromptProvenanceSpan,
    QueueState,
    SampledProvenanceSpan,
    SamplingClient,
    SamplingParams,
    ServiceClient,
    TensorData,
    UnsupportedError,
)
from asyncsess.backends import ForwardBackwardOp, TrainingSessionSpec, load_backend

pytestmark = pytest.mark.anyio

TOKENS = [1, 40, 41, 42, 2]  # 4 input positions, 4 targets
WEIGHTS = [1.0] * 4
# A (4, 3) target matrix with 6 listed cells; the rest are 0, Tinker's default pad_value.
CSR = {"crow": [0, 2, 3, 3, 6], "col": [0, 2, 1, 0, 1, 2], "targets": [40, 7, 41, 42, 9, 11], "weights": [1.0, 0.5, 1.0, 1.0, 0.25, 2.0]}
DENSE_TARGETS = [40, 0, 7, 0, 41, 0, 0, 0, 0, 42, 9, 11]
DENSE_WEIGHTS = [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.25, 2.0]


def csr(values: list, dtype: str, **over) -> dict:
    body = {"data": values, "dtype": dtype, "shape": [4, 3], "sparse_crow_indices": CSR["crow"], "sparse_col_indices": CSR["col"]}
    body.update(over)
    return body


def test_csr_densifies_to_the_dense_tensor_with_pad_zero():
    t = TensorData(**csr(CSR["targets"], "int64"))
    assert (t.data, t.shape, t.dtype) == (DENSE_TARGETS, [4, 3], "int64")
    assert t.sparse_crow_indices is None and t.sparse_col_indices is None  # backends only ever see dense data
    w = TensorData.model_validate(csr(CSR["weights"], "float32"))
    assert w.data == DENSE_WEIGHTS and w.to_numpy().shape == (4, 3)
    empty = TensorData(data=[], dtype="float32", shape=[2, 5], sparse_crow_indices=[0, 0, 0], sparse_col_indices=[])
    assert empty.data == [0.0] * 10
    tiny = TensorData(data=[5e-324, -math.inf], dtype="float32", shape=[1, 3], sparse_crow_indices=[0, 2], sparse_col_indices=[2, 0])
    assert tiny.data == [-math.inf, 0.0, 5e-324]  # values are placed as given; finiteness is the op's check


def _mock_datum(targets: TensorData, weights: TensorData) -> Datum:
    return Datum(model_input=ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": targets, "weights": weights})


async def test_csr_and_dense_give_the_same_forward_backward_on_mock():
    """(N, K) targets reach the mock's loss as dense arrays: CSR and its dense twin give identical outputs."""
    backend = load_backend("mock://")
    await backend.open()
    try:
        outs = []
        for t, w in (
            (TensorData(**csr(CSR["targets"], "int64")), TensorData(**csr(CSR["weights"], "float32"))),
            (TensorData(data=DENSE_TARGETS, dtype="int64", shape=[4, 3]), TensorData(data=DENSE_WEIGHTS, dtype="float32", shape=[4, 3])),
        ):
            info = await backend.create_training_session(TrainingSessionSpec("mock/bigram-tiny", rank=4, seed=5))
            op = ForwardBackwardOp(seq=1, idempotency_key="k1", data=(_mock_datum(t, w),), loss_fn="cross_entropy")
            outs.append(await backend.execute_training(info.model_id, op))
            await backend.stop_session(info.model_id)
        a, b = outs
        assert a.metrics == b.metrics and math.isfinite(a.loss)
        assert a.loss_fn_outputs[0]["logprobs"].data == b.loss_fn_outputs[0]["logprobs"].data
        assert a.loss_fn_outputs[0]["logprobs"].shape == [4, 3]
    finally:
        await backend.aclose()


async def test_csr_and_dense_n_by_k_targets_train_alike_through_the_client():
    """mock:// advertises (N, K) targets for cross_entropy: a CSR batch and its dense twin give the same loss and update."""
    results = []
    async with ServiceClient("mock://") as svc:
        for lfi in (
            {"target_tokens": csr(CSR["targets"], "int64"), "weights": csr(CSR["weights"], "float32")},
            {
                "target_tokens": TensorData(data=DENSE_TARGETS, dtype="int64", shape=[4, 3]),
                "weights": TensorData(data=DENSE_WEIGHTS, dtype="float32", shape=[4, 3]),
            },
        ):
            tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4, seed=7)
            out = await tc.forward_backward([{"model_input": TOKENS[:-1], "loss_fn_inputs": lfi}], "cross_entropy")
            await tc.optim_step({"learning_rate": 0.1})
            after = await tc.forward(
                [{"model_input": TOKENS[:-1], "loss_fn_inputs": {"target_tokens": TOKENS[1:], "weights": WEIGHTS}}], "cross_entropy"
            )
            results.append((out.loss, out.loss_fn_outputs[0]["logprobs"].data, after.loss))
            await tc.stop()
    assert results[0] == results[1] and math.isfinite(results[0][0]) and results[0][2] != results[0][0]


async def test_n_by_k_targets_are_refused_before_numbering_where_the_loss_takes_one_target():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        two_d = TensorData(**csr(CSR["targets"], "int64"))
        rl = {
            "target_tokens": two_d,
            "logprobs": TensorData(data=[-1.0] * 12, dtype="float32", shape=[4, 3]),
            "advantages": TensorData(data=[1.0] * 12, dtype="float32", shape=[4, 3]),
        }
        with pytest.raises(InvalidInputError, match=r"shape \[4, 3\] does not match the 4 input tokens") as err:
            tc.forward_backward([{"model_input": TOKENS[:-1], "loss_fn_inputs": rl}], "ppo")
        assert err.value.field == "data[0].loss_fn_inputs['target_tokens']"
        with pytest.raises(InvalidInputError, match=r"targets \[4, 3\]") as err:  # weights must follow the targets' shape
            tc.forward_backward(
                [{"model_input": TOKENS[:-1], "loss_fn_inputs": {"target_tokens": two_d, "weights": WEIGHTS}}], "cross_entropy"
            )
        assert err.value.field == "data[0].loss_fn_inputs['weights']"
        assert tc.current_sequence_number == 0


BAD_CSR = [
    ("crow-too-short", {"sparse_crow_indices": [0, 2, 3, 6]}, "rows + 1"),
    ("crow-not-ending-at-nnz", {"sparse_crow_indices": [0, 2, 3, 3, 5]}, "rows + 1"),
    ("crow-decreasing", {"sparse_crow_indices": [0, 4, 3, 3, 6]}, "non-decreasing"),
    ("col-out-of-range", {"sparse_col_indices": [0, 3, 1, 0, 1, 2]}, "out of range"),
    ("col-negative", {"sparse_col_indices": [0, -1, 1, 0, 1, 2]}, "out of range"),
    ("col-repeated", {"sparse_col_indices": [0, 0, 1, 0, 1, 2]}, "repeated"),
    ("col-huge", {"sparse_col_indices": [0, 2**70, 1, 0, 1, 2]}, "out of range"),
    ("values-vs-cols", {"data": [40, 7, 41]}, "one value per column index"),
    ("crow-without-col", {"sparse_col_indices": None}, "set both or neither"),
    ("no-shape", {"shape": None}, "shape [rows, cols]"),
    ("1-d-shape", {"shape": [12]}, "shape [rows, cols]"),
    ("huge-shape", {"shape": [2**40, 2**40], "sparse_crow_indices": [0, 6]}, "cells"),
]


@pytest.mark.parametrize(("over", "words"), [c[1:] for c in BAD_CSR], ids=[c[0] for c in BAD_CSR])
async def test_bad_csr_is_a_typed_error_before_numbering(over, words):
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        before = tc.current_sequence_number
        bad = {"model_input": TOKENS[:-1], "loss_fn_inputs": {"target_tokens": csr(CSR["targets"], "int64", **over), "weights": WEIGHTS}}
        with pytest.raises(InvalidInputError) as err:
            tc.forward_backward([bad], "cross_entropy")
        assert err.value.field.startswith("data[0]") and "loss_fn_inputs['target_tokens']" in str(err.value), str(err.value)
        assert words in str(err.value), str(err.value)
        assert tc.current_sequence_number == before
        ok = await tc.forward_backward(
            [{"model_input": TOKENS[:-1], "loss_fn_inputs": {"target_tokens": TOKENS[1:], "weights": WEIGHTS}}], "cross_entropy"
        )
        assert math.isfinite(ok.loss)


SPANS = [PromptProvenanceSpan(sequence_id="seq-a", length=3), SampledProvenanceSpan(sequence_id="seq-b", offset=2, length=1)]


async def test_provenance_spans_round_trip_and_do_not_change_training():
    plain = Datum(model_input=TOKENS[:-1], loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": WEIGHTS})
    marked = plain.with_provenance(SPANS, [SampledProvenanceSpan(sequence_id="seq-b", length=4)])
    assert marked.model_input_spans == SPANS and marked.loss_fn_input_spans[0].kind == "sampled"
    assert Datum.model_validate_json(marked.model_dump_json()) == marked
    assert pickle.loads(pickle.dumps(marked)) == marked
    losses = []
    async with ServiceClient("mock://") as svc:
        for d in (plain, marked):
            tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4, seed=2)
            losses.append((await (await tc.forward_backward_async([d], "cross_entropy"))).loss)
    assert losses[0] == losses[1]


@pytest.mark.compat
def test_tinkers_own_span_objects_are_taken_as_they_are():
    import tinker

    plain = Datum(model_input=TOKENS[:-1], loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": WEIGHTS})
    marked = plain.with_provenance(SPANS, [SampledProvenanceSpan(sequence_id="seq-b", length=4)])
    theirs = Datum(
        model_input=TOKENS[:-1],
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": WEIGHTS},
        model_input_spans=[
            tinker.types.PromptProvenanceSpan(sequence_id="seq-a", length=3),
            tinker.types.SampledProvenanceSpan(sequence_id="seq-b", offset=2, length=1),
        ],
        loss_fn_input_spans=[tinker.types.SampledProvenanceSpan(sequence_id="seq-b", length=4)],
    )
    assert theirs == marked


@pytest.mark.parametrize(
    ("spans", "words"),
    [
        ({"model_input_spans": SPANS}, "as a pair"),
        ({"model_input_spans": [{"kind": "prompt", "sequence_id": "", "length": 1}], "loss_fn_input_spans": []}, "sequence_id"),
        ({"model_input_spans": [{"kind": "prompt", "sequence_id": "a\x00", "length": 1}], "loss_fn_input_spans": []}, "sequence_id"),
        ({"model_input_spans": [{"kind": "prompt", "sequence_id": "a", "length": -1}], "loss_fn_input_spans": []}, "length"),
        (
            {"model_input_spans": [{"kind": "sampled", "sequence_id": "a", "offset": 2**70, "length": 1}], "loss_fn_input_spans": []},
            "offset",
        ),
        ({"model_input_spans": [{"kind": "other", "sequence_id": "a", "length": 1}], "loss_fn_input_spans": []}, "model_input_spans"),
        (
            {"model_input_spans": [{"kind": "prompt", "sequence_id": "a", "length": 1}] * 4097, "loss_fn_input_spans": []},
            "model_input_spans",
        ),
    ],
    ids=["unpaired", "empty-id", "nul-id", "negative-length", "huge-offset", "unknown-kind", "too-many"],
)
async def test_bad_provenance_spans_are_a_typed_error_naming_the_field(spans, words):
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        bad = {"model_input": TOKENS[:-1], "loss_fn_inputs": {"target_tokens": TOKENS[1:], "weights": WEIGHTS}, **spans}
        with pytest.raises(InvalidInputError) as err:
            tc.forward_backward([bad], "cross_entropy")
        assert words in str(err.value) and err.value.field.startswith("data[0]")
        assert tc.current_sequence_number == 0


def test_with_provenance_checks_the_tiling():
    d = Datum(model_input=TOKENS[:-1], loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": WEIGHTS})
    with pytest.raises(ValueError, match="cover 3 positions but the field has 4"):
        d.with_provenance([PromptProvenanceSpan(sequence_id="a", length=3)], [PromptProvenanceSpan(sequence_id="a", length=4)])
    with pytest.raises(ValueError, match="cover 5 positions"):
        d.with_provenance([PromptProvenanceSpan(sequence_id="a", length=4)], [PromptProvenanceSpan(sequence_id="a", length=5)])


async def test_get_telemetry_is_none_everywhere():
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        sc = await tc.save_weights_and_get_sampling_client()
        assert svc.get_telemetry() is None and tc.get_telemetry() is None and sc.get_telemetry() is None


class Recording(SamplingClient):
    """A user's override of Tinker's observer hook."""

    seen: list[tuple[QueueState, str | None]]

    def on_queue_state_change(self, queue_state, queue_state_reason):
        self.seen.append((queue_state, queue_state_reason))


async def test_queue_state_hook_sees_paused_then_active_when_the_pool_is_full():
    async with ServiceClient("mock://?latency_ms=20", max_samples_in_flight=1) as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        sc = await tc.save_weights_and_get_sampling_client()
        sc.__class__ = Recording
        sc.seen = []
        params = SamplingParams(max_tokens=4, seed=1)
        await sc.sample(TOKENS, 1, params)  # alone in the pool: no state change
        assert sc.seen == []
        results = []

        async def one(i: int) -> None:
            results.append(await sc.sample(TOKENS, 1, SamplingParams(max_tokens=4, seed=i)))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        assert len(results) == 4
        paused = [r for s, r in sc.seen if s == QueueState.PAUSED_CAPACITY]
        active = [r for s, r in sc.seen if s == QueueState.ACTIVE]
        assert len(paused) == 3 and len(active) == 3  # the first ran at once, three waited and then proceeded
        assert all("max_samples_in_flight=1" in r for r in paused) and active == [None] * 3
        assert sc.stats().in_flight == 0 and sc.stats().queued == 0


async def _sample(sc: SamplingClient, seed: int) -> None:
    await sc.sample(TOKENS, 1, SamplingParams(max_tokens=2, seed=seed))


async def test_default_hook_logs_a_pause_at_most_once_a_minute_and_a_raising_override_does_not_fail_sampling(caplog):
    async with ServiceClient("mock://?latency_ms=20", max_samples_in_flight=1) as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4)
        sc = await tc.save_weights_and_get_sampling_client()
        with caplog.at_level(logging.WARNING, logger="asyncsess"):
            sc.on_queue_state_change(QueueState.PAUSED_CAPACITY, "max_samples_in_flight=1 requests are in flight")
            sc.on_queue_state_change(QueueState.PAUSED_CAPACITY, "again")
            sc.on_queue_state_change(QueueState.ACTIVE, None)
        pauses = [r.getMessage() for r in caplog.records if "Sampling is paused" in r.getMessage()]
        assert pauses == [f"Sampling is paused for sampler {sc.sampler_id}. Reason: max_samples_in_flight=1 requests are in flight"]

        def boom(state, reason):
            raise RuntimeError("observer bug")

        sc.on_queue_state_change = boom  # type: ignore[method-assign]
        before = sc.stats().completed
        with caplog.at_level(logging.ERROR, logger="asyncsess"):
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(_sample, sc, i)
        assert sc.stats().completed == before + 3
        assert any("on_queue_state_change raised" in r.getMessage() for r in caplog.records)


async def test_train_unembed_none_is_true(monkeypatch):
    """SageMaker's default None reaches every backend as True, exactly like Tinker's default True."""
    async with ServiceClient("mock://") as svc:
        specs: list[TrainingSessionSpec] = []
        create = svc.backend.create_training_session

        async def recording(spec: TrainingSessionSpec):
            specs.append(spec)
            return await create(spec)

        monkeypatch.setattr(svc.backend, "create_training_session", recording)
        tcs = [
            await svc.create_lora_training_client("mock/bigram-tiny", rank=4, seed=3, **kw)
            for kw in ({}, {"train_unembed": None}, {"train_unembed": True})
        ]
        tcs.append(
            await svc.create_lora_training_client("mock/bigram-tiny", rank=4, train_mlp=False, train_attn=False)
        )  # only the unembedding
        with pytest.raises(InvalidInputError, match="nothing to train"):
            await svc.create_lora_training_client("mock/bigram-tiny", rank=4, train_mlp=False, train_attn=False, train_unembed=False)
        tcs.append(await svc.create_lora_training_client("mock/bigram-tiny", rank=4, train_unembed=False))
        for tc in tcs:
            await tc.stop()
    assert [s.train_unembed for s in specs] == [True, True, True, True, False]
    assert specs[0] == specs[1] == specs[2]


async def test_record_stability_info_and_stable_reinforce_are_refused_before_anything_is_numbered():
    """record_stability_info=True was "accepted and ignored": a loop ported from Tinker believed its sequences were
    recorded for stable_reinforce. Now it is an UnsupportedError (a BadRequestError) naming the field and what to use,
    raised before the snapshot is numbered; plain samples carry distinct sequence ids."""
    plain = Datum(model_input=TOKENS[:-1], loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": WEIGHTS})
    async with ServiceClient("mock://") as svc:
        tc = await svc.create_lora_training_client("mock/bigram-tiny", rank=4, seed=2)
        for call in (
            lambda: svc.create_sampling_client(base_model="mock/bigram-tiny", record_stability_info=True),
            lambda: tc.save_weights_and_get_sampling_client(record_stability_info=True),
            lambda: tc.save_weights_and_get_sampling_client("named", False, True),  # Tinker's positional order
            lambda: tc.create_sampling_client(record_stability_info=True),
        ):
            with pytest.raises(UnsupportedError, match="record_stability_info.*ppo") as err:
                await call()
            assert err.value.field == "record_stability_info" and isinstance(err.value, BadRequestError)
        with pytest.raises(InvalidInputError, match="record_stability_info"):
            await svc.create_sampling_client(base_model="mock/bigram-tiny", record_stability_info="yes")
        with pytest.raises(UnsupportedError, match="stable_reinforce is not offered") as err:
            tc.forward_backward([plain], "stable_reinforce")
        assert err.value.field == "loss_fn"
        assert tc.forward_backward([plain], "cross_entropy").seq == 1  # nothing above took a number
        assert await svc.list_checkpoints(tc.model_id) == []
        sampler = await tc.save_weights_and_get_sampling_client(record_stability_info=False)
        result = await sampler.sample(TOKENS[:2], num_samples=3, sampling_params=SamplingParams(max_tokens=2, seed=1))
        ids = [s.sequence_id for s in result.sequences]
        assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == 3
