"""Backend basics (entry point, sessions, outputs, introspection) and typed errors for bad input."""

from __future__ import annotations

import types

import pytest

from asyncsess.backends import SampleRequest, SamplerSpec, TrainingSessionSpec, available_schemes, load_backend
from asyncsess.errors import ConflictError, InvalidInputError, SessionGoneError, UnsupportedError
from asyncsess.types import AdamParams, Datum, SamplingParams
from asyncsess_mock import MockBackend


@pytest.mark.anyio
async def test_entry_point_and_capabilities(open_session):
    assert "mock" in available_schemes()

    b = load_backend("mock://")
    caps = await b.capabilities()
    assert [m.model_name for m in caps.supported_models] == ["mock/bigram-tiny"]
    s = await open_session(b, "Qwen/Qwen3-8B")
    caps = await b.capabilities()
    assert [m.model_name for m in caps.supported_models] == ["mock/bigram-tiny", "Qwen/Qwen3-8B"]
    assert caps.supported_models[0].vocab_size == b.get_tokenizer("x").vocab_size
    assert "gspo" in caps.loss_functions and "dro" in caps.loss_functions
    await b.stop_session(s.id)


@pytest.mark.anyio
async def test_a_create_retried_under_its_key_makes_no_second_session():
    """The seam's contract: a create repeated with its ``idempotency_key`` (a retry after a lost reply) answers what
    the first made. mock:// ignored the key, so every retry opened another session; another spec under the key is a
    ConflictError naming it."""
    b = MockBackend()
    spec = TrainingSessionSpec("any/name", rank=4, seed=1, idempotency_key="create-1")
    first = await b.create_training_session(spec)
    again = await b.create_training_session(TrainingSessionSpec("any/name", rank=4, seed=1, idempotency_key="create-1"))
    assert again.model_id == first.model_id and MockBackend.open_sessions("training").count(first.model_id) == 1
    with pytest.raises(ConflictError) as err:
        await b.create_training_session(TrainingSessionSpec("any/name", rank=8, seed=1, idempotency_key="create-1"))
    assert err.value.field == "idempotency_key"
    other = await b.create_training_session(TrainingSessionSpec("any/name", rank=4, seed=1, idempotency_key="create-2"))
    assert other.model_id != first.model_id
    unkeyed = [await b.create_training_session(TrainingSessionSpec("any/name", rank=4)) for _ in range(2)]
    assert unkeyed[0].model_id != unkeyed[1].model_id  # no key: every create is a new one
    smp = SamplerSpec(base_model="any/name", idempotency_key="smp-1")
    assert await b.create_sampler(smp) == await b.create_sampler(SamplerSpec(base_model="any/name", idempotency_key="smp-1"))
    for sid in [first.model_id, other.model_id, *(u.model_id for u in unkeyed), await b.create_sampler(smp)]:
        await b.stop_session(sid)


@pytest.mark.anyio
async def test_session_lifecycle_and_registry():
    b = MockBackend()
    info = await b.create_training_session(TrainingSessionSpec("any/name", rank=8, seed=3))
    assert (info.base_model, info.lora_rank, info.seed, info.step) == ("any/name", 8, 3, 0)
    sid = await b.create_sampler(SamplerSpec(base_model="any/name"))
    assert set(MockBackend.open_sessions()) >= {info.model_id, sid}
    assert info.model_id in MockBackend.open_sessions("training") and sid in MockBackend.open_sessions("sampler")
    await b.heartbeat(info.model_id)
    await b.stop_session(info.model_id)
    await b.stop_session(info.model_id)  # idempotent
    await b.stop_session(sid)
    assert not {info.model_id, sid} & set(MockBackend.open_sessions())
    with pytest.raises(SessionGoneError):
        await b.heartbeat(info.model_id)
    with pytest.raises(InvalidInputError) as err:
        await b.stop_session("mock-train-never")
    assert err.value.field == "session_id"
    assert b.calls["stop_session"] == 4 and b.calls["create_training_session"] == 1


