"""``asyncsess.backends.http_wire``: every op record crosses JSON exactly, and a bad body names its field."""

from __future__ import annotations

import json
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncsess.backends import (
    OP_TYPES,
    ForwardBackwardOp,
    ForwardOp,
    LoadStateOp,
    OptimStepOp,
    SaveStateOp,
    SaveWeightsOp,
    TrainingOp,
    TrainingOpKind,
)
from asyncsess.backends import http_wire as wire
from asyncsess.errors import InvalidInputError
from asyncsess.types import AdamParams, Datum, ModelInput, TensorData

# text as users send it: NUL, every plane, long strings (lone surrogates: see test_text_utf8_cannot_carry...)
text = st.text(st.characters(codec="utf-8"), max_size=300)
ints = st.integers()  # huge ones too: the records do not bound seq or ttl
finite = st.floats(allow_nan=False, allow_infinity=False)  # subnormals and -0.0 included


@st.composite
def datums(draw: st.DrawFn) -> Datum:
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8))
    n = len(tokens)
    inputs = {"target_tokens": TensorData(data=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), dtype="int64")}
    if draw(st.booleans()):
        inputs["weights"] = TensorData(data=draw(st.lists(finite, min_size=n, max_size=n)), dtype="float32", shape=[n])
    return Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


adam = st.builds(
    AdamParams,
    learning_rate=st.floats(0.0, 10.0),
    beta1=st.floats(0.0, 0.999),
    beta2=st.floats(0.0, 0.999),
    eps=st.floats(1e-30, 1.0),
    weight_decay=st.floats(0.0, 0.1),  # learning_rate × weight_decay ≤ 1
    grad_clip_norm=st.floats(0.0, 1e30),
)


def records(text: st.SearchStrategy[str]) -> st.SearchStrategy[TrainingOp]:
    """Any of the six records, its text drawn from ``text``."""
    base = {"seq": ints, "idempotency_key": text}
    forward = {
        "data": st.lists(datums(), max_size=3).map(tuple),
        "loss_fn": text,
        "loss_fn_config": st.none() | st.dictionaries(text, finite, max_size=4),
    }
    save = {
        "name": st.none() | text,
        "ephemeral": st.booleans(),
        "description": st.none() | text,
        "overwrite": st.booleans(),
        "ttl_seconds": st.none() | ints,
        "user_metadata": st.none() | st.dictionaries(text, text, max_size=4),
    }
    return st.one_of(
        st.builds(ForwardOp, **base, **forward),
        st.builds(ForwardBackwardOp, **base, **forward),
        st.builds(OptimStepOp, **base, adam_params=adam),
        st.builds(SaveStateOp, **base, **save),
        st.builds(SaveWeightsOp, **base, **save, merge_weights=st.booleans()),
        st.builds(LoadStateOp, **base, path=text, with_optimizer=st.booleans()),
    )


@settings(max_examples=300, deadline=None)
@given(records(text))
def test_every_record_round_trips_through_json_exactly(op: TrainingOp) -> None:
    body = json.loads(json.dumps(wire.encode_op(op)))
    assert body["kind"] == op.kind
    back = wire.decode_op(body)
    assert type(back) is type(op) and back == op


@settings(max_examples=200, deadline=None)
@given(records(st.text(st.characters(codec=None, exclude_categories=()), max_size=20)))  # lone surrogates too
def test_a_record_is_carried_exactly_or_refused_never_changed(op: TrainingOp) -> None:
    try:
        body = wire.encode_op(op)
    except InvalidInputError as err:
        assert err.field and "surrogate" in str(err)
        return
    assert wire.decode_op(json.loads(json.dumps(body))) == op


def test_the_kind_tags_name_exactly_the_six_records() -> None:
    assert set(OP_TYPES.values()) == set(typing.get_args(TrainingOp))
    assert set(OP_TYPES) == set(typing.get_args(TrainingOpKind))
    assert all(cls(seq=1, idempotency_key="k", **({"path": "p"} if cls is LoadStateOp else {})).kind == k for k, cls in OP_TYPES.items())


def _body(op: TrainingOp) -> dict[str, typing.Any]:
    return wire.encode_op(op)


@pytest.mark.parametrize("kind", ["", "Forward", "sample", "forward\x00", "\udc80", "x" * 10_000, None, 1])
def test_an_unknown_kind_is_refused_naming_kind(kind: object) -> None:
    body = {**_body(OptimStepOp(seq=1, idempotency_key="k")), "kind": kind}
    with pytest.raises(InvalidInputError) as err:
        wire.decode_op(body)
    assert err.value.field == "kind" and err.value.fix


def test_a_body_without_kind_is_refused_naming_kind() -> None:
    body = _body(OptimStepOp(seq=1, idempotency_key="k"))
    del body["kind"]
    with pytest.raises(InvalidInputError) as err:
        wire.decode_op(body)
    assert err.value.field == "kind"


# a field each kind does not have (each one another kind's field)
FOREIGN = [
    (ForwardOp(seq=1, idempotency_key="k"), "adam_params", {}),
    (ForwardBackwardOp(seq=1, idempotency_key="k"), "path", "p"),
    (OptimStepOp(seq=1, idempotency_key="k"), "data", []),
    (SaveStateOp(seq=1, idempotency_key="k"), "merge_weights", True),
    (SaveWeightsOp(seq=1, idempotency_key="k"), "with_optimizer", False),
    (LoadStateOp(seq=1, idempotency_key="k", path="p"), "name", "n"),
]


