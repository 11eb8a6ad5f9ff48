"""Fixtures for the mock backend's own tests (Backend-level, no client)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from asyncsess.backends import OP_TYPES, TrainingOp, TrainingSessionSpec
from asyncsess.types import Datum
from asyncsess_mock import MockBackend


@pytest.fixture(autouse=True)
def no_leaked_sessions():
    """Every test must stop the sessions and samplers it opens."""
    before = set(MockBackend.open_sessions())
    yield
    leaked = set(MockBackend.open_sessions()) - before
    for sid in leaked:  # clean up so one leak does not fail every later test
        MockBackend._open.pop(sid)
    assert not leaked, f"sessions left open: {sorted(leaked)}"


def _datum(tokens: Sequence[int], **inputs: Sequence[float]) -> Datum:
    """``model_input = tokens[:-1]``, ``target_tokens = tokens[1:]`` plus per-token inputs (default weights 1)."""
    n = len(tokens) - 1
    lfi: dict = {"target_tokens": list(tokens[1:])}
    lfi.update({k: list(v) for k, v in inputs.items()})
    assert all(len(v) == n for k, v in lfi.items())
    return Datum(model_input=list(tokens[:-1]), loss_fn_inputs=lfi)


@pytest.fixture
def datum() -> Callable[..., Datum]:
    return _datum


class Session:
    """A training session on a backend with its own sequence counter."""

    def __init__(self, backend: MockBackend, session_id: str) -> None:
        self.backend, self.id, self.seq = backend, session_id, 0

    def op(self, kind: str, **kw) -> TrainingOp:
        self.seq += 1
        return OP_TYPES[kind](seq=self.seq, idempotency_key=f"{self.id}-{self.seq}", **kw)

    async def run(self, kind: str, **kw):
        return await self.backend.execute_training(self.id, self.op(kind, **kw))


@pytest.fixture
def open_session() -> Callable:
    async def make(backend: MockBackend, base_model: str = "mock/bigram-tiny", **spec) -> Session:
        info = await backend.create_training_session(TrainingSessionSpec(base_model, **spec))
        return Session(backend, info.model_id)

    return make