@pytest.mark.anyio
async def test_fresh_session_equals_the_base_model_and_outputs_are_float32(open_session, datum):
    b = MockBackend()
    s = await open_session(b)
    seq = b.tokenizer.encode("abc")
    out = await s.run("forward_backward", data=(datum(seq), datum(seq[:3])), loss_fn="cross_entropy")
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[3], [2]]
    assert all(o["logprobs"].dtype == "float32" for o in out.loss_fn_outputs)
    assert out.usage.training_tokens == 5
    base = await b.create_sampler(SamplerSpec(base_model="mock/bigram-tiny"))
    lps = await b.compute_logprobs(base, seq)
    assert out.loss_fn_outputs[0]["logprobs"].data == pytest.approx(lps[1:], abs=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(-(sum(lps[1:]) + sum(lps[1:3])))
    assert not b.weights(s.id).any()
    await b.stop_session(base)
    await b.stop_session(s.id)


@pytest.mark.anyio
async def test_training_reduces_the_loss(open_session, datum):
    b = MockBackend()
    s = await open_session(b)
    data = (datum(b.tokenizer.encode("to be or not to be")),)
    losses = []
    for _ in range(10):
        out = await s.run("forward_backward", data=data, loss_fn="cross_entropy")
        losses.append(out.metrics["loss:sum"])
        step = await s.run("optim_step", adam_params=AdamParams(learning_rate=0.1))
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.8 * losses[0]
    assert step.step == 10 and step.metrics["learning_rate"] == 0.1 and step.metrics["grad_norm"] > 0
    await b.stop_session(s.id)


def _bad(data, loss_fn="cross_entropy", config=None):
    return dict(data=tuple(data), loss_fn=loss_fn, loss_fn_config=config)


BAD_TRAINING_INPUTS = [
    ("token-in-input", lambda d: _bad([d([5, 6, 7]), d([5, 300, 7])]), InvalidInputError, "data[1].model_input"),
    (
        "negative-target",
        lambda d: _bad([d([5, 6, 7])]) | {"data": (Datum(model_input=[5, 6], loss_fn_inputs={"target_tokens": [6, -1]}),)},
        InvalidInputError,
        "data[0].loss_fn_inputs['target_tokens']",
    ),
    (
        "target-length",
        lambda d: _bad([Datum(model_input=[5, 6], loss_fn_inputs={"target_tokens": [6]})]),
        InvalidInputError,
        "data[0].loss_fn_inputs['target_tokens']",
    ),
    (
        "weights-length",
        lambda d: _bad([Datum(model_input=[5, 6], loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0]})]),
        InvalidInputError,
        "data[0].loss_fn_inputs['weights']",
    ),
    ("missing-advantages", lambda d: _bad([d([5, 6, 7], logprobs=[-1.0, -1.0])], "ppo"), InvalidInputError, "data[0].loss_fn_inputs"),
    ("unknown-key", lambda d: _bad([d([5, 6, 7], mask=[1.0, 1.0])]), InvalidInputError, "data[0].loss_fn_inputs"),
    ("unknown-loss", lambda d: _bad([d([5, 6, 7])], "stable_reinforce"), UnsupportedError, "loss_fn"),
    ("config-key", lambda d: _bad([d([5, 6, 7])], "ppo", {"eps": 0.2}), InvalidInputError, "loss_fn_config"),
    ("no-data", lambda d: _bad([]), InvalidInputError, "data"),
    (
        "empty-input",
        lambda d: _bad([Datum(model_input=[], loss_fn_inputs={"target_tokens": []})]),
        InvalidInputError,
        "data[0].model_input",
    ),
    (
        "multi-target-ppo",
        lambda d: _bad(
            [Datum(model_input=[5], loss_fn_inputs={"target_tokens": [[6, 7]], "logprobs": [[-1.0, -1.0]], "advantages": [[1.0, 1.0]]})],
            "ppo",
        ),
        InvalidInputError,
        "data[0].loss_fn_inputs['target_tokens']",
    ),
    (
        "partial-key",
        lambda d: _bad([d([5, 6, 7], weights=[1.0, 1.0]), Datum(model_input=[5, 6], loss_fn_inputs={"target_tokens": [6, 7]})]),
        InvalidInputError,
        "data[*].loss_fn_inputs['weights']",
    ),
]


