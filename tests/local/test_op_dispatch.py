"""Dispatch on the seam's typed op records: an op of no known kind is refused with a typed error naming
``kind`` (when checked, and on the engine thread if it gets there), never a crash or a hang; the engine
keeps serving."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from asyncsess.backends import TrainingSessionSpec  # noqa: E402
from asyncsess.errors import InvalidInputError  # noqa: E402
from asyncsess.types import AdamParams  # noqa: E402

from .helpers import Ops, sft_datum  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.anyio]


@dataclass(frozen=True)
class StrayOp:
    """Shaped like an op record, but of no kind the seam defines."""

    seq: int
    idempotency_key: str
    kind: str = "rewind\x00\ud800"


def test_unknown_op_is_a_typed_error_naming_kind():
    from asyncsess.backends import unknown_op

    with pytest.raises(InvalidInputError) as caught:
        unknown_op(StrayOp(1, "k"))  # type: ignore[arg-type]  # what mypy refuses for a forgotten kind
    assert caught.value.field == "kind" and "rewind" in str(caught.value)
    assert "optim_step" in (caught.value.fix or "")


async def test_a_stray_op_is_refused_when_checked_and_on_the_engine(backend_factory, tiny):
    b = backend_factory()
    try:
        await b.open()
        tok = b.get_tokenizer(tiny)
        info = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=2, seed=0))
        with pytest.raises(InvalidInputError) as caught:
            b.check_op(info.model_id, StrayOp(1, "k"))  # type: ignore[arg-type]
        assert caught.value.field == "kind"
        assert b.next_seq(info.model_id) == 1  # refused before it took a seq
        with pytest.raises(InvalidInputError):  # past the checks, straight onto the engine thread
            await b.engine.submit_training(info.model_id, StrayOp(1, "k")).wait()  # type: ignore[arg-type]
        other = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=2, seed=0))
        ops = Ops()
        out = await b.execute_training(
            other.model_id, ops("forward_backward", data=(sft_datum(tok.encode("hello world the cat")),), loss_fn="cross_entropy")
        )
        assert out.metrics["loss:sum"] > 0
        step = await b.execute_training(other.model_id, ops("optim_step", adam_params=AdamParams(learning_rate=1e-3)))
        assert step.step == 1
    finally:
        await b.aclose()