@pytest.mark.parametrize(("op", "field", "value"), FOREIGN, ids=[op.kind for op, _, _ in FOREIGN])
def test_a_field_its_kind_does_not_have_is_refused_naming_the_field(op: TrainingOp, field: str, value: object) -> None:
    with pytest.raises(InvalidInputError) as err:
        wire.decode_op({**_body(op), field: value})
    assert err.value.field == field and op.kind in str(err.value) and type(op).__name__ in (err.value.fix or "")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"kind": "load_state", "seq": 1, "idempotency_key": "k"}, "path"),
        ({"kind": "optim_step", "seq": "one", "idempotency_key": "k"}, "seq"),
        (
            {"kind": "optim_step", "seq": 1, "idempotency_key": "k", "adam_params": {"learning_rate": float("nan")}},
            "adam_params.learning_rate",
        ),
        ({"kind": "optim_step", "seq": 1, "idempotency_key": "k", "adam_params": {"momentum": 0.9}}, "adam_params.momentum"),
        ({"kind": "forward", "seq": 1, "idempotency_key": "k", "loss_fn_config": {"beta": "high"}}, "loss_fn_config.beta"),
        (["not", "an", "object"], "op"),
        (None, "op"),
    ],
)
def test_a_malformed_body_is_refused_naming_the_field(body: object, field: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        wire.decode_op(body)
    assert err.value.field == field


LONE = "ok\ud800"  # a lone surrogate: valid in a Python str, not in UTF-8 (so not in a JSON body over HTTP)
SURROGATES = [
    (ForwardOp(seq=1, idempotency_key=LONE), "idempotency_key"),
    (ForwardBackwardOp(seq=1, idempotency_key="k", loss_fn=LONE), "loss_fn"),
    (ForwardOp(seq=1, idempotency_key="k", loss_fn_config={LONE: 1.0}), "loss_fn_config"),
    (SaveStateOp(seq=1, idempotency_key="k", user_metadata={"a": LONE}), "user_metadata.a"),
    (SaveWeightsOp(seq=1, idempotency_key="k", description=LONE), "description"),
    (LoadStateOp(seq=1, idempotency_key="k", path=LONE), "path"),
    (
        ForwardOp(
            seq=1,
            idempotency_key="k",
            data=(Datum(model_input=ModelInput.from_ints([1]), loss_fn_inputs={LONE: TensorData(data=[2], dtype="int64")}),),
        ),
        "data[0].loss_fn_inputs",
    ),
]


@pytest.mark.parametrize(("op", "field"), SURROGATES, ids=[f for _, f in SURROGATES])
def test_text_utf8_cannot_carry_is_refused_both_ways_naming_the_field(op: TrainingOp, field: str) -> None:
    """pydantic would silently replace a lone surrogate in a dict key; the codec refuses it instead."""
    with pytest.raises(InvalidInputError) as err:
        wire.encode_op(op)
    assert err.value.field == field
    body = json.loads(json.dumps(wire.OP.dump_python(op)))  # JSON spells it "\\ud800", json.loads gives it back
    with pytest.raises(InvalidInputError) as err:
        wire.decode_op(body)  # as a worker decoding such a body
    assert err.value.field == field


def test_errors_carry_openai_param_and_code_and_still_decode_to_their_class() -> None:
    """The worker's key, size and route checks answer its OpenAI routes in this shape: the openai client reads
    ``param`` and ``code`` from it (they were missing), and the asyncsess client still rebuilds the typed error."""
    from asyncsess import errors

    cases = [
        (
            errors.InvalidInputError("missing or wrong API key", field="Authorization", fix="send a key"),
            "Authorization",
            "invalid_input_error",
        ),
        (errors.RateLimitError("too many requests", retry_after=1.0), None, "rate_limit_error"),
    ]
    for err, param, code in cases:
        body = json.loads(json.dumps(wire.encode_error(err)))
        info = body["error"]
        assert {"message", "type", "param", "code"} <= set(info) and (info["param"], info["code"]) == (param, code)
        back = wire.decode_error(body, wire.status_for(err))
        assert type(back) is type(err) and str(back) == str(err) and getattr(back, "field", None) == param


def test_a_conflict_is_a_409_that_decodes_to_a_conflict_error_never_retried() -> None:
    """A taken checkpoint name, a reused seq or request_id conflicts with the server's state: the worker answered them
    400 (only a reused Idempotency-Key was a 409). Now every ConflictError is a 409, rebuilt as itself, void kept."""
    from asyncsess import errors

    err = errors.ConflictError("a checkpoint named 'a' already exists", field="overwrite", fix="pass overwrite=True")
    err.void = True
    assert wire.status_for(err) == 409 and wire.status_for(InvalidInputError("bad", field="seq")) == 400
    back = wire.decode_error(json.loads(json.dumps(wire.encode_error(err))), 409)
    assert type(back) is errors.ConflictError and back.field == "overwrite" and back.void
    assert not errors.is_retryable(back)


def test_a_save_the_disk_failed_is_a_507_that_decodes_to_insufficient_storage_never_retried() -> None:
    """A save that failed for the worker's disk was a ServerError (500) that poisoned the session. It is an
    InsufficientStorageError: a 507, rebuilt as itself with its fix and void kept, not retried (the disk stays full)."""
    from asyncsess import errors

    err = errors.InsufficientStorageError("checkpoint 'a' was not saved (ENOSPC)", fix="delete checkpoints", void=True)
    assert wire.status_for(err) == 507 and wire.status_for(errors.ResourceExhaustedError("oom")) == 500
    back = wire.decode_error(json.loads(json.dumps(wire.encode_error(err))), 507)
    assert type(back) is errors.InsufficientStorageError and back.fix == "delete checkpoints" and back.void
    assert not errors.is_retryable(back) and not errors.poisons(back)