@pytest.mark.parametrize(("make", "error", "field"), [c[1:] for c in BAD_TRAINING_INPUTS], ids=[c[0] for c in BAD_TRAINING_INPUTS])
@pytest.mark.anyio
async def test_bad_training_input_raises_a_typed_error_naming_the_field(open_session, datum, make, error, field):
    for kind in ("forward", "forward_backward"):
        b = MockBackend()
        s = await open_session(b)
        with pytest.raises(error) as err:
            await s.run(kind, **make(datum))
        assert err.value.field == field and err.value.fix
        assert b.applied_log == []
        await b.stop_session(s.id)


@pytest.mark.anyio
async def test_bad_session_and_sampling_input():
    b = MockBackend()
    with pytest.raises(InvalidInputError) as err:
        await b.create_training_session(TrainingSessionSpec("m", rank=0))
    assert err.value.field == "rank"
    with pytest.raises(InvalidInputError) as err:
        await b.create_training_session(TrainingSessionSpec(""))
    assert err.value.field == "base_model"
    with pytest.raises(InvalidInputError) as err:
        await b.create_sampler(SamplerSpec())
    assert err.value.field == "model_path"
    with pytest.raises(InvalidInputError) as err:
        await b.sample("mock-sampler-never", SampleRequest((1,), 1, SamplingParams()))
    assert err.value.field == "sampler_id"
    sid = await b.create_sampler(SamplerSpec(base_model="m"))
    cases = [
        (SampleRequest((1, 500), 1, SamplingParams()), "prompt"),
        (SampleRequest((), 1, SamplingParams()), "prompt"),
        (SampleRequest((1,), 0, SamplingParams()), "num_samples"),
        (SampleRequest((1,), 1, SamplingParams(stop=[999])), "sampling_params.stop"),
        (SampleRequest((1,), 1, SamplingParams.model_construct(stop=[""])), "sampling_params.stop"),  # past the type's own check
    ]
    for request, field in cases:
        with pytest.raises(InvalidInputError) as err:
            await b.sample(sid, request)
        assert err.value.field == field
    with pytest.raises(InvalidInputError) as err:
        await b.compute_logprobs(sid, [1, -3])
    assert err.value.field == "tokens"
    await b.stop_session(sid)


_NOT_OPS = [
    None,
    "forward",
    {"kind": "forward", "seq": 1, "idempotency_key": "k", "data": [], "loss_fn": "cross_entropy"},
    # quacks like a ForwardOp (every attribute a backend would read), but is not one of the records
    types.SimpleNamespace(kind="forward", seq=1, idempotency_key="k", data=(), loss_fn="cross_entropy", loss_fn_config=None),
]


@pytest.mark.anyio
@pytest.mark.parametrize("bad", _NOT_OPS, ids=["None", "str", "dict", "lookalike"])
async def test_an_object_that_is_not_an_op_record_is_refused_before_it_takes_a_sequence_number(open_session, datum, bad):
    b = MockBackend()
    s = await open_session(b)
    with pytest.raises(InvalidInputError) as info:
        await b.execute_training(s.id, bad)
    assert info.value.field == "op" and "ForwardBackwardOp" in str(info.value)
    # seq 1 is still free and the session is not poisoned: the next real op runs as the first
    out = await s.run("forward_backward", data=(datum([5, 6, 7]),))
    assert out.loss_fn_outputs and b.applied_log == [(s.id, 1, "forward_backward")]
    await b.stop_session(s.id)
